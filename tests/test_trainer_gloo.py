"""Tier 2: SequenceParallelTrainer logs, step for step, what ONE process of the plain transformers
Seq2SeqTrainer logs with the same global batch (no SP, no gradient accumulation): loss, grad_norm
and eval_loss, with and without label smoothing. fp32, dropout 0."""

from __future__ import annotations

import pytest

from .spawn import spawn
from .trainer_runs import run_many

TOL = 1e-5  # relative, per logged value
KEYS = ("loss", "grad_norm", "eval_loss")

# (world, sp, per-device batch, accumulation, per-device eval batch): the same global batch of 8
# everywhere, for training and evaluation (13 eval examples: the last global batch is partial).
SETUPS = {"sp2": (2, 2, 8, 1, 8), "sp2-ga2": (2, 2, 4, 2, 8), "sp2xdp2": (4, 2, 4, 1, 4)}


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
            world, sp, batch, accumulation, eval_batch = SETUPS[setup]
            configs = [dict(sp=sp, batch=batch, accumulation=accumulation, label_smoothing=ls, eval_batch=eval_batch)
                       for ls in SMOOTHING]
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
