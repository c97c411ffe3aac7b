"""Tier 2: SequenceParallelTrainer logs, step for step, what ONE process of the plain transformers
Seq2SeqTrainer logs with the same global batch (no SP, no gradient accumulation): loss, grad_norm
and eval_loss, with and without label smoothing. fp32, dropout 0."""

from __future__ import annotations

import pytest

from .spawn import spawn
from .trainer_runs import run_many

TOL = 1e-5  # relative, per logged value
KEYS = ("loss", "grad_norm", "eval_loss", "learning_rate", "epoch")

# (world, sp, per-device batch, accumulation, per-device eval batch, tp): the same global batch of 8
# everywhere, for training and evaluation (13 eval examples: the last global batch is partial).
SETUPS = {"sp2": (2, 2, 8, 1, 8, 1), "sp2-ga2": (2, 2, 4, 2, 8, 1), "sp2xdp2": (4, 2, 4, 1, 4, 1),
          "tp2": (2, 1, 8, 1, 8, 2), "tp2xsp2": (4, 2, 8, 1, 8, 2)}


SMOOTHING = (0.0, 0.1)


@pytest.fixture(scope="module")
def reference():
    logs = spawn(run_many, 1, [dict(sp=0, batch=8, label_smoothing=ls) for ls in SMOOTHING])[0]
    return dict(zip(SMOOTHING, logs))


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(setup):
        if setup not in cache:
            world, sp, batch, accumulation, eval_batch, tp = SETUPS[setup]
            configs = [dict(sp=sp, batch=batch, accumulation=accumulation, label_smoothing=ls, eval_batch=eval_batch,
                            tp=tp) for ls in SMOOTHING]
            cache[setup] = dict(zip(SMOOTHING, spawn(run_many, world, configs)[0]))
        return cache[setup]
    return get


def _values(logs):
    return [(log["step"], key, log[key]) for log in logs for key in KEYS if key in log]


@pytest.mark.parametrize("label_smoothing", SMOOTHING)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_trainer_logs_equal_one_process(reference, runs, setup, label_smoothing):
    logs = runs(setup)[label_smoothing]
    expected, actual = _values(reference[label_smoothing]), _values(logs)
    assert [(s, k) for s, k, _ in actual] == [(s, k) for s, k, _ in expected]
    for (step, key, want), (_, _, got) in zip(expected, actual):
        assert abs(got - want) <= TOL * abs(want), (step, key, want, got)


@pytest.fixture(scope="module")
def checks():
    return spawn(run_many_checks, 4)[0]


def run_many_checks():
    from .trainer_runs import data_and_prediction_checks
    return {drop: data_and_prediction_checks(drop) for drop in (False, True)}


@pytest.mark.parametrize("drop_last", [False, True])
def test_sp_group_reads_the_same_batches_and_dp_groups_split_the_data(checks, drop_last):
    r = checks[drop_last]
    epochs, sp = r["epochs"], r["sp_size"]
    groups = [epochs[i:i + sp] for i in range(0, len(epochs), sp)]
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


def test_predict_returns_each_example_once_and_equal_to_one_process(checks):
    r = checks[False]
    assert r["n_predictions"] == r["n_labels"] == 13  # not sp copies
    assert r["logits_err"] < 1e-5
    assert r["n_generated"] == 13 and r["generation_mismatches"] == 0


def test_eval_steps_per_second_counts_sp_group_steps(checks):
    # 13 examples, 3 per device, 2 data-parallel replicas: ceil(13 / 6) = 3 steps (the Trainer's
    # own formula divides by the world, 4 ranks, and would say 2)
    assert abs(checks[False]["steps"] - 3) < 0.05


@pytest.mark.parametrize("sp,tp", [(2, 1), (1, 2)], ids=["sp2", "tp2"])
def test_resume_continues_the_same_curve_and_checkpoint_is_plain(tmp_path, sp, tp):
    from .trainer_runs import plain_eval, resume_run

    out = str(tmp_path / "run")
    logs = spawn(resume_run, 2, out, sp, tp)[0]
    full = {(l["step"], k): l[k] for l in logs["full"] for k in KEYS if k in l}
    resumed = {(l["step"], k): l[k] for l in logs["resumed"] for k in KEYS if k in l}
    after = {key: value for key, value in full.items() if key[0] > 3}
    assert after and all(abs(resumed[key] - value) <= TOL * abs(value) for key, value in after.items())
    final_eval = full[(6, "eval_loss")]
    plain = spawn(plain_eval, 1, f"{out}/checkpoint-6")[0]
    assert abs(plain - final_eval) <= TOL * abs(final_eval)
