"""Tier 2: PEFT LoRA with sequence parallelism, in every order of wrapping and patching; merged and
unpatched models stay consistent; generation and adapter save/reload. sp=2, fp32. Skipped without peft.
In-rank bodies: tests/runs/lora.py (in the TRL group)."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

TOL = 1e-5


@pytest.fixture(scope="module")
def results(spawned):
    return [r["peft"] for r in spawned("trl", 2)]


@pytest.mark.parametrize("order", ["patch-the-peft-model", "patch-its-base-model", "patch-then-get-peft-model"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_is_exact_in_every_order(results, order, checkpointing):
    for rank in results:
        loss_err, grad_err = rank["orders"][f"{order}-checkpointing" if checkpointing else order]
        assert loss_err < TOL and grad_err < TOL, (loss_err, grad_err)


def test_merge_and_unload_keeps_a_consistent_patched_model(results):
    for rank in results:
        r = rank["merge"]
        assert r["merged_is_patched"] and r["unpatched_merged_is_plain"]
        assert r["merged"][0] < TOL and r["merged"][1] < TOL, r["merged"]


def test_generate_and_adapter_reload(results):
    for rank in results:
        assert rank["merge"]["generate"]
        assert rank["merge"]["reloaded"] < TOL


def test_unpatch_after_trl_keeps_trls_forward(results):
    for rank in results:
        assert not rank["trl"]["patched"]
        assert rank["trl"]["fused_after_unpatch"] < TOL
