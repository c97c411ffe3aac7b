"""bf16 asked for is bf16 trained: `TrainingArguments` turns `bf16` into `mixed_precision` in `__post_init__`
and the Trainer's Accelerator reads only that, so a flag set afterwards (as the translation recipe's
`--precision auto` did) trained in fp32 while the logs said bf16. One process, a tiny model, one step."""

from __future__ import annotations

import torch
from datasets import Dataset

import seqpar_hf

from .helpers.models import build_model


def _linear_dtypes_of_one_step(args) -> set:
    """The output dtypes of every Linear in the training step's forward (the last forward run)."""
    model = build_model("marian")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    seen = []
    for module in linears:
        module.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    rows = [{"input_ids": [5, 6, 7, 2], "labels": [8, 9, 2]}] * 2
    trainer = seqpar_hf.SequenceParallelTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    return set(seen[-len(linears) :])


def _args(tmp_path, **kwargs):
    return seqpar_hf.SequenceParallelArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        per_device_train_batch_size=2,
        save_strategy="no",
        **kwargs,
    )


def test_bf16_set_after_the_arguments_still_trains_in_bf16(tmp_path):
    args = _args(tmp_path)
    args.bf16 = True  # after __post_init__: plain transformers would train this in fp32
    assert _linear_dtypes_of_one_step(args) == {torch.bfloat16}
    assert _linear_dtypes_of_one_step(_args(tmp_path)) == {torch.float32}


def test_recipe_precision_reaches_the_trainer(tmp_path):
    from transformers import Seq2SeqTrainingArguments

    from recipes.translation_training import choose_precision

    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert choose_precision("bf16", args) == "bf16" and args.mixed_precision == "bf16"
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert choose_precision("fp32", args) == "fp32" and args.mixed_precision == "no"
