"""Tier 2: the fused Ulysses exchange at the function level (worlds 2 and 4, parity group): q/k/v in
one all-to-all is bit-identical to exchanging them one by one with half the collectives; head chunks
agree within fp32 rounding with 2c; mode="auto" refuses ranks that patched different models and resolves
each model on its own, leaving the auto layout as built.
In-rank bodies: tests/runs/ulysses.py."""

from __future__ import annotations

import pytest

# chunks split the kernel's grouped-query sum over kv heads shared by two chunks: fp32 rounding only
TOL = 1e-6


@pytest.fixture(scope="module")
def results(spawned):
    return lambda size: [r["ulysses"] for r in spawned("parity", size)]


@pytest.mark.parametrize("size", [2, 4])
def test_fused_exchange_equals_the_separate_one_with_half_the_collectives(results, size):
    for rank in results(size):
        assert rank["exchanges"], rank
        for r in rank["exchanges"]:
            assert r["reference_calls"] == (4, 4), r
            assert r["calls"] == (2 * r["chunks"], 2 * r["chunks"]), r
            assert r["equal"] if r["chunks"] == 1 else r["error"] < TOL, r


def test_auto_refuses_different_models_on_every_rank(results):
    for rank in results(2):
        assert "an auto layout has no groups of its own" in rank["auto"]["before"], rank
        assert "seqpar_hf.layout_of(model)" in rank["auto"]["before"], rank
        assert "mode='auto': the ranks patched models with different attention heads" in (
            rank["auto"]["mismatch"] or ""
        ), rank


@pytest.mark.parametrize("size", [2, 4])
def test_one_auto_layout_resolves_each_model_on_its_own(results, size):
    """patch_model never changes the auto layout: each model gets the layout chosen for its heads (4 heads:
    Ulysses; 1 head: a ring), models with the same choice share it, and re-patching with the auto layout is a no-op."""
    for rank in results(size):
        r = rank["auto"]["per_model"]
        assert r["modes"] == ["ulysses", "ring", "ulysses"] and r["shared"] and r["repatch_noop"], r
        assert "mode='auto'" in r["layout"] and "chosen per model" in r["layout"], r
        assert "1 heads / 1 kv per TP rank" in r["reason"], r
