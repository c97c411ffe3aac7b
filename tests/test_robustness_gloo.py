"""Tier 2: bad input fails fast with a clear error on every rank (never a hang, never a wrong
number); odd but valid input works. In-rank bodies: tests/runs/robustness.py."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bad(spawned):
    return [r["bad"] for r in spawned("misc", 2)]


EXPECTED = {
    "world-not-divisible": "world size 2 is not divisible by sp_size=4",
    "ring-size-not-dividing": "ring_size=3 does not divide sp_size=2",
    "unknown-mode": "unknown sequence-parallel mode 'stripes'",
    "different-lengths": "input_ids shapes differ: \\[\\(3, 13\\), \\(3, 11\\)\\]",
    "mask-on-one-rank": "attention_mask given on ranks \\[0\\] only",
    "different-token-ids": "input_ids values differ",
    "unsupported-attention": "attn_implementation='my_kernel'",
    "submodule-called-directly": "outside a sharded forward of the patched model.*sp_disabled",
    "no-process-group": "no process group is initialised",
}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_bad_input_raises_on_every_rank_quickly(bad, case):
    import re
    for rank_results in bad:
        message, seconds = rank_results[case]
        assert message is not None and re.search(EXPECTED[case], message), message
        assert seconds < 10, seconds


@pytest.fixture(scope="module")
def odd(spawned):
    return [r["odd"] for r in spawned("misc", 2)]


@pytest.mark.parametrize("case,tol", [("batch-size-1", 1e-5), ("shorter-than-sp", 1e-5), ("shard-all-padding", 1e-5),
                                      ("labels-ignored-on-one-rank", 1e-5), ("labels-ignored-everywhere", 0),
                                      ("bf16", 2e-2),  # bf16: different summation order, 8 mantissa bits
                                      ("inputs-embeds", 1e-5)])
def test_odd_input_matches_the_unpatched_model(odd, case, tol):
    import math
    for rank_results in odd:
        got, want = rank_results[case]
        if math.isnan(want):
            assert math.isnan(got), (got, want)
        else:
            assert abs(got - want) <= tol * abs(want), (got, want)
