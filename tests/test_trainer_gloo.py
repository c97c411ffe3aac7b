"""Tier 2: SequenceParallelTrainer logs, step for step, what ONE process of the plain transformers
Seq2SeqTrainer logs with the same global batch (no SP, no gradient accumulation): loss, grad_norm
and eval_loss, with and without label smoothing. fp32, dropout 0."""

from __future__ import annotations

import pytest

from .helpers.spawn import spawn
from .runs.trainer import RESUME, RESUME_ACROSS, SETUPS, run_many

TOL = 1e-5  # relative, per logged value
KEYS = ("loss", "grad_norm", "eval_loss", "learning_rate", "epoch")


@pytest.fixture(scope="module")
def reference():
    keys = [("marian", 0.0), ("marian", 0.1), ("t5", 0.0), ("vlm", 0.0), ("granitemoehybrid", 0.0)]
    logs = spawn(run_many, 1, [dict(sp=0, batch=8, family=f, label_smoothing=ls) for f, ls in keys])[0]
    return dict(zip(keys, logs))


@pytest.fixture(scope="module")
def worlds(spawned):
    return lambda size: spawned("trainer", size)[0]


def _values(logs):
    return [(log["step"], key, log[key]) for log in logs for key in KEYS if key in log]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_trainer_logs_equal_one_process(reference, worlds, setup):
    world, config = SETUPS[setup]
    logs = worlds(world)[setup]
    expected = _values(reference[config.get("family", "marian"), config.get("label_smoothing", 0.0)])
    actual = _values(logs)
    assert [(s, k) for s, k, _ in actual] == [(s, k) for s, k, _ in expected]
    for (step, key, want), (_, _, got) in zip(expected, actual):
        assert abs(got - want) <= TOL * abs(want), (step, key, want, got)


@pytest.fixture(scope="module")
def checks(worlds):
    return worlds(4)["checks"]


@pytest.mark.parametrize("drop_last", [False, True])
def test_sp_group_reads_the_same_batches_and_dp_groups_split_the_data(checks, drop_last):
    r = checks[drop_last]
    epochs, sp = r["epochs"], r["sp_size"]
    groups = [epochs[i : i + sp] for i in range(0, len(epochs), sp)]
    for group in groups:
        assert all(e == group[0] for e in group)  # identical batches within an SP group
    seen = [x for group in groups for batch in group[0] for x in batch]
    train = r["train"]
    assert set(seen) <= set(train)
    global_batch = 3 * len(groups)
    if drop_last:  # the incomplete last global batch is dropped: every example at most once
        assert len(seen) == len(set(seen)) == len(train) // global_batch * global_batch
    else:  # as accelerate does: the last global batch is filled up with examples from the start
        assert set(seen) == set(train)
        assert len(seen) == -(-len(train) // global_batch) * global_batch


@pytest.mark.parametrize("variant", [False, "fsdp"])
def test_predict_returns_each_example_once_and_equal_to_one_process(checks, variant):
    r = checks[variant]  # "fsdp": parameters sharded over the 4 ranks, generation on gathered weights
    assert r["n_predictions"] == r["n_labels"] == 13  # not sp copies
    assert r["logits_err"] < 1e-5
    assert r["n_generated"] == 13 and r["generation_mismatches"] == 0


def test_eval_steps_per_second_counts_sp_group_steps(checks):
    # 13 examples, 3 per device, 2 data-parallel replicas: ceil(13 / 6) = 3 steps (the Trainer's
    # own formula divides by the world, 4 ranks, and would say 2)
    assert abs(checks[False]["steps"] - 3) < 0.05


@pytest.fixture(scope="module")
def plain_evals(worlds):
    """The final checkpoints, evaluated by plain transformers in one process (one spawn for both)."""
    from .runs.trainer import plain_eval_many

    layouts = list(worlds(2)["resume"])
    return dict(zip(layouts, spawn(plain_eval_many, 1, [worlds(2)["resume"][k]["checkpoint"] for k in layouts])[0]))


@pytest.mark.parametrize("layout", list(RESUME))
def test_resume_continues_the_same_curve_and_checkpoint_is_plain(worlds, plain_evals, layout):
    logs = worlds(2)["resume"][layout]
    full = {(row["step"], k): row[k] for row in logs["full"] for k in KEYS if k in row}
    resumed = {(row["step"], k): row[k] for row in logs["resumed"] for k in KEYS if k in row}
    after = {key: value for key, value in full.items() if key[0] > 3}
    assert after and all(abs(resumed[key] - value) <= TOL * abs(value) for key, value in after.items())
    final_eval = full[(6, "eval_loss")]
    assert abs(plain_evals[layout] - final_eval) <= TOL * abs(final_eval)


@pytest.mark.parametrize("name", list(RESUME_ACROSS))
def test_resume_at_another_tp_size_continues_the_same_curve(worlds, name):
    """A checkpoint written at tp 1 resumes at tp 2 and the other way (optimizer state converted by name): the
    steps after it log what the run that wrote it logged."""
    full = {
        (row["step"], k): row[k]
        for row in worlds(2)["resume"][RESUME_ACROSS[name][0]]["full"]
        for k in KEYS
        if k in row
    }
    resumed = {(row["step"], k): row[k] for row in worlds(2)["resume_across"][name] for k in KEYS if k in row}
    after = {key: value for key, value in full.items() if key[0] > 3}
    assert after and all(abs(resumed[key] - value) <= TOL * abs(value) for key, value in after.items()), resumed


def test_generation_under_tensor_parallelism_equals_one_process(worlds):
    r = worlds(2)["tp_generate"]
    assert r == {"rows": 13, "mismatches": 0}
