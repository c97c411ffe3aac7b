"""The baseline of document-level translation: a sentence model translating each sentence of the test documents
alone, its translations joined per document, scored with the document BLEU of `--document_sentences`.

    python recipes/document_baseline.py --model runs/default [--document_sentences 32] [--num_beams 4] \
        [--out baseline.json]

Why: the recipe's document mode (`recipes/train_translation.py --document_sentences 32`) reports document BLEU,
each joined translation of a test document against the joined references; that number means something only
beside what a sentence model gets on the same documents with the same metric. This script rebuilds the
document mode's test documents (the recipe's own `translation_data.prepare` call for documents: the same
split, order and grouping) and checks that joining the sentence test gives exactly their texts and
references; it translates the sentence test one sentence per row as the recipe's test does (its batches,
beam search, per-sentence length bound, no-repeat n-grams for sentences, precision), detokenizes with
`decode_french`, joins the translations per document as `join_documents` joins the references (a space
between sentences; the document scoring drops the markers, `decode_french` skipping special tokens, so
nothing is scored with markers), and reports:
- sentence BLEU (the recipe's sentence test: the run_summary.json of a recipe model gives its own to compare),
- document BLEU over the test documents (what the document mode reports),
- BLEU by sentence position within the document (corpus BLEU of the sentences at positions 1-8, 9-16, ...),
- the decoding time.
Nothing is trained. The data caches are the recipe's (`--data_cache_dir`): the documents' entry is built on
first use, like the document run's one-time preparation (about 30 s on 2 cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the BLEU metric is local; nothing to download

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq

if __package__:  # imported as recipes.document_baseline (tests)
    from . import translation_data
    from .train_translation import DEFAULT_BATCH, DataArguments, RecipeTrainingArguments
    from .translation_training import bleu_metric, choose_precision, generation_kwargs_fn, use_the_cores
else:  # launched as a script: its folder is on sys.path
    import translation_data
    from train_translation import DEFAULT_BATCH, DataArguments, RecipeTrainingArguments
    from translation_training import bleu_metric, choose_precision, generation_kwargs_fn, use_the_cores

SEED = RecipeTrainingArguments.__dataclass_fields__["seed"].default  # the recipe's split and tokenizer seed
DOCUMENT_MODEL_BLEU = {"with markers": 52.95, "without markers": 24.53}  # recipes/README.md (the second: dropout 0.1)


def recipe_data(data_args: DataArguments):
    """(tokenizer, splits) exactly as recipes/train_translation.py prepares them for `data_args`."""
    docs = data_args.document_sentences
    return translation_data.prepare(
        data_args.data_cache_dir,
        vocab_size=data_args.vocab_size,
        seed=SEED,
        document_sentences=docs,
        max_source_length=data_args.max_source_length or 80 * docs,
        max_target_length=data_args.max_target_length or 80 * docs,
        max_pairs=data_args.max_pairs,
        lowercase=data_args.lowercase,
        mixed_documents=data_args.mixed_documents,
        sentence_separator=data_args.sentence_separator,
        sentence_markers=data_args.sentence_markers,
    )


def test_data(data_cache_dir: str, n: int) -> SimpleNamespace:
    """The recipe's data for sentences (what a sentence model is tested on) and for documents of `n` (the document
    mode's test documents; documents of N sentences as the README's document command: only training changes),
    checked to be the same: the sentence test joined per document gives the document test's texts and references.
    Fields: sentence_args, document_args, sentence_tokenizer, document_tokenizer, test, document_test, references."""
    sentence_args = DataArguments(data_cache_dir=data_cache_dir)
    document_args = DataArguments(data_cache_dir=data_cache_dir, document_sentences=n, mixed_documents=False)
    sentence_tokenizer, sentences = recipe_data(sentence_args)
    document_tokenizer, documents = recipe_data(document_args)
    test, document_test = sentences["test"], documents["test"]
    same_texts = join_per_document(test["en"], n) == document_test["en"]
    references = document_references(test["fr_refs"], n)
    if not same_texts or references != document_test["fr_refs"]:
        raise SystemExit(
            f"the sentence test ({len(test)} sentences) joined per {n} is not the document test "
            f"({len(document_test)} documents): {'references' if same_texts else 'English texts'} differ"
        )
    return SimpleNamespace(
        sentence_args=sentence_args, document_args=document_args, sentence_tokenizer=sentence_tokenizer,
        document_tokenizer=document_tokenizer, test=test, document_test=document_test, references=references,
    )  # fmt: skip


def join_per_document(texts: Sequence[str], n: int) -> list[str]:
    """Sentence texts in test order -> one text per document, joined as `join_documents` joins the documents'
    texts and references (every n consecutive sentences, a space between them)."""
    return [d["text"] for d in translation_data.join_documents([{"text": t} for t in texts], n)]


def document_references(sentence_refs: Sequence[Sequence[str]], n: int) -> list[list[str]]:
    """Each sentence's references in test order -> each document's references, as the document mode builds
    them (`join_documents`: reference k joins each sentence's k-th reference, or its first)."""
    return [d["fr_refs"] for d in translation_data.join_documents([{"fr_refs": list(r)} for r in sentence_refs], n)]


def sentence_positions(count: int, n: int) -> list[int]:
    """The 1-based position of each of `count` test sentences within its document (`document_sizes`)."""
    return [k for size in translation_data.document_sizes(count, n) for k in range(1, size + 1)]


def position_ranges(n: int, groups: int) -> list[tuple[int, int]]:
    """Positions 1..n in `groups` consecutive ranges (32, 4: 1-8, 9-16, 17-24, 25-32)."""
    bounds = [n * i // groups for i in range(groups + 1)]
    return [(bounds[i] + 1, bounds[i + 1]) for i in range(groups) if bounds[i + 1] > bounds[i]]


def translate(
    model, tokenizer, test, data_args, num_beams: int, batch_size: int, bf16: bool, decode: bool = True
) -> tuple[list, float]:
    """French text of each test row, decoded as the recipe's test decodes sentences (`trainer.predict`: batches
    in test order padded by the same collator, `generation_kwargs_fn`'s per-sentence length bound (and with
    documents the markers' order), the recipe's max length and no-repeat n-grams, bf16 autocast where the recipe
    trains in bf16); `decode=False`: the generated ids (document_positions.py cuts them at the markers)."""
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    per_batch = generation_kwargs_fn(data_args, tokenizer)
    max_length = data_args.max_target_length or 80 * data_args.document_sentences
    hypotheses, start = [], time.perf_counter()
    for i in range(0, len(test), batch_size):
        rows = test.select(range(i, min(i + batch_size, len(test))))
        inputs = collator([{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"]} for r in rows])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            ids = model.generate(
                **inputs,
                num_beams=num_beams,
                max_length=max_length,
                no_repeat_ngram_size=data_args.no_repeat_ngram_size or None,
                **per_batch(inputs),
            )
        hypotheses += translation_data.decode_french(tokenizer, ids.tolist()) if decode else ids.tolist()
        print(f"\r  translated {len(hypotheses)} / {len(test)} rows", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return hypotheses, time.perf_counter() - start


def cpu_name() -> str:
    """The CPU's model name (for the JSON record)."""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Document BLEU of a sentence model: each sentence of the document mode's test documents "
        "translated alone, the translations joined per document like the references, scored like the document "
        "mode (recipes/README.md, documents). Also sentence BLEU and BLEU by position within the document.",
        epilog="Example: python recipes/document_baseline.py --model runs/default --out baseline.json",
    )
    parser.add_argument("--model", required=True, help="a sentence model saved by recipes/train_translation.py")
    parser.add_argument(
        "--document_sentences", type=int, default=32, help="sentences per test document, as the document mode's flag"
    )
    parser.add_argument("--num_beams", type=int, default=4, help="beam size (the recipe's --test_num_beams: 4)")
    parser.add_argument(
        "--batch_size",
        type=int,
        default=DEFAULT_BATCH["per_device_eval_batch_size"],
        help="sentences per generate() call (the recipe's test batch: %(default)s)",
    )
    parser.add_argument("--position_groups", type=int, default=4, help="ranges of positions for BLEU by position")
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="as the recipe's --precision (auto: bf16 on a CPU with AVX512-BF16 or AMX, as its test decoded)",
    )
    parser.add_argument("--num_threads", type=int, default=0, help="torch threads (0: the usable cores)")
    parser.add_argument(
        "--data_cache_dir", default=DataArguments.data_cache_dir, help="the recipe's data cache (default: %(default)s)"
    )
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    for flag in ("document_sentences", "num_beams", "batch_size", "position_groups"):
        if getattr(args, flag) < (2 if flag == "document_sentences" else 1):
            parser.error(f"--{flag} {getattr(args, flag)}: too small")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    n = args.document_sentences
    threads = use_the_cores(args.num_threads)
    precision = choose_precision(args.precision, SimpleNamespace(use_cpu=True, bf16=False, mixed_precision="no"))

    data = test_data(args.data_cache_dir, n)
    sentence_args, test, document_test, references = data.sentence_args, data.test, data.document_test, data.references

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if translation_data.tokenizer_digest(tokenizer) != translation_data.tokenizer_digest(data.sentence_tokenizer):
        raise SystemExit(f"{args.model}: not the tokenizer of the recipe's sentence data ({args.data_cache_dir})")
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, dtype=torch.float32).eval()
    print(
        f"translating {len(test)} test sentences ({len(document_test)} documents) with {args.model}: "
        f"beam {args.num_beams}, {precision}, {threads}",
        file=sys.stderr,
    )
    hypotheses, seconds = translate(
        model, tokenizer, test, sentence_args, args.num_beams, args.batch_size, precision == "bf16"
    )

    metric = bleu_metric()
    sentence = metric.compute(predictions=hypotheses, references=test["fr_refs"])
    document = metric.compute(predictions=join_per_document(hypotheses, n), references=references)
    positions = sentence_positions(len(test), n)
    by_position = []
    for first, last in position_ranges(n, args.position_groups):
        rows = [i for i, k in enumerate(positions) if first <= k <= last]
        score = metric.compute(predictions=[hypotheses[i] for i in rows], references=[test["fr_refs"][i] for i in rows])
        by_position.append({"positions": f"{first}-{last}", "sentences": len(rows), "bleu": score["score"]})

    summary_path = Path(args.model) / "run_summary.json"
    recipe_bleu = json.loads(summary_path.read_text()).get("test_bleu") if summary_path.is_file() else None
    result = {
        "command": ["python", *sys.argv] if argv is None else ["recipes/document_baseline.py", *argv],
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu_name()}, {threads}",
        "model": os.path.abspath(args.model),
        "precision": precision,
        "num_beams": args.num_beams,
        "no_repeat_ngram_size": sentence_args.no_repeat_ngram_size,
        "max_length": f"{sentence_args.max_length_a} x source + {sentence_args.max_length_b}, at most 80",
        "test_sentences": len(test),
        "document_sentences": n,
        "test_documents": len(document_test),
        "document_sizes": {  # sentences per document: how many documents have that many
            str(size): count for size, count in Counter(translation_data.document_sizes(len(test), n)).items()
        },
        "sentence_bleu": sentence["score"],
        "recipe_test_bleu": recipe_bleu,
        "document_bleu": document["score"],
        "document_model_bleu": DOCUMENT_MODEL_BLEU,
        "bleu_by_position": by_position,
        "decoding_s": round(seconds, 1),
        "sacrebleu": sentence["signature"],
    }

    print(f"\n{args.model}: each test sentence alone (beam {args.num_beams}, {precision}), joined per document")
    recipe = f"  (the recipe's test: {recipe_bleu:.2f})" if recipe_bleu is not None else ""
    sizes = ", ".join(f"{count} of {size}" for size, count in result["document_sizes"].items())
    print(f"  sentence BLEU ({len(test)} sentences):      {sentence['score']:6.2f}{recipe}")
    print(
        f"  document BLEU ({len(document_test)} documents):       {document['score']:6.2f}  (sentences per document: "
        f"{sizes}; the document model, recipes/README.md: {DOCUMENT_MODEL_BLEU['with markers']}, without markers "
        f"{DOCUMENT_MODEL_BLEU['without markers']})"
    )
    for row in by_position:
        print(f"  positions {row['positions']:>5} ({row['sentences']:4d} sentences): {row['bleu']:6.2f}")
    print(f"  decoding: {seconds:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"  written: {args.out}")
    return result


if __name__ == "__main__":
    main()
