"""Tier 1: TimeBudgetCallback stops training once its budget is spent (no process group: the rank's own
decision; under a process group the ranks agree, exercised by tests/test_recipe.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from transformers import TrainerControl, TrainerState

import seqpar_hf


def test_time_budget_stops_training_and_evaluates_once_spent():
    callback = seqpar_hf.TimeBudgetCallback(minutes=1)
    args, state = SimpleNamespace(device="cpu", eval_strategy="steps"), TrainerState()
    control = TrainerControl()
    callback.on_train_begin(args, state, control)
    callback.on_step_end(args, state, control)
    assert not control.should_training_stop  # within the budget
    callback.start = time.time() - 61
    callback.on_step_end(args, state, control)
    assert control.should_training_stop and control.should_evaluate


def test_time_budget_without_evaluation_does_not_ask_for_one():
    """A trainer without an eval set (eval_strategy "no") would fail at the evaluation it was asked for."""
    callback = seqpar_hf.TimeBudgetCallback(minutes=1)
    args, state, control = SimpleNamespace(device="cpu", eval_strategy="no"), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control)
    callback.start = time.time() - 61
    callback.on_step_end(args, state, control)
    assert control.should_training_stop and not control.should_evaluate


def test_time_budget_of_zero_means_no_limit():
    callback = seqpar_hf.TimeBudgetCallback(minutes=0)
    args, state, control = SimpleNamespace(device="cpu", eval_strategy="no"), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control)
    callback.start = time.time() - 10 ** 6
    callback.on_step_end(args, state, control)
    assert not control.should_training_stop
