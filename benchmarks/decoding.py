"""Test decoding of a trained translation model, with and without the repetition guards.

    python -m benchmarks.decoding runs/default            # the recipe's saved model (--output_dir)

Beam search (4 beams) over the recipe's test set, batches of 128 sentences, one process, twice:
"before" is what the recipe did before the guards (max_length 80 tokens, no per-sentence bound,
no n-gram blocking); "after" is its default now (`--max_length_a 1.5 --max_length_b 10`: at most
1.5 x source tokens + 10 per sentence, and `--no_repeat_ngram_size 3`). Prints BLEU (sacrebleu,
all references) and decoding time for each, and the share of outputs that reach the length limit.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, DataCollatorForSeq2Seq, LogitsProcessorList

from recipes import translation_data
from recipes import translation_training as recipe

ROOT = Path(__file__).resolve().parents[1]


def decode(model, tokenizer, test, batch_size: int, guards: bool, max_length: int = 80) -> tuple[list[str], float, int]:
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    outputs, at_limit = [], 0
    start = time.perf_counter()
    for i in range(0, len(test), batch_size):
        rows = [
            {"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]}
            for r in test.select(range(i, min(i + batch_size, len(test))))
        ]
        inputs = collator(rows)
        kwargs = dict(num_beams=4, max_length=max_length, no_repeat_ngram_size=3 if guards else 0)
        if guards:
            limits = (1.5 * inputs["attention_mask"].sum(-1)).ceil().long() + 10
            kwargs["logits_processor"] = LogitsProcessorList(
                [recipe.SourceLengthLimit(limits, tokenizer.eos_token_id, 1)]
            )
        with torch.no_grad():
            ids = model.generate(**inputs, **kwargs)
        at_limit += int((~ids.eq(tokenizer.eos_token_id).any(-1)).sum())  # no end of sentence: cut at the limit
        outputs += translation_data.decode_french(tokenizer, ids.tolist())
    return outputs, time.perf_counter() - start, at_limit


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--data_cache_dir", default=str(ROOT / "cache"))
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--lowercase", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    tokenizer, splits = translation_data.prepare(
        args.data_cache_dir,
        vocab_size=8000,
        seed=0,
        max_source_length=80,
        max_target_length=80,
        lowercase=args.lowercase,
    )
    test = splits["test"]
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_dir).eval()
    model.generation_config.no_repeat_ngram_size = None
    metric = recipe.bleu_metric()
    for name, guards in (
        ("before (max_length 80, no guards)", False),
        ("after (1.5 x source + 10, no 3-gram repeats)", True),
    ):
        hypotheses, seconds, at_limit = decode(model, tokenizer, test, args.batch_size, guards)
        bleu = metric.compute(predictions=hypotheses, references=test["fr_refs"])["score"]
        print(
            f"{name}: test BLEU {bleu:.2f}, decoding {seconds:.0f} s, {at_limit} of {len(test)} outputs at the "
            f"80-token limit",
            flush=True,
        )


if __name__ == "__main__":
    main()
