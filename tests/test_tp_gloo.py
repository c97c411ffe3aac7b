"""Tier 2: Megatron-style tensor + sequence parallelism (DTensor), alone and composed with data
parallelism and Ulysses / ring: loss and every gradient (as a full tensor) equal the unpatched model,
eval logits too; layouts that cannot work are refused with the numbers. fp32, gloo."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import seqpar_hf

from .models import build_model
from .spawn import spawn
from .tp_runs import run_cases

TOL = 1e-5


def _cases_world2():
    return [dict(name="tp2-llama-gqa", family="llama", sp=1, tp=2),
            dict(name="tp2-marian", family="marian", sp=1, tp=2),
            dict(name="tp2-bart", family="bart", sp=1, tp=2),
            dict(name="tp2-qwen3", family="qwen3", sp=1, tp=2),
            dict(name="tp2-llama-eval", family="llama", sp=1, tp=2, eval=True),
            dict(name="tp2-marian-eval", family="marian", sp=1, tp=2, eval=True)]


def _cases_world4():
    # four ranks share two cores here: each family once per mode
    cases = [dict(name="tp2xdp2-llama", family="llama", sp=1, tp=2),
             dict(name="tp2xdp2-marian", family="marian", sp=1, tp=2),
             dict(name="tp4-llama", family="llama", sp=1, tp=4, model=dict(kv_heads=4))]
    cases += [dict(name=f"tp2xsp2-ulysses-{f}", family=f, sp=2, tp=2) for f in ("llama", "marian", "m2m100")]
    cases += [dict(name=f"tp2xsp2-ring-{f}", family=f, sp=2, tp=2, mode="ring") for f in ("gemma", "bart")]
    cases.append(dict(name="tp2xsp2-ulysses-marian-eval", family="marian", sp=2, tp=2, eval=True))
    return cases


CASES = {2: _cases_world2(), 4: _cases_world4()}


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = {}
            for rank_results in spawn(_world, world, CASES[world]):
                for r in rank_results:
                    cache[world].setdefault(r["name"], []).append(r)
        return cache[world]
    return get


def _world(cases):
    results = run_cases(cases)
    if dist.get_world_size() == 2:  # the refusals need a tp=2 layout: same process group
        results.append({"name": "refusals", **_refusals()})
    return results


@pytest.mark.parametrize("world,name", [pytest.param(w, c["name"], id=c["name"]) for w in CASES for c in CASES[w]])
def test_tensor_parallel_parity(results, world, name):
    for r in results(world)[name]:
        if "logits_err" in r:
            assert r["logits_err"] < TOL, r
        else:
            assert r["loss_err"] < TOL and r["grad_err"] < TOL, r
            assert r["dtensor_params"] > 0, r  # really sharded


def _refusals():
    layout = seqpar_hf.ParallelLayout(sp_size=1, tp_size=2)
    out = {}
    for name, family, kwargs in (("kv-heads", "llama", dict(heads=4, kv_heads=1)), ("heads", "marian", dict(heads=3)),
                                 ("fused-qkv", "phi3", {}), ("experts", "mixtral", {})):
        try:
            seqpar_hf.patch_model(build_model(family, **kwargs), layout)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    try:
        seqpar_hf.ParallelLayout(sp_size=2, tp_size=2)
        out["world"] = None
    except ValueError as exc:
        out["world"] = str(exc)
    return out


@pytest.fixture(scope="module")
def refusals(results):
    return results(2)["refusals"][0]


@pytest.mark.parametrize("case,message", [
    ("kv-heads", "4 query and 1 key/value heads, not divisible by tp_size=2.*tp_size dividing 1"),
    ("heads", "3 query and 3 key/value heads, not divisible by tp_size=2"),
    ("fused-qkv", "Phi3ForCausalLM's plan entry 'layers.\\*.self_attn.qkv_proj'.*not supported.*tp_size=1"),
    ("experts", "MixtralForCausalLM's plan entry.*experts.*not supported"),
    ("world", "world size 2 is not divisible by sp_size x tp_size = 2 x 2 = 4")])
def test_impossible_layouts_are_refused_with_the_numbers(refusals, case, message):
    import re
    assert refusals[case] is not None and re.search(message, refusals[case]), refusals[case]
