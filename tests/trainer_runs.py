"""Short Trainer runs used by the Trainer tests (inside spawned processes)."""

from __future__ import annotations

import copy
import os
import tempfile

import torch
from datasets import Dataset
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

import seqpar_hf

from .models import VOCAB, build_model


def synthetic_dataset(n: int, seed: int) -> Dataset:
    """Copy-like task with varying lengths (padding in every batch)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        src_len = int(torch.randint(3, 17, (1,), generator=g))
        tgt_len = int(torch.randint(2, 13, (1,), generator=g))
        src = torch.randint(3, VOCAB, (src_len,), generator=g).tolist()
        rows.append({"input_ids": src, "attention_mask": [1] * src_len, "labels": (src * 2)[:tgt_len - 1] + [2]})
    return Dataset.from_list(rows)


def collate(features):
    """Pad to the longest in the batch (inputs with 0, labels with -100)."""
    src = max(len(f["input_ids"]) for f in features)
    tgt = max(len(f["labels"]) for f in features)
    pad = lambda xs, n, v: xs + [v] * (n - len(xs))  # noqa: E731
    labels = torch.tensor([pad(f["labels"], tgt, -100) for f in features])
    # decoder inputs from the labels, as DataCollatorForSeq2Seq(model=...) builds them (start token 0)
    decoder_input_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1).clamp(min=0)
    return {"input_ids": torch.tensor([pad(f["input_ids"], src, 0) for f in features]),
            "attention_mask": torch.tensor([pad(f["attention_mask"], src, 0) for f in features]),
            "labels": labels, "decoder_input_ids": decoder_input_ids}


class Recorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({"step": state.global_step, **(logs or {})})


def run(sp: int = 0, batch: int = 8, accumulation: int = 1, label_smoothing: float = 0.0, steps: int = 6,
        mode: str = "ulysses", extra: dict | None = None, eval_batch: int | None = None) -> list[dict]:
    """Train a tiny Marian for `steps` steps, evaluating every 3; return the logs (world rank 0's).

    sp=0: the plain transformers Seq2SeqTrainer in one process (the reference). Otherwise
    SequenceParallelTrainer with `batch` per device and `accumulation` steps.
    """
    model = build_model("marian", heads=4)
    train, evaluation = synthetic_dataset(48, seed=1), synthetic_dataset(13, seed=2)
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, per_device_eval_batch_size=eval_batch or batch,
                  gradient_accumulation_steps=accumulation, max_steps=steps, learning_rate=1e-3,
                  lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, eval_strategy="steps", eval_steps=3,
                  save_strategy="no", report_to=[], seed=0, label_smoothing_factor=label_smoothing,
                  use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, **(extra or {}))
    recorder = Recorder()
    if sp == 0:
        args = Seq2SeqTrainingArguments(**common)
        trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                 data_collator=collate, callbacks=[recorder])
    else:
        args = seqpar_hf.SequenceParallelArguments(sp_size=sp, sp_mode=mode, **common)
        trainer = seqpar_hf.SequenceParallelTrainer(model=model, args=args, train_dataset=train,
                                                    eval_dataset=evaluation, data_collator=collate,
                                                    callbacks=[recorder])
    trainer.train()
    return recorder.logs


def run_many(configs: list[dict]) -> list[list[dict]]:
    """Several `run`s in one process group (one spawn)."""
    return [run(**c) for c in configs]
