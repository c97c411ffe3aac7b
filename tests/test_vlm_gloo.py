"""Tier 2: vision-language models under SP on gloo (bodies in tests/runs/vlm.py, run in the `parity` groups).

A multimodal model's text model is its backbone: the vision tower and projector run before it on the full
batch on every rank, the merged embeddings, M-RoPE positions ([3, b, s]) and per-token visual features are
sharded. Rows hold one, two and no images; everything within 1e-5 of the unpatched model in one process. The
Trainer on examples/vlm_images.py: test_trainer_gloo.py (setup sp2-vlm)."""

from __future__ import annotations

import pytest

from .runs.vlm import CASES

TOL = 1e-5


@pytest.fixture(scope="module")
def results(spawned):
    cache: dict = {}

    def get(size):
        if size not in cache:
            cases: dict = {}
            for rank in spawned("parity", size):
                for case in rank["vlm"]:
                    cases.setdefault(case["name"], []).append(case)
            cache[size] = cases
        return cache[size]

    return get


@pytest.mark.parametrize(
    "size,name", [pytest.param(w, c["name"], id=f"w{w}-{c['name']}") for w in CASES for c in CASES[w]]
)
def test_images_train_and_generate_as_the_unpatched_model(results, size, name):
    per_rank = results(size)[name]
    assert len(per_rank) == size
    for r in per_rank:
        assert r["backbone"].endswith(("TextModel", "LlamaModel", "Qwen2Model")) and r["front"], r  # the text model
        assert r["loss_err"] < TOL and r["grad_err"] < TOL and r["logits_err"] < TOL, r
        if r["name"] == "mixing-tower":  # checked on the first batch: it mixes images, so it runs whole
            assert r["images_cut"] == [(False, 0)], r
        elif not r["name"].startswith("qwen2_audio"):  # each rank encoded its own images only
            assert r["images_cut"] and all(checked and calls >= 2 for checked, calls in r["images_cut"]), r
        if "tokens_err" in r:
            assert r["tokens_err"] == 0 and r["scores_err"] < TOL, r
