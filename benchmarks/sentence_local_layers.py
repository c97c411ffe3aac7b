"""The translation recipe's local sentence layers (`--sentence_local_layers`, recipes/sentence_positions.py): the time
of one training step of the document model, with the lower layers within each sentence on eager or sdpa attention,
every layer within each sentence (at the sentence slots' positions or each from 0, or the same sentences each an
example in its document's form packed into rows of 128 tokens, as `--document_training sentences` trains them),
against no local layer (every layer on seqpar_hf's attention, the Trainer's patched model in one process, as the
recipe runs it).

    python -m benchmarks.sentence_local_layers           # ~2 min on 2 CPU cores
    python -m benchmarks.sentence_local_layers --quick   # 2 steps each, prints only

The recipe's model (3 + 3 layers, d_model 256, 4 heads, feed-forward 1024), bf16 autocast, a step of 96 sentences of
7 source / 8 target tokens with their markers: whole documents (3 rows of 32 sentences) and the ramp's pieces (24 rows
of 4). Each setting runs twice, alternating, so that a drift of the machine's speed shows; the median step of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

import seqpar_hf
from recipes import translation_data
from recipes.document_sentences import sentence_examples
from recipes.sentence_positions import SentencePositions
from recipes.translation_training import build_model
from seqpar_hf.training.packing import Seq2SeqPackingCollator

OUT = Path(__file__).parent / "results" / "sentence_local_layers.json"
SENTENCES = "3 local, from 0, as packed sentences"  # the same sentences in rows of 128 (recipes/document_sentences.py)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 steps per setting; writes nothing")
    parser.add_argument("--steps", type=int, default=10, help="steps per setting (the first 2 not timed)")
    args = parser.parse_args(argv)
    steps = 3 if args.quick else max(args.steps, 3)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    texts = ["the cat sat on the mat .", "le chat est assis sur le tapis ."] * 50
    tokenizer = translation_data.add_markers(translation_data.train_tokenizer(texts, 400), 32)
    sizes = SimpleNamespace(
        d_model=256, encoder_layers=3, decoder_layers=3, attention_heads=4, ffn_dim=1024, dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    model = build_model(sizes, tokenizer, 32 * 80)
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    markers = [tokenizer.convert_tokens_to_ids(translation_data.marker(k)) for k in range(1, 33)]

    def rows(words: int, first: int, count: int) -> list[int]:
        ids = []
        for k in range(first, first + count):
            ids += [markers[k]] + torch.randint(5, len(tokenizer) - 40, (words,)).tolist()
        return ids + [tokenizer.eos_token_id]

    batches = {
        "whole documents (3 x 32 sentences)": (
            torch.tensor([rows(7, 0, 32) for _ in range(3)]),
            torch.tensor([rows(8, 0, 32) for _ in range(3)]),
        ),
        "pieces (24 x 4 sentences)": (
            torch.tensor([rows(7, 4 * (i % 8), 4) for i in range(24)]),
            torch.tensor([rows(8, 4 * (i % 8), 4) for i in range(24)]),
        ),
    }
    optimizer = torch.optim.AdamW(model.parameters())
    settings = [
        ("no local layer", 0, None, 80),
        ("2 local, eager", 2, "eager", 80),
        ("2 local, sdpa", 2, "sdpa", 80),
        ("3 local, eager", 3, "eager", 80),
        ("3 local, from 0", 3, "eager", 0),  # --sentence_position_stride 0
        (SENTENCES, 3, "eager", 0),  # --document_training sentences
    ]
    results: dict = {}
    for batch_name, (source, labels) in batches.items():
        times: dict[str, list[float]] = {name: [] for name, _, _, _ in settings}
        for _ in range(2):
            for name, local, implementation, stride in settings:
                hooks = SentencePositions(model, markers, stride, local)
                for attention, _ in hooks.plain_configs:
                    attention.config._attn_implementation = implementation
                inputs = {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": labels}
                if name == SENTENCES:  # the documents' sentences, each in its document's form, packed
                    examples = [
                        example
                        for src, tgt in zip(source.tolist(), labels.tolist())
                        for example in sentence_examples(src, tgt, markers, model.config.decoder_start_token_id)
                    ]
                    inputs = Seq2SeqPackingCollator(128, tokenizer.pad_token_id, model.config.decoder_start_token_id)(
                        examples
                    )
                step_times = []
                for _ in range(steps):
                    start = time.perf_counter()
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(**inputs, label_smoothing=0.1).loss
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    step_times.append(time.perf_counter() - start)
                hooks.remove()
                times[name].append(1000 * statistics.median(step_times[2:]))
        results[batch_name] = {name: [round(t, 1) for t in value] for name, value in times.items()}
        for name, value in results[batch_name].items():
            print(f"{batch_name:36s} {name:36s} ms per step: {' / '.join(f'{t:.1f}' for t in value)}")
    if not args.quick:
        record = {"threads": torch.get_num_threads(), "torch": torch.__version__, "ms_per_step": results}
        OUT.write_text(json.dumps(record, indent=1) + "\n")
        print(f"written: {OUT}")
    return results


if __name__ == "__main__":
    main()
