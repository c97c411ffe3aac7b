"""Tier 2: ring attention numerics at the function level (world 4, in the parity group).
In-rank bodies: tests/runs/ring.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def results(spawned):
    return spawned("parity", 4)[0]["ring"]


def test_bf16_ring_error_at_most_twice_plain_bf16(results):
    for name, (plain, ring) in zip(("out", "dq", "dk", "dv"), results["bf16"]):
        assert ring <= 2 * plain, (name, plain, ring)


@pytest.mark.parametrize("causal", [False, True])
def test_all_masked_rows_give_finite_zeros_and_exact_grads(results, causal):
    r = results["masked"][causal]
    assert r["finite"] and r["sample0_zero"], r
    assert max(r["errors"]) < 1e-5, r  # fp32, on the sample with real keys
