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
    tied_or_ignored = [
        "model.encoder.embed_tokens.weight",
        "model.encoder.embed_positions.weight",
        "model.decoder.embed_tokens.weight",
        "model.decoder.embed_positions.weight",
        "lm_head.weight",
    ]
    assert unexplained_missing(model, tied_or_ignored) == []
    assert unexplained_missing(
        model,
        [
            "model.shared.weight",
            "lm_head.weight",
            "model.encoder.embed_tokens.weight",
            "model.decoder.embed_tokens.weight",
        ],
    ) == [
        "model.shared.weight",
        "lm_head.weight",
        "model.encoder.embed_tokens.weight",
        "model.decoder.embed_tokens.weight",
    ]  # the embedding itself is gone: all its names are missing
    assert unexplained_missing(model, ["model.decoder.layers.0.fc1.bias"]) == ["model.decoder.layers.0.fc1.bias"]


@pytest.fixture
def trainer(tmp_path):
    trainer, _ = make_trainer(
        sp=1,
        steps=4,
        output_dir=str(tmp_path / "run"),
        extra=dict(save_strategy="steps", save_steps=1, save_total_limit=2, eval_strategy="no"),
    )
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
    with pytest.raises(
        RuntimeError,
        match=r"checkpoint-1 misses 1 weight\(s\) of the model: "
        r"\['model.decoder.layers.0.fc1.bias'\]",
    ):
        trainer._load_from_checkpoint(path)


def test_a_timeout_says_that_ranks_disagreed():
    from seqpar_hf.parallel.agree import explain_timeout

    with pytest.raises(
        RuntimeError,
        match=r"rank 0 timed out in a test: the other ranks of its group never joined "
        r".*disagreed.*Timed out waiting 2000ms",
    ):
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


# ---- resuming: unreadable files, a missing optimizer, optimizer state written at another layout ---------


def test_resuming_from_a_truncated_file_names_the_file_and_the_fix(trainer):
    """safetensors, json and torch would say "incomplete metadata", "Unterminated string", "[Errno 22] Invalid
    argument", naming neither the file nor what to do."""
    _save(trainer, 1)
    path = os.path.join(trainer.args.output_dir, "checkpoint-1")
    for name in ("model.safetensors", "trainer_state.json", "optimizer.pt"):
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        with open(os.path.join(path, name), "wb") as f:
            f.write(data[: len(data) // 2])
        with pytest.raises(
            ValueError,
            match=rf"^.*checkpoint-1/{name} cannot be read \(\w+: .*\): the file is "
            rf"truncated or corrupt .* Resume from an earlier checkpoint, or delete "
            r".*checkpoint-1 \(resume_from_checkpoint=True then takes the one before "
            r"it\)$",
        ):
            trainer.train(resume_from_checkpoint=path)
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)


def test_resuming_without_the_optimizer_state_warns_that_it_starts_fresh(trainer):
    trainer.state.train_batch_size = 8  # what train() records; the Trainer compares it on resume
    _save(trainer, 4)  # the last step (max_steps=4): the resume loads everything and trains no further step
    path = os.path.join(trainer.args.output_dir, "checkpoint-4")
    os.remove(os.path.join(path, "optimizer.pt"))
    with pytest.warns(
        UserWarning,
        match=r"checkpoint-4 has no optimizer.pt: the optimizer and the learning-rate "
        r"scheduler start fresh .* while training resumes at step 4\.",
    ):
        trainer.train(resume_from_checkpoint=path)
    assert trainer.state.global_step >= 4  # training went on, from the checkpoint's step


def _step(trainer):
    torch.manual_seed(0)
    for p in trainer.model.parameters():
        p.grad = torch.randn_like(p)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.model.zero_grad(set_to_none=True)  # as a resumed run holds them


def test_optimizer_state_follows_its_parameters_into_other_groups(trainer):
    """What a checkpoint written at tp_size=1 meets at tp_size=2 (the Trainer splits its groups per device mesh):
    torch numbers the parameters across the groups; the checkpoint records their names, and each parameter's state
    and its group's settings (lr, weight decay) and schedule load exactly into the new groups."""
    _step(trainer)
    _save(trainer, 1)
    path = os.path.join(trainer.args.output_dir, "checkpoint-1")
    with open(os.path.join(path, "seqpar_layout.json")) as f:
        record = json.load(f)
    assert (record["sp_size"], record["tp_size"], record["dp_size"], record["optimizer_keys"]) == (1, 1, 1, "numbers")
    assert [len(g) for g in record["optimizer_groups"]] == [len(g["params"]) for g in trainer.optimizer.param_groups]

    saved, saved_schedule = trainer.optimizer, trainer.lr_scheduler
    decay, no_decay = saved.param_groups
    trainer.optimizer = torch.optim.AdamW(
        [  # a fresh optimizer, its decayed parameters split in two groups
            {"params": decay["params"][:1], "weight_decay": decay["weight_decay"]},
            {"params": decay["params"][1:], "weight_decay": decay["weight_decay"]},
            {"params": no_decay["params"], "weight_decay": no_decay["weight_decay"]},
        ],
        lr=trainer.args.learning_rate,
    )
    trainer.lr_scheduler = None
    trainer.create_scheduler(num_training_steps=4, optimizer=trainer.optimizer)
    trainer._load_optimizer_and_scheduler(path)

    group_of = {p: g for g in saved.param_groups for p in g["params"]}
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            # torch's set_optimizer_state_dict hands betas back as a list
            settings = {k: tuple(v) if isinstance(v, list) else v for k, v in group.items() if k != "params"}
            assert settings == {k: v for k, v in group_of[p].items() if k != "params"}
            assert trainer.optimizer.state[p].keys() == saved.state[p].keys()
            assert all(torch.equal(trainer.optimizer.state[p][k], saved.state[p][k]) for k in saved.state[p])
    assert trainer.lr_scheduler.base_lrs == [saved_schedule.base_lrs[i] for i in (0, 0, 1)]
    assert trainer.lr_scheduler.last_epoch == saved_schedule.last_epoch == 1


def test_numbered_optimizer_state_without_names_is_refused_at_a_sharded_layout(trainer):
    """A checkpoint written before the names were recorded (or by another trainer) cannot be matched to a
    tensor-parallel or FSDP model's parameters: the error names both layouts and the fix."""
    from seqpar_hf.training import resume

    _save(trainer, 1)
    path = os.path.join(trainer.args.output_dir, "checkpoint-1")
    os.remove(os.path.join(path, "seqpar_layout.json"))
    here = {**resume.describe(trainer.layout, trainer.model), "tp_size": 2, "optimizer_keys": "names"}
    with pytest.raises(
        ValueError,
        match=r"checkpoint-1/optimizer.pt was written at another layout and this run is at "
        r"sp_size=1, tp_size=2, dp_size=1: it numbers the parameters .* without "
        r"recording their names.* Resume at the layout it was written at \(tp_size=1 "
        r"without FSDP\) or from a checkpoint written at this one; a checkpoint saved "
        "there records the names and resumes at any layout$",
    ):
        resume.check(path, here)


def test_optimizer_state_that_cannot_move_exactly_is_refused():
    """Groups are merged only where their settings agree; every parameter needs its saved state; the scheduler's
    per-group values must match the saved groups."""
    from seqpar_hf.training import resume

    saved = {
        "state": {},
        "param_groups": [
            {"lr": 1e-3, "weight_decay": 0.1, "params": ["a", "b"]},
            {"lr": 1e-3, "weight_decay": 0.0, "params": ["c"]},
        ],
    }
    args = ("ckpt/optimizer.pt", dict(sp_size=2, tp_size=1, dp_size=1), dict(sp_size=1, tp_size=2, dp_size=1))
    assert resume.group_sources(saved, [["a"], ["b"], ["c"]], *args) == [0, 0, 1]
    with pytest.raises(
        ValueError,
        match=r"^ckpt/optimizer.pt was written at sp_size=2, tp_size=1, dp_size=1 and this "
        r"run is at sp_size=1, tp_size=2, dp_size=1: it holds parameter groups \[0, 1\] "
        r"with different settings .* that this run puts in one group\. Resume at the "
        r"layout it was written at \(sp_size=2, tp_size=1, dp_size=1\) or from a "
        "checkpoint written at this one$",
    ):
        resume.group_sources(saved, [["a", "c"], ["b"]], *args)
    with pytest.raises(
        ValueError,
        match=r"it has no state for 1 parameter\(s\) of this model \(\['d'\]\): it was "
        "written for another model",
    ):
        resume.group_sources(saved, [["a", "b"], ["c", "d"]], *args)
    with pytest.raises(ValueError, match="it comes with a scheduler whose base_lrs has 3 entries for 2 groups"):
        resume.regroup_scheduler({"base_lrs": [1.0, 1.0, 1.0]}, [0, 0, 1], 2, *args)
