"""Tier 2: TRL's GRPO and RLOO trainers with sequence parallelism log, step for step, what the plain TRL
trainer logs in one process with the same global batch and the same completions: loss, grad_norm, KL,
entropy, clip ratios, rewards (per function), advantages, completion lengths, token counts and the eval
metrics, for every GRPO loss type, sp=2 and sp=2 x dp=2, ulysses and ring, with PEFT, gradient
checkpointing, gradient accumulation, two iterations per batch, and reference models that are a patched
copy, a separate model or TRL's own. Each completion is generated once per SP group. Skipped without
trl/peft."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from .helpers.spawn import spawn
from .runs.rl_trainers import CASES, CASES_4, GENERATION, run_many

# fp32. Losses near zero (RLOO's mean advantage, GRPO's first step) and tiny KLs: an absolute floor.
TOL, FLOOR = 1e-5, 1e-6


def _key(config: dict) -> str:
    return repr(sorted(config.items()))


@pytest.fixture(scope="module")
def runs(spawned):
    """(ours, one-process reference) per case; ours from the `trl` (2 ranks) and `trainer` (4 ranks) groups."""
    two, four = spawned("trl", 2), spawned("trainer", 4)
    ours = {n: [rank["rl"][i] for rank in two] for i, n in enumerate(CASES)}
    ours.update({n: [rank["rl_generation"][i] for rank in two] for i, n in enumerate(GENERATION)})
    ours.update({n: [rank["rl"][i] for rank in four] for i, n in enumerate(CASES_4)})
    wanted = {**CASES, **CASES_4, **GENERATION}
    unique = {_key(ref): ref for _, ref in wanted.values() if ref is not None}
    refs = dict(zip(unique, spawn(run_many, 1, [dict(sp=0, **c) for c in unique.values()], timeout=600)[0]))
    return {n: (ours[n], refs[_key(ref)] if ref is not None else None) for n, (_, ref) in wanted.items()}


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= max(TOL * abs(want), FLOOR)


def _assert_same_logs(ours: dict, reference: dict):
    assert len(ours["logs"]) == len(reference["logs"])
    compared = 0
    for got, want in zip(ours["logs"], reference["logs"]):
        assert got["step"] == want["step"]
        assert set(got) == set(want), set(got) ^ set(want)  # every metric, and nothing else
        for key, value in want.items():
            assert _close(got[key], value), (want["step"], key, value, got[key])
            compared += 1
    assert compared >= 40
    # the last generation batch: its completions (in order) and group advantages, over the global batch
    assert ours["completions"] == reference["completions"]
    assert len(ours["advantages"]) == len(reference["advantages"])
    assert all(_close(a, b) for a, b in zip(ours["advantages"], reference["advantages"]))
    assert ours["generation_batch_size"] == reference["generation_batch_size"]  # replicas, not ranks, counted


@pytest.mark.parametrize("name", list(CASES) + list(CASES_4) + ["greedy"])
def test_rl_trainer_logs_equal_one_process(runs, name):
    ours, reference = runs[name]
    _assert_same_logs(ours[0], reference)
    for rank in ours[1:]:  # every rank logs the same numbers
        assert rank["logs"] == ours[0]["logs"]


def test_each_completion_is_generated_once_per_sp_group(runs):
    """One process generates R rows per generation; each of the sp ranks of a group generates R / sp of them,
    once (counted on the policy's own `generate`, and on the fixed-completion hook)."""
    for name in list(CASES) + ["greedy"]:
        ours, reference = runs[name]
        calls = len(reference["generated_rows"])
        for rank in ours:
            assert rank["generated_rows"] == [rows // 2 for rows in reference["generated_rows"]], name
        assert sum(sum(rank["generated_rows"]) for rank in ours) == sum(reference["generated_rows"]), name
        assert calls >= 2
    for name in CASES_4:  # 2 replicas of 2 ranks: one process's rows / 4 per rank
        ours, reference = runs[name]
        for rank in ours:
            assert rank["generated_rows"] == [rows // 4 for rows in reference["generated_rows"]], name


def test_sampled_generation_gives_the_group_one_batch(runs):
    """The policy's own sampling with TRL's shuffle and gradient accumulation: each rank samples its slice from
    its own stream, and the ranks of the group then hold the same micro-batches (the patched forward also
    checks this on every step)."""
    (rank0, rank1), _ = runs["sampled-accumulation"]
    assert rank0["generated_rows"] == rank1["generated_rows"] == [2, 2]  # 4 rows per generation, 2 generations
    assert rank0["last_batches"] == rank1["last_batches"]
    assert rank0["completions"] == rank1["completions"]
    assert len(set(rank0["completions"])) > 1


DIVERGENCES = {
    # at construction, before TRL's own init: the group settings compared across the ranks
    "num-generations-differ": r"^ValueError: ranks disagree on the training arguments \(SequenceParallelGRPOConfig: "
    r"num_generations: rank 0: 2, rank 1: 4\)\. Every rank must train with the same "
    "arguments",
    # at the first generation batch, before its scoring's collectives: the prompts compared across the SP group
    "datasets-differ": r"^ValueError: ranks of one SP group hold different generation batches \(rank 0: 4 rows, sha256 "
    r"[0-9a-f]{8}, rank 1: 4 rows, sha256 [0-9a-f]{8}\)\. Every rank of an SP group must read the "
    r"same prompts",
}


@pytest.mark.parametrize("case", list(DIVERGENCES))
def test_ranks_given_different_group_settings_or_prompts_stop_on_every_rank(spawned, case):
    """Ranks of an SP group with different num_generations or different datasets would train on a mix (the
    issue saw a step-1 loss of 0.306 where the valid run logs 0.0): the same error on every rank instead."""
    ranks = [rank["rl_divergences"][case][0] for rank in spawned("trl", 2)]
    assert ranks[0] == ranks[1] and re.search(DIVERGENCES[case], ranks[0]), ranks
