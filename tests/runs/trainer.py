"""Short Trainer runs used by the Trainer tests (inside spawned processes)."""

from __future__ import annotations

import os
import tempfile

import torch
from datasets import Dataset
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

import seqpar_hf

from ..helpers.models import SEQ2SEQ, VOCAB, build_model


def synthetic_dataset(n: int, seed: int) -> Dataset:
    """Copy-like task with varying lengths (padding in every batch)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        src_len = int(torch.randint(3, 17, (1,), generator=g))
        tgt_len = int(torch.randint(2, 13, (1,), generator=g))
        src = torch.randint(3, VOCAB, (src_len,), generator=g).tolist()
        rows.append({"input_ids": src, "attention_mask": [1] * src_len, "labels": (src * 2)[: tgt_len - 1] + [2]})
    return Dataset.from_list(rows)


def collate(features):
    """Pad to the longest in the batch (inputs with 0, labels with -100)."""
    src = max(len(f["input_ids"]) for f in features)
    tgt = max(len(f["labels"]) for f in features)
    pad = lambda xs, n, v: xs + [v] * (n - len(xs))
    labels = torch.tensor([pad(f["labels"], tgt, -100) for f in features])
    # decoder inputs from the labels, as DataCollatorForSeq2Seq(model=...) builds them (start token 0)
    decoder_input_ids = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1).clamp(min=0)
    return {
        "input_ids": torch.tensor([pad(f["input_ids"], src, 0) for f in features]),
        "attention_mask": torch.tensor([pad(f["attention_mask"], src, 0) for f in features]),
        "labels": labels,
        "decoder_input_ids": decoder_input_ids,
    }


def collate_causal(features):
    """A decoder-only model's rows: the source tokens, then the target; the loss on all of them."""
    rows = [f["input_ids"] + f["labels"] for f in features]
    longest = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (longest - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Recorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({"step": state.global_step, **(logs or {})})


def make_trainer(
    sp: int = 0,
    batch: int = 8,
    accumulation: int = 1,
    label_smoothing: float = 0.0,
    steps: int = 6,
    mode: str = "ulysses",
    extra: dict | None = None,
    eval_batch: int | None = None,
    output_dir: str | None = None,
    train_size: int = 48,
    eval_size: int = 13,
    tp: int = 1,
    family: str = "marian",
):
    """A tiny Marian (or `family`) and its trainer: `steps` steps, evaluating every 3, logging every step.

    sp=0: the plain transformers Seq2SeqTrainer (the reference, one process). Otherwise
    SequenceParallelTrainer with `batch` per device and `accumulation` steps.
    """
    if not (extra or {}).get("fsdp"):
        # accelerate's Accelerator leaves ACCELERATE_USE_FSDP=true behind after an FSDP run; a later
        # trainer in this process would read it as a request for FSDP
        os.environ.pop("ACCELERATE_USE_FSDP", None)
    model = build_model(family, heads=4)
    train, evaluation = synthetic_dataset(train_size, seed=1), synthetic_dataset(eval_size, seed=2)
    common = dict(
        output_dir=output_dir or tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=eval_batch or batch,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
        report_to=[],
        seed=0,
        label_smoothing_factor=label_smoothing,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    common.update(extra or {})
    recorder = Recorder()
    kwargs = dict(
        model=model,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collate if family in SEQ2SEQ else collate_causal,
        callbacks=[recorder],
    )
    if sp == 0:
        trainer = Seq2SeqTrainer(args=Seq2SeqTrainingArguments(**common), **kwargs)
    else:
        args = seqpar_hf.SequenceParallelArguments(sp_size=sp, sp_mode=mode, tp_size=tp, **common)
        trainer = seqpar_hf.SequenceParallelTrainer(args=args, **kwargs)
    return trainer, recorder


def run(resume: str | None = None, **kwargs) -> list[dict]:
    """Train (or resume from checkpoint `resume`) and return the logs. family "vlm": examples/vlm_images.py's
    trainer (a tiny Qwen2.5-VL on rows of 0-2 images, the collator a user writes), 6 steps."""
    if kwargs.get("family") == "vlm":
        from examples.vlm_images import make_trainer as vlm_trainer

        recorder = Recorder()
        vlm_trainer(kwargs.get("sp", 0), max_steps=6, output_dir=tempfile.mkdtemp(), callbacks=[recorder]).train()
        return recorder.logs
    trainer, recorder = make_trainer(**kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return recorder.logs


def run_many(configs: list[dict]) -> list[list[dict]]:
    """Several `run`s in one process group (one spawn)."""
    return [run(**c) for c in configs]


def _row_id(row: torch.Tensor) -> tuple:
    return tuple(t for t in row.tolist() if t != 0)  # the example's source tokens (random, so unique)


def data_and_prediction_checks(drop_last: bool, fsdp: bool = False) -> dict:
    """sp=2 x dp=2: one epoch of training batches; predict() with logits and with generation
    (with `fsdp`, on a model sharded over the 4 ranks)."""
    import torch.distributed as dist

    # group_by_length: batches of similar length for training; evaluation must keep the dataset order
    trainer, _ = make_trainer(
        sp=2,
        batch=3,
        eval_batch=3,
        train_size=22,
        eval_size=13,
        extra=dict(
            dataloader_drop_last=drop_last,
            train_sampling_strategy="group_by_length",
            **({"fsdp": "full_shard"} if fsdp else {}),
        ),
    )
    layout = trainer.layout
    epoch = [[_row_id(r) for r in batch["input_ids"]] for batch in trainer.get_train_dataloader()]
    epochs = [None] * layout.world_size
    dist.all_gather_object(epochs, epoch)
    result = {
        "epochs": epochs,
        "sp_size": layout.sp_size,
        "train": [_row_id(torch.tensor(r)) for r in trainer.train_dataset["input_ids"]],
    }
    if drop_last:
        return result

    dataset = trainer.eval_dataset
    reference = build_model("marian", heads=4).eval()  # same seed: the weights the trainer holds
    output = trainer.predict(dataset)
    errors = []
    for i in range(len(dataset)):
        single = collate([dataset[i]])
        with torch.no_grad():
            expected = reference(**single).logits[0]
        got = torch.as_tensor(output.predictions[i, : expected.shape[0]])
        errors.append(((got - expected).norm() / expected.norm()).item())
    result.update(
        n_predictions=len(output.predictions),
        n_labels=len(output.label_ids),
        logits_err=max(errors),
        steps=output.metrics["test_steps_per_second"] * output.metrics["test_runtime"],
    )

    trainer.args.predict_with_generate = True
    generated = trainer.predict(dataset, max_new_tokens=6).predictions
    mismatches = 0
    for i in range(len(dataset)):
        single = collate([dataset[i]])
        expected = reference.generate(
            input_ids=single["input_ids"], attention_mask=single["attention_mask"], max_new_tokens=6, do_sample=False
        )[0].tolist()
        got = [t for t in generated[i].tolist() if t >= 0]
        mismatches += got[: len(expected)] != expected or any(t != 0 for t in got[len(expected) :])
    result.update(n_generated=len(generated), generation_mismatches=mismatches)
    return result


def resume_run(output_dir: str, sp: int = 2, tp: int = 1, fsdp: bool = False) -> dict:
    """6 steps saving at step 3; then a fresh trainer resumes from checkpoint-3."""
    extra = dict(save_strategy="steps", save_steps=3, **({"fsdp": "full_shard"} if fsdp else {}))
    full = run(sp=sp, tp=tp, steps=6, output_dir=output_dir, extra=extra)
    resumed = run(
        sp=sp,
        tp=tp,
        steps=6,
        output_dir=output_dir + "-resumed",
        extra=extra,
        resume=os.path.join(output_dir, "checkpoint-3"),
    )
    return {"full": full, "resumed": resumed, "checkpoint": os.path.join(output_dir, "checkpoint-6")}


def plain_eval(checkpoint: str) -> float:
    """One process, plain transformers: load the checkpoint and evaluate it like the trainer did."""
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(checkpoint)
    args = Seq2SeqTrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_eval_batch_size=8, report_to=[], use_cpu=True, disable_tqdm=True
    )
    trainer = Seq2SeqTrainer(model=model, args=args, data_collator=collate)
    return trainer.evaluate(synthetic_dataset(13, seed=2))["eval_loss"]


def plain_eval_many(checkpoints: list[str]) -> list[float]:
    return [plain_eval(c) for c in checkpoints]


def tp_generation_check() -> dict:
    """tp=2: predict() with generation (a plain copy with the full weights generates) equals one process."""
    trainer, _ = make_trainer(sp=1, tp=2, batch=8, eval_size=13)
    trainer.args.predict_with_generate = True
    generated = trainer.predict(trainer.eval_dataset, max_new_tokens=6).predictions
    reference = build_model("marian", heads=4).eval()
    mismatches = 0
    for i in range(len(trainer.eval_dataset)):
        single = collate([trainer.eval_dataset[i]])
        expected = reference.generate(
            input_ids=single["input_ids"], attention_mask=single["attention_mask"], max_new_tokens=6, do_sample=False
        )[0].tolist()
        got = [t for t in generated[i].tolist() if t >= 0]
        mismatches += got[: len(expected)] != expected or any(t != 0 for t in got[len(expected) :])
    return {"rows": len(generated), "mismatches": mismatches}


# name -> (world, run config): the same global batch of 8 everywhere, for training and evaluation
# (13 eval examples: the last global batch is partial). Label smoothing is checked once (sp2-ls).
SETUPS = {
    "sp2": (2, dict(sp=2, batch=8)),
    "sp2-t5": (2, dict(sp=2, batch=8, family="t5")),  # relative position bias, the model's own two stacks
    "sp2-vlm": (2, dict(sp=2, family="vlm")),  # images: the vision tower runs on every rank, the text model sharded
    "sp2-ls": (2, dict(sp=2, batch=8, label_smoothing=0.1)),
    "sp2-ga2": (2, dict(sp=2, batch=4, accumulation=2, eval_batch=8)),
    "tp2": (2, dict(sp=1, tp=2, batch=8)),
    "sp2xdp2": (4, dict(sp=2, batch=4, eval_batch=4)),
    # Granite 4: Mamba2 mixers split by heads with the gated norm's sums all-reduced, MoE, attention
    "sp2xdp2-granite4": (4, dict(sp=2, batch=4, eval_batch=4, family="granitemoehybrid")),
    "tp2xsp2": (4, dict(sp=2, tp=2, batch=8)),
    "sp2xdp2-fsdp": (4, dict(sp=2, batch=4, eval_batch=4, extra=dict(fsdp="full_shard"))),
    "tp2xsp2-fsdp": (4, dict(sp=2, tp=2, batch=8, extra=dict(fsdp="full_shard"))),
}
RESUME = {"sp2-tp1": dict(sp=2, tp=1), "sp1-tp2": dict(sp=1, tp=2), "sp2-fsdp": dict(sp=2, tp=1, fsdp=True)}
# resumed at another layout from RESUME's checkpoint-3: optimizer state numbered by torch (tp 1) or by name (tp 2,
# its groups split per device mesh) is converted by name
RESUME_ACROSS = {"sp2-tp1->sp1-tp2": ("sp2-tp1", dict(sp=1, tp=2)), "sp1-tp2->sp2-tp1": ("sp1-tp2", dict(sp=2, tp=1))}


def resume_across(resume_dir: str) -> dict:
    """The last 3 steps of RESUME's runs, at the other layout (no checkpoints written)."""
    return {
        name: run(
            sp=config["sp"],
            tp=config["tp"],
            steps=6,
            output_dir=f"{resume_dir}/{name}",
            extra=dict(save_strategy="no"),
            resume=f"{resume_dir}/{source}/checkpoint-3",
        )
        for name, (source, config) in RESUME_ACROSS.items()
    }
