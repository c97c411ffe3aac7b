"""In-rank bodies (misc group, 2 ranks) of the cases where the ranks of one replica would drift apart: weights
that differ (a trainer that is not sequence-parallel aware, per-rank optimizer settings), training arguments
that differ, a rank in generate while the other is in a forward. Asserted in tests/test_robustness_gloo.py."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

import seqpar_hf

from ..helpers.models import build_model, make_batch
from .robustness import attempt, per_rank

_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def plain_trainer(results: dict, layout) -> None:
    """The plain transformers Trainer given a patched model, in processes it does not see as distributed (a
    process group set up by hand, no launcher variables): no DDP, no data split, so each rank steps on its own
    shard's gradient. Every rank must stop at the second step's forward."""
    from accelerate.state import AcceleratorState
    from torch.nn.parallel import DistributedDataParallel
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

    from .trainer import collate, synthetic_dataset

    steps = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    saved = {k: os.environ.pop(k) for k in _LAUNCH_VARIABLES if k in os.environ}
    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's process state, read from them (private)
    try:
        args = Seq2SeqTrainingArguments(
            output_dir=tempfile.mkdtemp(),
            per_device_train_batch_size=4,
            max_steps=3,
            learning_rate=1e-3,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        model = seqpar_hf.patch_model(build_model("marian"), layout)
        trainer = Seq2SeqTrainer(
            model=model,
            args=args,
            train_dataset=synthetic_dataset(24, seed=1),
            data_collator=collate,
            callbacks=[Steps()],
        )
        results["plain-trainer-diverges"] = attempt(trainer.train)
        results["plain-trainer-diverges-steps"] = (steps, isinstance(trainer.model_wrapped, DistributedDataParallel))
    finally:
        os.environ.update(saved)
        AcceleratorState._reset_state(reset_partial_state=True)


def per_rank_learning_rate(layout):
    """Gradients summed over the replica (what DDP does), each rank stepping with its own learning rate."""
    model = seqpar_hf.patch_model(build_model("llama"), layout).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=per_rank((0.1, 0.2)))
    steps = []

    def train():
        for _ in range(3):
            model(**make_batch("llama", seed=0)).loss.backward()
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
            optimizer.step()
            optimizer.zero_grad()
            steps.append(1)

    return train, steps


def cases(results: dict) -> None:
    layout = seqpar_hf.ParallelLayout(sp_size=2)
    plain_trainer(results, layout)
    train, steps = per_rank_learning_rate(layout)
    results["learning-rates-differ"] = attempt(train)
    results["learning-rates-differ-steps"] = (len(steps), None)

    def tp_norm_differs():  # a replicated DTensor (a TP norm) is compared across the TP ranks
        model = seqpar_hf.patch_model(build_model("llama"), seqpar_hf.ParallelLayout(sp_size=1, tp_size=2))
        with torch.no_grad():
            model.model.norm.weight.to_local().add_(dist.get_rank())
        model(**make_batch("llama", seed=0))

    results["tp-norm-differs"] = attempt(tp_norm_differs)

    def generate_and_forward():
        model = seqpar_hf.patch_model(build_model("llama"), layout).eval()
        batch = make_batch("llama", seed=0, pad=False)
        if dist.get_rank() == 0:
            model.generate(input_ids=batch["input_ids"], max_new_tokens=2, do_sample=False)
        else:
            model(**batch)

    results["generate-and-forward"] = attempt(generate_and_forward)

    from .trainer import make_trainer

    results["trainer-learning-rates-differ"] = attempt(
        lambda: make_trainer(sp=2, extra=dict(learning_rate=per_rank((1e-3, 2e-3))))
    )
