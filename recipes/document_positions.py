"""Where a document model loses to the sentence model: its translation of each test document split at its sentence
markers, scored by sentence position within the document beside a sentence model's translation of the same
sentences (each alone, `document_baseline.py`).

    python recipes/document_positions.py --model runs/documents --baseline runs/default [--out positions.json]

The document model (recipes/train_translation.py --document_sentences 32, numbered sentence markers) translates the
document mode's 74 test documents as the recipe's test does (beam 8, the markers' order enforced, the per-sentence
length bound, no n-gram rule, bf16 where the recipe trains in bf16), one process. Its output is cut at the
markers: the tokens after marker k (up to the next marker) are its translation of sentence k; a marker it never
wrote leaves its sentence empty. Reported per range of positions (1-8, 9-16, ...) and per range of source length
(English words, ranges of about as many sentences each): the document model's BLEU, the
sentence model's, the sentences left empty, and the length of the translations against the references' (words);
and the document BLEU of both, as the recipe scores documents. Nothing is trained.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the BLEU metric is local; nothing to download

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

if __package__:  # imported as recipes.document_positions (tests)
    from . import document_baseline as db
    from . import translation_data
    from .sentence_positions import install_from_config
    from .train_translation import DEFAULT_BATCH, DOCUMENT_TEST_BEAMS, DataArguments
    from .translation_training import bleu_metric, choose_precision, use_the_cores
else:  # launched as a script: its folder is on sys.path
    import document_baseline as db
    import translation_data
    from sentence_positions import install_from_config
    from train_translation import DEFAULT_BATCH, DOCUMENT_TEST_BEAMS, DataArguments
    from translation_training import bleu_metric, choose_precision, use_the_cores


def split_at_markers(ids: list[int], markers: list[int], size: int) -> tuple[list[list[int]], int]:
    """A generated document [ids] -> the ids of each of its `size` sentences (after marker k, up to the next
    marker; empty where marker k is missing), and how many markers were missing."""
    where = {m: k for k, m in enumerate(markers[:size])}
    pieces: list[list[int]] = [[] for _ in range(size)]
    current, seen = None, set()
    for token in ids:
        if token in where:
            current = where[token]
            seen.add(current)
        elif current is not None:
            pieces[current].append(token)
    return pieces, size - len(seen)


def words(texts) -> int:
    return sum(len(t.split()) for t in texts)


def length_ranges(lengths: list[int], groups: int) -> list[tuple[int, int]]:
    """Source lengths (words) in up to `groups` ranges of about as many sentences each, by their quantiles:
    [3, 5, 5, 7, 9, 12], 3 -> (3, 4), (5, 8), (9, 12); one length never splits across two ranges."""
    ordered = sorted(lengths)
    cuts = sorted({ordered[min(len(ordered) - 1, len(ordered) * i // groups)] for i in range(1, groups)})
    bounds = [ordered[0] - 1] + [c - 1 for c in cuts if c - 1 >= ordered[0]] + [ordered[-1]]
    return [(bounds[i] + 1, bounds[i + 1]) for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="BLEU by sentence position of a document model's test translations, cut at its sentence "
        "markers, beside a sentence model's translations of the same sentences (recipes/README.md, documents).",
        epilog="Example: python recipes/document_positions.py --model runs/documents --baseline runs/default",
    )
    parser.add_argument("--model", required=True, help="a document model saved by recipes/train_translation.py")
    parser.add_argument("--baseline", help="a sentence model saved by the recipe (its translations per position)")
    parser.add_argument("--document_sentences", type=int, default=32, help="sentences per document, as trained")
    parser.add_argument(
        "--num_beams", type=int, default=DOCUMENT_TEST_BEAMS, help="beam size (the recipe's test of documents: 8)"
    )
    parser.add_argument("--batch_size", type=int, default=16, help="documents per generate() call (the recipe's: 16)")
    parser.add_argument("--position_groups", type=int, default=4, help="ranges of positions")
    parser.add_argument(
        "--length_groups", type=int, default=4, help="ranges of source length (English words), about even in size"
    )
    parser.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto", help="as the recipe's")
    parser.add_argument("--num_threads", type=int, default=0, help="torch threads (0: the usable cores)")
    parser.add_argument("--data_cache_dir", default=DataArguments.data_cache_dir, help="the recipe's data cache")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if (
        args.document_sentences < 2
        or min(args.num_beams, args.batch_size, args.position_groups, args.length_groups) < 1
    ):
        parser.error(
            "--document_sentences must be >= 2, --num_beams, --batch_size, --position_groups, --length_groups >= 1"
        )
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    n = args.document_sentences
    threads = use_the_cores(args.num_threads)
    precision = choose_precision(args.precision, SimpleNamespace(use_cpu=True, bf16=False, mixed_precision="no"))
    data = db.test_data(args.data_cache_dir, n)
    sentence_args, document_args, test, document_test = (
        data.sentence_args,
        data.document_args,
        data.test,
        data.document_test,
    )
    sentence_tokenizer, document_tokenizer, references = (
        data.sentence_tokenizer,
        data.document_tokenizer,
        data.references,
    )

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if translation_data.tokenizer_digest(tokenizer) != translation_data.tokenizer_digest(document_tokenizer):
        raise SystemExit(f"{args.model}: not the tokenizer of the recipe's documents of {n} ({args.data_cache_dir})")
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, dtype=torch.float32).eval()
    install_from_config(model, tokenizer)  # a model trained with --sentence_positions gets its positions back
    print(f"translating {len(document_test)} test documents with {args.model}: beam {args.num_beams}, {precision}")
    document_args.no_repeat_ngram_size = 0  # as the recipe's documents: a document repeats 3-grams
    ids, seconds = db.translate(
        model, tokenizer, document_test, document_args, args.num_beams, args.batch_size, precision == "bf16", False
    )
    markers = [tokenizer.convert_tokens_to_ids(translation_data.marker(k)) for k in range(1, n + 1)]
    sizes = translation_data.document_sizes(len(test), n)
    hypotheses, empty_at = [], []
    for row, size in zip(ids, sizes):
        pieces, _ = split_at_markers(row, markers, size)
        hypotheses += translation_data.decode_french(tokenizer, pieces)
        empty_at += [not p for p in pieces]
    metric = bleu_metric()
    documents_bleu = metric.compute(predictions=translation_data.decode_french(tokenizer, ids), references=references)[
        "score"
    ]

    baseline = None
    if args.baseline:
        base_tokenizer = AutoTokenizer.from_pretrained(args.baseline)
        base_model = AutoModelForSeq2SeqLM.from_pretrained(args.baseline, dtype=torch.float32).eval()
        if translation_data.tokenizer_digest(base_tokenizer) != translation_data.tokenizer_digest(sentence_tokenizer):
            raise SystemExit(f"{args.baseline}: not the tokenizer of the recipe's sentence data")
        print(f"translating {len(test)} test sentences alone with {args.baseline}")
        baseline, _ = db.translate(
            base_model, base_tokenizer, test, sentence_args, args.num_beams,
            DEFAULT_BATCH["per_device_eval_batch_size"], precision == "bf16",
        )  # fmt: skip

    def scores(at: list[int], key: str, value: str) -> dict:
        refs = [test["fr_refs"][i] for i in at]
        row = {
            key: value,
            "sentences": len(at),
            "document_model_bleu": metric.compute(predictions=[hypotheses[i] for i in at], references=refs)["score"],
            "empty": sum(empty_at[i] for i in at),
            "length_ratio": words(hypotheses[i] for i in at) / max(1, words(r[0] for r in refs)),
        }
        if baseline is not None:
            row["sentence_model_bleu"] = metric.compute(predictions=[baseline[i] for i in at], references=refs)["score"]
            row["sentence_model_length_ratio"] = words(baseline[i] for i in at) / max(1, words(r[0] for r in refs))
        return row

    positions = db.sentence_positions(len(test), n)
    rows = [
        scores([i for i, k in enumerate(positions) if first <= k <= last], "positions", f"{first}-{last}")
        for first, last in db.position_ranges(n, args.position_groups)
    ]
    lengths = [len(en.split()) for en in test["en"]]  # the English source, as written
    by_length = [
        scores([i for i, w in enumerate(lengths) if first <= w <= last], "source_words", f"{first}-{last}")
        for first, last in length_ranges(lengths, args.length_groups)
    ]
    result = {
        "command": ["python", *sys.argv] if argv is None else ["recipes/document_positions.py", *argv],
        "date": datetime.date.today().isoformat(),
        "machine": f"{db.cpu_name()}, {threads}",
        "model": os.path.abspath(args.model),
        "baseline": os.path.abspath(args.baseline) if args.baseline else None,
        "precision": precision,
        "num_beams": args.num_beams,
        "document_model_document_bleu": documents_bleu,
        "document_model_sentence_bleu": metric.compute(predictions=hypotheses, references=test["fr_refs"])["score"],
        "sentences_left_empty": sum(empty_at),
        "by_position": rows,
        "by_source_length": by_length,
        "decoding_s": round(seconds, 1),
    }
    if baseline is not None:
        result["sentence_model_document_bleu"] = metric.compute(
            predictions=db.join_per_document(baseline, n), references=references
        )["score"]
        result["sentence_model_sentence_bleu"] = metric.compute(predictions=baseline, references=test["fr_refs"])[
            "score"
        ]
    print(f"\n{args.model} (documents of {n}) against {args.baseline or 'no baseline'} (each sentence alone)")
    print(f"  document BLEU: {documents_bleu:.2f}  sentence BLEU of the cut translations: "
          f"{result['document_model_sentence_bleu']:.2f}; sentences left empty: {sum(empty_at)}")  # fmt: skip
    for key, label in (("positions", "positions"), ("source_words", "source words")):
        for row in rows if key == "positions" else by_length:
            base = f"  sentence model {row['sentence_model_bleu']:6.2f}" if baseline is not None else ""
            own = row["document_model_bleu"]
            print(
                f"  {label} {row[key]:>5} ({row['sentences']:4d}): document model {own:6.2f}{base}"
                f"  empty {row['empty']:3d}  length {row['length_ratio']:.2f}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"  written: {args.out}")
    return result


if __name__ == "__main__":
    main()
