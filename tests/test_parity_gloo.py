"""Tier 2: multi-process gloo parity of the patched model against the unpatched one.

Each world size is spawned once (the `parity` group) and runs all its cases (tests/runs/parity.py);
every case is then asserted on its own. fp32 throughout.
"""

from __future__ import annotations

import pytest

from .runs.parity import CASES

# fp32: loss, every parameter gradient and gathered logits within 1e-5 relative error. A case's own `tol`
# is stricter: a float64 re-run showing that what fp32 leaves is rounding.
TOL = 1e-5


@pytest.fixture(scope="module")
def results(spawned):
    cache = {}

    def get(size):
        if size not in cache:
            cache[size] = {}
            for rank_results in spawned("parity", size):
                for r in rank_results["cases"]:
                    cache[size].setdefault(r["name"], []).append(r)
        return cache[size]

    return get


def _params():
    return [pytest.param(world, c["name"], id=f"w{world}-{c['name']}") for world in CASES for c in CASES[world]]


@pytest.mark.parametrize("size,name", _params())
def test_parity(results, size, name):
    per_rank = results(size)[name]
    assert len(per_rank) == size
    case = next(c for c in CASES[size] if c["name"] == name)
    if case.get("kernel"):  # the split along the sequence ran the fused kernel from the states passed (on the ranks
        assert sum(r["kernel_states"] for r in per_rank) > 0, per_rank  # holding a run after the sequence's first)
    expect, tol = case.get("expect"), case.get("tol", TOL)
    if expect:  # mode="auto": what it chose, on every rank
        assert all((r["mode"], r["ring_size"]) == expect for r in per_rank), per_rank[0]
    for r in per_rank:
        if "logits_err" in r:
            assert r["logits_err"] < TOL, r
            assert r.get("encoder_err", 0.0) < TOL, r
            continue
        assert r["loss_err"] < tol, r
        assert r["grad_err"] < tol, r
        if case.get("patch", {}).get("offload_activations"):  # every checkpointed layer's input went and came back
            moved, restored = r["offloaded"]
            assert moved > 0 and moved == restored, r
        # the loss is the same number on every rank of the SP group
        assert len(set(r["group_losses"])) == 1, r
