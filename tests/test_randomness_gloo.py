"""Tier 2: dropout differs between the shards of an SP group; LayerDrop decisions agree.
In-rank bodies: tests/runs/randomness.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def results(spawned):
    return spawned("misc", 2)[0]["randomness"]


def test_per_rank_stream_differs_inside_and_agrees_after(results):
    inside, after = results["streams"]
    assert inside[0] != inside[1]
    assert after[0] == after[1]


def test_dropout_masks_differ_between_shards_and_steps(results):
    rank0, rank1 = results["dropout"]
    assert rank0[0] != rank1[0]  # the two shards of one step
    assert rank0[0] != rank0[1]  # two steps on one rank


def test_layerdrop_decisions_agree_across_the_group(results):
    gathered, layerdrop = results["layerdrop"]
    (counts0, losses0), (counts1, losses1) = gathered
    assert counts0 == counts1 and losses0 == losses1
    assert len(set(counts0)) > 1  # layers really were dropped, differently per step
    assert layerdrop == 0.5  # the model's own setting is restored after each forward
