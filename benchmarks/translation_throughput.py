"""Real (non-padding) training tokens per second of the translation recipe's model, side by side in one
run: plain transformers (`Seq2SeqTrainer` as a user would write it: `DataCollatorForSeq2Seq`, the
default random batches, fp32, and the same with `bf16=True`) against seqpar_hf's recipe
(`SequenceParallelTrainer`: packed rows, bf16 where the CPU computes it fast), with the steps in
between to show where the difference comes from.

Every configuration trains the same model (the recipe's `build_model`) on the same data with 96 sentence
pairs per step and no evaluation, for --steps steps; the time of each optimizer step is taken between the
Trainer's step callbacks, the first --warmup steps are dropped, and the rate is real tokens over the time
of the steps measured. The configurations run in turn for --rounds rounds (each round a fresh model), so a
slow spell of the machine hits them all; reported are medians over rounds, and each rate over the plain
Seq2SeqTrainer's.

    python -m benchmarks.translation_throughput              # ~8 min on 2 CPU cores
    python -m benchmarks.translation_throughput --quick      # seconds: checks the script
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

import seqpar_hf
from benchmarks.common import environment, table
from benchmarks.publish import output_options, publish
from recipes import train_translation as recipe
from recipes import translation_data
from seqpar_hf.training.packing import Seq2SeqPackingCollator

ROOT = Path(__file__).resolve().parents[1]

# name, trainer ("plain" transformers / "seqpar_hf"), batches ("random", "group_by_length", packed row size), bf16
CONFIGS = [
    ("plain Seq2SeqTrainer (random batches, fp32)", "plain", "random", False),
    ("plain Seq2SeqTrainer (random batches, bf16=True)", "plain", "random", True),
    ("SequenceParallelTrainer, group_by_length, fp32", "seqpar_hf", "group_by_length", False),
    ("SequenceParallelTrainer, packed rows of 128, fp32", "seqpar_hf", 128, False),
    ("SequenceParallelTrainer, packed rows of 128, bf16 (the recipe's default)", "seqpar_hf", 128, True),
]


class StepTimer(TrainerCallback):
    """Time of each optimizer step, taken between the Trainer's step callbacks."""

    def __init__(self):
        self.times, self.begin = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.begin)


class Counted:
    """A collator that notes the real tokens (attention-mask ones + labelled targets) of every batch it
    builds: the i-th batch is the i-th step's (no gradient accumulation). Counted at the collator because
    the plain Trainer's label smoother takes `labels` out before the model sees them."""

    def __init__(self, collate):
        self.collate, self.tokens = collate, []

    def __call__(self, features):
        batch = self.collate(features)
        self.tokens.append(int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum()))
        return batch


def measure(config: tuple, tokenizer, train, steps: int, warmup: int, out_dir: str) -> dict:
    name, trainer_kind, batches, bf16 = config
    model_args, _, args = recipe.parse_args(
        [
            "--output_dir",
            out_dir,
            "--max_steps",
            str(steps),
            "--logging_steps",
            "1000",
            "--disable_tqdm",
            "true",
            "--precision",
            "fp32",
        ]
    )
    model = recipe.build_model(model_args, tokenizer, 82)
    padded = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    timer = StepTimer()
    if trainer_kind == "plain":  # what a transformers user writes: defaults but for the recipe's hyper-parameters
        plain = Seq2SeqTrainingArguments(
            out_dir,
            max_steps=steps,
            per_device_train_batch_size=96,
            learning_rate=args.learning_rate,
            label_smoothing_factor=0.1,
            logging_steps=1000,
            disable_tqdm=True,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            bf16=bf16,
        )
        counted = Counted(padded)
        trainer = Seq2SeqTrainer(
            model=model,
            args=plain,
            train_dataset=train,
            data_collator=counted,
            processing_class=tokenizer,
            callbacks=[timer],
        )
    else:
        recipe.choose_precision("bf16" if bf16 else "fp32", args)  # sets mixed_precision, which the Trainer reads
        packed = isinstance(batches, int)
        args.train_sampling_strategy = "random" if packed else batches
        collator = (
            Seq2SeqPackingCollator(batches, tokenizer.pad_token_id, model.config.decoder_start_token_id)
            if packed
            else padded
        )
        counted = Counted(collator)
        trainer = seqpar_hf.SequenceParallelTrainer(
            model=model,
            args=args,
            train_dataset=train,
            data_collator=counted,
            processing_class=tokenizer,
            callbacks=[timer],
        )
    trainer.train()
    times, tokens = timer.times[warmup:], counted.tokens[warmup : len(timer.times)]
    return {
        "config": name,
        "steps": len(times),
        "seconds": sum(times),
        "tokens": sum(tokens),
        "rate": sum(tokens) / sum(times),
        "step_s": statistics.median(times),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    output_options(p, "translation_throughput", figure=False)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds = 4, 1, 1
    recipe.use_the_cores(0)
    print(environment(), flush=True)
    tokenizer, splits = translation_data.prepare(
        str(ROOT / "cache"), vocab_size=8000, seed=0, max_source_length=80, max_target_length=80
    )
    train = splits["train"].select_columns(["input_ids", "attention_mask", "labels"])
    records = []
    for r in range(args.rounds):
        for config in CONFIGS:
            rec = measure(config, tokenizer, train, args.steps, args.warmup, "/tmp/translation_throughput")
            rec["round"] = r
            records.append(rec)
            print(
                f"round {r}: {rec['config']}: {rec['rate']:.0f} real tokens/s (median step {rec['step_s']:.3f} s)",
                flush=True,
            )
    base, base_bf16 = (statistics.median(x["rate"] for x in records if x["config"] == CONFIGS[i][0]) for i in (0, 1))
    rows = []
    for name, *_ in CONFIGS:
        mine = [x for x in records if x["config"] == name]
        rate = statistics.median(x["rate"] for x in mine)
        rows.append(
            {
                "config": name,
                "rate": f"{rate:.0f}",
                "ratio": f"{rate / base:.2f}x",
                "ratio_bf16": f"{rate / base_bf16:.2f}x",
                "tokens": f"{statistics.median(x['tokens'] / x['steps'] for x in mine):.0f}",
                "step": f"{statistics.median(x['step_s'] for x in mine):.3f}",
                "all": ", ".join(f"{x['rate']:.0f}" for x in mine),
            }
        )
    print(
        table(
            rows,
            [
                ("trainer and batches (96 pairs per step)", "config"),
                ("real tokens/s (median)", "rate"),
                ("vs plain Seq2SeqTrainer", "ratio"),
                ("vs plain with bf16=True", "ratio_bf16"),
                ("real tokens per step", "tokens"),
                ("median step s", "step"),
                ("per round", "all"),
            ],
        )
    )
    publish("translation_throughput", records, args)


if __name__ == "__main__":
    main()
