"""Tier 2: multi-process gloo parity of the patched model against the unpatched one.

Each world size is spawned once (module fixture) and runs all its cases; every case is then
asserted on its own. fp32 throughout.
"""

from __future__ import annotations

import pytest

from .models import rope

# fp32: loss, every parameter gradient and gathered logits within 1e-5 relative error.
TOL = 1e-5

MODES = [("ulysses", None), ("ring", None)]

# Every family beyond the first seven, each with a structural feature of its own (tests/models.py).
NEW_FAMILIES = ["m2m100", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma", "gemma2", "gemma3", "olmo2", "smollm3",
                "gpt_neox"]
ROPE_TYPES = ["linear", "dynamic", "yarn", "longrope", "llama3"]


def _family_case(family: str) -> dict:
    # Gemma 2 runs eager attention only; left padding makes a padding query see no key, where eager and
    # SDPA differ in transformers itself (see tests/models.causal_batch)
    return dict(family=family, batch=dict(left_pad=False) if family == "gemma2" else {})


def _rope_case(rope_type: str) -> dict:
    # trained on 8 positions, run on 11 (dynamic: max_position_embeddings is its original length)
    return dict(family="llama", model=dict(rope_parameters=rope(rope_type),
                                           max_position_embeddings=8 if rope_type == "dynamic" else 32))


def _coverage_cases(base: dict, tag: str) -> list[dict]:
    """Families, rope types, sliding windows, two forwards before one backward, deep copies."""
    cases = [dict(base, name=f"{tag}-{f}", **_family_case(f)) for f in NEW_FAMILIES]
    cases += [dict(base, name=f"{tag}-llama-rope-{r}", **_rope_case(r)) for r in ROPE_TYPES]
    cases += [
        dict(base, name=f"{tag}-phi3-longrope", family="phi3",
             model=dict(rope_parameters=rope("longrope"), max_position_embeddings=32, original_max_position_embeddings=8)),
        dict(base, name=f"{tag}-mistral-window-4", family="mistral", model=dict(sliding_window=4)),
        dict(base, name=f"{tag}-qwen2-window-4", family="qwen2",
             model=dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
        dict(base, name=f"{tag}-llama-checkpointing-two-forwards", family="llama", checkpointing=True,
             second_batch=dict(length=7)),
        dict(base, name=f"{tag}-marian-checkpointing-two-forwards", family="marian", checkpointing=True,
             second_batch=dict(src_len=6, tgt_len=5)),
        dict(base, name=f"{tag}-llama-deepcopy", family="llama", deepcopy=True),
        dict(base, name=f"{tag}-marian-deepcopy", family="marian", deepcopy=True),
    ]
    return cases


def _cases_world2():
    cases = []
    for mode, ring in MODES:
        base = dict(sp=2, mode=mode, ring_size=ring)
        tag = mode
        cases += [
            dict(base, name=f"{tag}-marian-padded-odd", family="marian"),
            dict(base, name=f"{tag}-marian-uneven-heads", family="marian", model=dict(heads=3)),
            dict(base, name=f"{tag}-marian-src-shorter-than-tgt", family="marian", batch=dict(src_len=5, tgt_len=12)),
            dict(base, name=f"{tag}-marian-length-1", family="marian", batch=dict(src_len=1, tgt_len=1, pad=False, batch=2)),
            dict(base, name=f"{tag}-marian-no-padding", family="marian", batch=dict(src_len=12, tgt_len=8, pad=False)),
            dict(base, name=f"{tag}-marian-empty-source", family="marian", batch=dict(empty_source=True)),
            dict(base, name=f"{tag}-bart", family="bart"),
            dict(base, name=f"{tag}-mbart", family="mbart"),
            dict(base, name=f"{tag}-pegasus", family="pegasus"),
            dict(base, name=f"{tag}-llama-mqa", family="llama", model=dict(heads=4, kv_heads=1)),
            dict(base, name=f"{tag}-llama-uneven-gqa", family="llama", model=dict(heads=6, kv_heads=2)),
            dict(base, name=f"{tag}-llama-no-padding", family="llama", batch=dict(length=12, pad=False)),
            dict(base, name=f"{tag}-mistral", family="mistral"),
            dict(base, name=f"{tag}-qwen2", family="qwen2"),
            dict(base, name=f"{tag}-marian-checkpointing", family="marian", checkpointing=True),
            dict(base, name=f"{tag}-llama-checkpointing", family="llama", checkpointing=True),
            dict(base, name=f"{tag}-marian-eval", family="marian", eval=True),
            dict(base, name=f"{tag}-llama-eval", family="llama", eval=True),
        ]
        cases += _coverage_cases(base, tag)
        cases += _tiled_cases(base, tag)
    return cases


def _tiled_cases(base: dict, tag: str) -> list[dict]:
    """The tiled loss (forced on, 5 tokens per chunk): bias after the head (Marian, BART), soft-capping
    (Gemma 2), tied head (Llama), recompute under gradient checkpointing with two forwards."""
    tiled = dict(base, patch=dict(tiled_loss=True), chunk_elements=97 * 5)
    cases = [dict(tiled, name=f"{tag}-tiled-marian", family="marian"),
             dict(tiled, name=f"{tag}-tiled-llama-checkpointing-two-forwards", family="llama", checkpointing=True,
                  second_batch=dict(length=7))]
    if tag == "ulysses":  # what follows the head does not depend on the mode
        cases += [dict(tiled, name=f"{tag}-tiled-bart", family="bart"),
                  dict(tiled, name=f"{tag}-tiled-llama", family="llama"),
                  dict(tiled, name=f"{tag}-tiled-gemma2-softcap", **_family_case("gemma2"))]
    return cases


def _cases_world4():
    cases = []
    for mode, ring in MODES + [("hybrid", 2)]:
        tag = mode
        sp4 = dict(sp=4, mode=mode, ring_size=ring)
        cases += [
            dict(sp4, name=f"{tag}-sp4-marian-uneven-heads", family="marian", model=dict(heads=6)),
            dict(sp4, name=f"{tag}-sp4-llama-kv-lt-sp", family="llama", model=dict(heads=4, kv_heads=2)),
            dict(sp4, name=f"{tag}-sp4-llama-uneven", family="llama", model=dict(heads=6, kv_heads=3)),
            dict(sp4, name=f"{tag}-sp4-marian-eval", family="marian", eval=True),
        ]
        if mode == "hybrid":  # uneven heads on the Ulysses part (3 and 5 heads over 2 ranks)
            cases += [dict(sp4, name=f"{tag}-sp4-marian-3-heads", family="marian", model=dict(heads=3)),
                      dict(sp4, name=f"{tag}-sp4-llama-5-heads-mqa", family="llama", model=dict(heads=5, kv_heads=1)),
                      dict(sp4, name=f"{tag}-sp4-gemma3-window", **_family_case("gemma3")),
                      dict(sp4, name=f"{tag}-sp4-mixtral", **_family_case("mixtral")),
                      dict(sp4, name=f"{tag}-sp4-m2m100", **_family_case("m2m100")),
                      dict(sp4, name=f"{tag}-sp4-llama-rope-dynamic", **_rope_case("dynamic")),
                      dict(sp4, name=f"{tag}-sp4-llama-rope-longrope", **_rope_case("longrope")),
                      dict(sp4, name=f"{tag}-sp4-llama-checkpointing-two-forwards", family="llama",
                           checkpointing=True, second_batch=dict(length=7))]
        if mode != "hybrid":
            cases += [dict(sp=2, mode=mode, ring_size=ring, name=f"{tag}-sp2xdp2-marian", family="marian"),
                      dict(sp=2, mode=mode, ring_size=ring, name=f"{tag}-sp2xdp2-tiled-marian", family="marian",
                           patch=dict(tiled_loss=True), chunk_elements=97 * 3),
                      dict(sp=2, mode=mode, ring_size=ring, name=f"{tag}-sp2xdp2-llama", family="llama")]
    return cases


CASES = {2: _cases_world2(), 4: _cases_world4()}


@pytest.fixture(scope="module")
def results(parity_world):
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = {}
            for rank_results in parity_world(world):
                for r in rank_results["cases"]:
                    cache[world].setdefault(r["name"], []).append(r)
        return cache[world]
    return get


def _params():
    return [pytest.param(world, c["name"], id=f"w{world}-{c['name']}") for world in CASES for c in CASES[world]]


@pytest.mark.parametrize("world,name", _params())
def test_parity(results, world, name):
    per_rank = results(world)[name]
    assert len(per_rank) == world
    for r in per_rank:
        if "logits_err" in r:
            assert r["logits_err"] < TOL, r
            assert r.get("encoder_err", 0.0) < TOL, r
            continue
        assert r["loss_err"] < TOL, r
        assert r["grad_err"] < TOL, r
        # the loss is the same number on every rank of the SP group
        assert len(set(r["group_losses"])) == 1, r
