"""Tier 1: TimeBudgetCallback stops training once its budget is spent (no process group: the rank's own
decision; under a process group the ranks agree, exercised by tests/test_recipe.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
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
    callback.start = time.time() - 10**6
    callback.on_step_end(args, state, control)
    assert not control.should_training_stop


def test_evaluation_by_time_and_a_schedule_that_ends_with_the_budget():
    callback = seqpar_hf.TimeBudgetCallback(minutes=10, eval_every_minutes=3)
    args, state = SimpleNamespace(device="cpu", eval_strategy="no"), TrainerState()
    control = TrainerControl()
    callback.on_train_begin(args, state, control)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = callback.schedule(optimizer, warmup_steps=4)
    lrs = [optimizer.param_groups[0]["lr"]]
    for spent_minutes in (1, 2, 4, 5, 6.5, 9, 10.5):
        callback.start = time.time() - 60 * spent_minutes
        control = TrainerControl()
        callback.on_step_end(args, state, control)
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        evaluated = control.should_evaluate
        assert evaluated == (spent_minutes in (4, 6.5, 9, 10.5)), spent_minutes  # past 3, 6, 9; and at the end
    assert control.should_training_stop
    assert lrs[0] == 0.25  # warmup: step 1 of 4
    assert abs(lrs[4] - 0.5) < 0.02 and lrs[-1] == 0.0  # half the budget: half the peak; the end: zero


def test_the_schedule_ends_at_the_step_count_when_that_comes_before_the_budget():
    """A fast machine runs out of epochs before its time budget: the rate is 0 at the last step, not part-way."""
    callback = seqpar_hf.TimeBudgetCallback(minutes=10)
    args, state = SimpleNamespace(device="cpu", eval_strategy="no"), TrainerState()
    callback.on_train_begin(args, state, TrainerControl())
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = callback.schedule(optimizer, warmup_steps=0, total_steps=8)
    lrs = []
    for step in range(8):
        callback.start = time.time() - 60 * (step + 1) * 0.5  # half a minute a step: 4 of the 10 minutes
        callback.on_step_end(args, state, TrainerControl())
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[3] == 0.5 and lrs[-1] == 0.0  # by steps (time alone would give 0.8 and 0.6)
