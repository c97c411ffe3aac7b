"""Real (non-padding) training tokens per second of the translation recipe's model, same sentence
pairs per step (96), by how the pairs become a batch: random padded batches, length-grouped padded
batches (`group_by_length`, the recipe's default), and packed rows (`--pack_tokens N`), 1 process.

Each configuration trains with the recipe's own Trainer, arguments and collators (no evaluation) for
--steps steps; the time of each optimizer step is taken between the Trainer's step callbacks, the first
--warmup steps are dropped, and the rate is real tokens over the time of the steps measured. The
configurations run in turn for --rounds rounds (each round a fresh model), so a slow spell of the
machine hits them all; reported are the medians over rounds, and each rate over the length-grouped one.

    python benchmarks/packing_throughput.py              # ~6 min on 2 CPU cores
    python benchmarks/packing_throughput.py --quick      # seconds: checks the script
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

import torch  # noqa: E402
from transformers import DataCollatorForSeq2Seq, TrainerCallback  # noqa: E402

import seqpar_hf  # noqa: E402
import train_translation as recipe  # noqa: E402
import translation_data  # noqa: E402
from benchmarks.common import environment, table  # noqa: E402
from benchmarks.publish import output_options, publish  # noqa: E402
from seqpar_hf.training.packing import Seq2SeqPackingCollator  # noqa: E402


class StepTimer(TrainerCallback):
    """Time and real tokens (attention-mask ones + labelled targets, counted at the model's input) of
    each optimizer step."""

    def __init__(self, model):
        self.times, self.tokens, self.begin, self.current = [], [], None, 0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        if module.training:
            self.current += int(kwargs["attention_mask"].sum()) + int((kwargs["labels"] != -100).sum())

    def on_step_begin(self, args, state, control, **kwargs):
        self.current, self.begin = 0, time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.begin)
        self.tokens.append(self.current)


def measure(config: dict, tokenizer, train, steps: int, warmup: int, out_dir: str) -> dict:
    model_args, data_args, args = recipe.parse_args(["--output_dir", out_dir, "--max_steps", str(steps),
                                                     "--eval_strategy", "no", "--logging_steps", "1000",
                                                     "--disable_tqdm", "true"])
    args.train_sampling_strategy = config["sampling"]
    model = recipe.build_model(model_args, tokenizer, 82)
    padded = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    collator = (Seq2SeqPackingCollator(config["pack"], tokenizer.pad_token_id, model.config.decoder_start_token_id)
                if config["pack"] else padded)
    timer = StepTimer(model)
    trainer = seqpar_hf.SequenceParallelTrainer(model=model, args=args, train_dataset=train, data_collator=collator,
                                                processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    times, tokens = timer.times[warmup:], timer.tokens[warmup:]
    return {"config": config["name"], "steps": len(times), "seconds": sum(times), "tokens": sum(tokens),
            "rate": sum(tokens) / sum(times), "step_s": statistics.median(times)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pack", type=int, nargs="+", default=[128, 256], help="packed row sizes (tokens per side)")
    p.add_argument("--quick", action="store_true")
    output_options(p, "packing_throughput", figure=False)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.pack = 4, 1, 1, [128]
    recipe.use_the_cores(0)
    print(environment(), flush=True)
    tokenizer, splits = translation_data.prepare(str(ROOT / "cache"), vocab_size=8000, seed=0, max_source_length=80,
                                                 max_target_length=80)
    train = splits["train"].select_columns(["input_ids", "attention_mask", "labels"])
    configs = [{"name": "random batches", "sampling": "random", "pack": 0},
               {"name": "group_by_length", "sampling": "group_by_length", "pack": 0}] + \
              [{"name": f"packed rows of {n}", "sampling": "random", "pack": n} for n in args.pack]
    records = []
    for r in range(args.rounds):
        for config in configs:
            rec = measure(config, tokenizer, train, args.steps, args.warmup, "/tmp/packing_throughput")
            rec["round"] = r
            records.append(rec)
            print(f"round {r}: {rec['config']}: {rec['rate']:.0f} real tokens/s (median step {rec['step_s']:.3f} s)",
                  flush=True)
    base = statistics.median(x["rate"] for x in records if x["config"] == "group_by_length")
    rows = []
    for config in configs:
        mine = [x for x in records if x["config"] == config["name"]]
        rate = statistics.median(x["rate"] for x in mine)
        rows.append({"config": config["name"], "rate": f"{rate:.0f}", "ratio": f"{rate / base:.2f}x",
                     "tokens": f"{statistics.median(x['tokens'] / x['steps'] for x in mine):.0f}",
                     "step": f"{statistics.median(x['step_s'] for x in mine):.3f}",
                     "all": ", ".join(f"{x['rate']:.0f}" for x in mine)})
    print(table(rows, [("batches (96 pairs per step)", "config"), ("real tokens/s (median)", "rate"),
                       ("vs group_by_length", "ratio"), ("real tokens per step", "tokens"),
                       ("median step s", "step"), ("per round", "all")]))
    publish("packing_throughput", records, args)


if __name__ == "__main__":
    main()
