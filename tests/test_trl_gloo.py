"""Tier 2: TRL's SFT and DPO trainers with sequence parallelism log, step for step, what the plain TRL
trainer logs in one process with the same global batch (loss, grad_norm, eval_loss, token accuracy,
entropy, token counts, DPO rewards and log-probs), with PEFT, gradient checkpointing, gradient
accumulation and packing. Skipped without trl/peft."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from .helpers.spawn import spawn
from .runs.trl_trainers import CASES, run_many

# fp32; DPO margins are differences of summed log-probs: compared with an absolute floor of 1e-6
TOL, FLOOR = 1e-5, 1e-6
KEYS = (
    "loss",
    "grad_norm",
    "eval_loss",
    "mean_token_accuracy",
    "entropy",
    "num_tokens",
    "eval_mean_token_accuracy",
    "eval_entropy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "eval_rewards/margins",
    "eval_logps/chosen",
)


@pytest.fixture(scope="module")
def logs(spawned):
    names = list(CASES)
    ours = spawned("trl", 2)[0]["trl"]
    unique_refs = {repr(sorted(CASES[n][1].items())): CASES[n][1] for n in names}
    refs = dict(zip(unique_refs, spawn(run_many, 1, [dict(sp=0, **c) for c in unique_refs.values()], timeout=600)[0]))
    return {n: (o, refs[repr(sorted(CASES[n][1].items()))]) for n, o in zip(names, ours)}


@pytest.mark.parametrize("name", list(CASES))
def test_trl_trainer_logs_equal_one_process(logs, name):
    ours, reference = logs[name]
    assert len(ours) == len(reference)
    compared = 0
    for got, want in zip(ours, reference):
        assert got["step"] == want["step"]
        for key in KEYS:
            if key in want:
                assert key in got, (key, got)
                assert abs(got[key] - want[key]) <= max(TOL * abs(want[key]), FLOOR), (want["step"], key, want, got)
                compared += 1
    assert compared >= 15
