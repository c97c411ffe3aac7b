"""Tier 2: Megatron-style tensor + sequence parallelism (DTensor), alone and composed with data
parallelism and Ulysses / ring: loss and every gradient (as a full tensor) equal the unpatched model,
eval logits too; layouts that cannot work are refused with the numbers. fp32, gloo. In-rank bodies
and cases: tests/runs/tp.py."""

from __future__ import annotations

import pytest

from .runs.tp import CASES

TOL = 1e-5


@pytest.fixture(scope="module")
def results(spawned):
    cache = {}

    def get(size):
        if size not in cache:
            per_rank = spawned("tensor_parallel", size)
            cache[size] = {r["name"]: [] for r in per_rank[0]["cases"]}
            for rank_results in per_rank:
                for r in rank_results["cases"]:
                    cache[size][r["name"]].append(r)
            cache[size]["refusals"] = [r.get("refusals") for r in per_rank]
            cache[size]["regather"] = [r.get("regather") for r in per_rank]
        return cache[size]

    return get


@pytest.mark.parametrize("size,name", [pytest.param(w, c["name"], id=c["name"]) for w in CASES for c in CASES[w]])
def test_tensor_parallel_parity(results, size, name):
    for r in results(size)[name]:
        if "logits_err" in r:
            assert r["logits_err"] < TOL, r
        else:
            assert r["loss_err"] < TOL and r["grad_err"] < TOL, r
            assert r["dtensor_params"] > 0, r  # really sharded


@pytest.fixture(scope="module")
def refusals(results):
    return results(2)["refusals"][0]


@pytest.mark.parametrize(
    "case,message",
    [
        ("kv-heads", "4 query and 1 key/value heads, not divisible by tp_size=2.*tp_size dividing 1"),
        ("heads", "3 query and 3 key/value heads, not divisible by tp_size=2"),
        ("fused-qkv", "Phi3ForCausalLM's plan entry 'layers.\\*.self_attn.qkv_proj'.*not supported.*tp_size=1"),
        # transformers 5.24's plan names the experts; 5.25's leaves the router unsharded: refused either way, and its
        # rows not called heads (they are experts)
        (
            "experts",
            "MixtralForCausalLM's plan entry.*experts.*not supported"
            "|does not shard layers.0.mlp.gate.weight \\(\\w+ \\(",
        ),
        ("world", "world size 2 is not divisible by sp_size x tp_size = 2 x 2 = 4"),
        ("inputs-embeds", "inputs_embeds with tensor parallelism.*pass input_ids"),
    ],
)
def test_impossible_layouts_are_refused_with_the_numbers(refusals, case, message):
    import re

    assert refusals[case] is not None and re.search(message, refusals[case]), refusals[case]


def test_block_inputs_are_saved_as_the_sequence_slice(results):
    """Megatron's TP+SP activation bytes: q/k/v and gate/up keep the slice, not the gathered input."""
    r = results(2)["regather"][0]
    assert r["rows"] and max(r["rows"]) * 2 <= r["tokens"] + r["batch"], r  # [b, s/t, h], s padded to even
