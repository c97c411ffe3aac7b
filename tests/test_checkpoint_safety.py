"""Tier 1 (one process, no process group): checkpoints appear under their name only when complete, a failed
write leaves nothing to resume from, missing weights on resume are an error (training/saving.py,
training/checkpoint.py); a timeout says why ranks get there (parallel/agree.py); init_process_group's timeout.
The same on several ranks (errors on every rank): tests/test_robustness_gloo.py."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch
from transformers.trainer_utils import get_last_checkpoint

from seqpar_hf.training.checkpoint import unexplained_missing

from .helpers.models import build_model
from .runs.checkpoints import NO_SPACE
from .runs.trainer import make_trainer


def test_tied_and_ignored_weights_are_not_missing():
    model = build_model("marian")
    tied_or_ignored = ["model.encoder.embed_tokens.weight", "model.encoder.embed_positions.weight",
                       "model.decoder.embed_tokens.weight", "model.decoder.embed_positions.weight", "lm_head.weight"]
    assert unexplained_missing(model, tied_or_ignored) == []
    assert unexplained_missing(model, ["model.shared.weight", "lm_head.weight", "model.encoder.embed_tokens.weight",
                                       "model.decoder.embed_tokens.weight"]) == \
        ["model.shared.weight", "lm_head.weight", "model.encoder.embed_tokens.weight",
         "model.decoder.embed_tokens.weight"]  # the embedding itself is gone: all its names are missing
    assert unexplained_missing(model, ["model.decoder.layers.0.fc1.bias"]) == ["model.decoder.layers.0.fc1.bias"]


@pytest.fixture
def trainer(tmp_path):
    trainer, _ = make_trainer(sp=1, steps=4, output_dir=str(tmp_path / "run"),
                              extra=dict(save_strategy="steps", save_steps=1, save_total_limit=2, eval_strategy="no"))
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    return trainer


def _save(trainer, step: int):
    trainer.state.global_step = step
    trainer._save_checkpoint(trainer.model, None)


def test_a_checkpoint_appears_complete_under_its_name(trainer):
    run = trainer.args.output_dir
    trainer.state.best_global_step = 1  # the Trainer's best-checkpoint lookup, done in the staging folder
    _save(trainer, 1)
    final = os.path.join(run, "checkpoint-1")
    assert sorted(os.listdir(run)) == ["checkpoint-1"]
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(os.listdir(final))
    assert trainer.state.best_model_checkpoint == final
    with open(os.path.join(final, "trainer_state.json")) as f:
        assert json.load(f)["best_model_checkpoint"] == final
    for step in (2, 3):  # save_total_limit=2 rotates among the published checkpoints (the best one is kept)
        _save(trainer, step)
    assert sorted(os.listdir(run)) == ["checkpoint-1", "checkpoint-3"]


def test_a_failed_write_leaves_nothing_to_resume_from(trainer, monkeypatch):
    run = trainer.args.output_dir
    _save(trainer, 1)

    def no_space(*args, **kwargs):
        raise NO_SPACE
    monkeypatch.setattr(torch, "save", no_space)  # the optimizer: after the model was written
    with pytest.raises(OSError, match="No space left on device"):
        _save(trainer, 2)
    assert sorted(os.listdir(run)) == ["checkpoint-1"]
    assert get_last_checkpoint(run) == os.path.join(run, "checkpoint-1")


def test_a_killed_save_is_invisible_and_cleaned_by_the_next(trainer):
    run = trainer.args.output_dir
    _save(trainer, 1)
    os.makedirs(os.path.join(run, ".checkpoint-2.incomplete", "checkpoint-2"))  # a save killed half-way
    assert get_last_checkpoint(run) == os.path.join(run, "checkpoint-1")
    _save(trainer, 2)
    assert sorted(os.listdir(run)) == ["checkpoint-1", "checkpoint-2"]


def test_resuming_from_a_checkpoint_missing_a_weight_raises(trainer):
    from safetensors.torch import load_file, save_file
    _save(trainer, 1)
    path = os.path.join(trainer.args.output_dir, "checkpoint-1")
    trainer._load_from_checkpoint(path)  # tied and ignored weights are not missing: no error, no warning
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights.pop("model.decoder.layers.0.fc1.bias")
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"checkpoint-1 misses 1 weight\(s\) of the model: "
                                           r"\['model.decoder.layers.0.fc1.bias'\]"):
        trainer._load_from_checkpoint(path)


def test_a_timeout_says_that_ranks_disagreed():
    from seqpar_hf.parallel.agree import explain_timeout
    with pytest.raises(RuntimeError, match=r"rank 0 timed out in a test: the other ranks of its group never joined "
                                           r".*disagreed.*Timed out waiting 2000ms"):
        with explain_timeout("in a test"):
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 2000ms for recv")
    with pytest.raises(RuntimeError, match="^something else$"):
        with explain_timeout("in a test"):
            raise RuntimeError("something else")


def test_init_process_group_sets_the_timeout_every_layout_group_gets(tmp_path, monkeypatch):
    import torch.distributed as dist

    import seqpar_hf
    from seqpar_hf import _compat
    with pytest.raises(ValueError, match="timeout must be positive"):
        seqpar_hf.init_process_group("gloo", timeout=0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    seqpar_hf.init_process_group("gloo", timeout=42, store=store, rank=0, world_size=1)
    try:
        assert _compat.group_timeout(None) == timedelta(seconds=42)
        layout = seqpar_hf.ParallelLayout(sp_size=1, timeout=timedelta(seconds=9))
        assert layout.replica_group is None  # groups of one rank are not created (nothing to wait for)
        with pytest.raises(ValueError, match="timeout=-1: pass a positive datetime.timedelta"):
            seqpar_hf.ParallelLayout(sp_size=1, timeout=-1)
    finally:
        dist.destroy_process_group()



def test_load_best_model_at_end_finds_the_published_checkpoint(trainer):
    """The Trainer records the best checkpoint while it writes into the staging folder; the path it keeps
    (and loads at the end of training) is the published one."""
    trainer.state.best_global_step = 1
    _save(trainer, 1)
    trainer.state.best_global_step, trainer.state.best_metric = 1, 0.0
    _save(trainer, 2)
    assert trainer.state.best_model_checkpoint == os.path.join(trainer.args.output_dir, "checkpoint-1")
    trainer._load_best_model()  # what train() does with load_best_model_at_end
