"""Tier 1 (one process, no process group): the adapter at sp_size=1 runs the full patched path
(sharding, mask and attention functions, group loss) and must equal the unpatched model."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

import seqpar_hf
from seqpar_hf import _compat

from .helpers.models import MODEL_CLASSES, SEQ2SEQ, build_model, make_batch, relative_error

FAMILIES = list(MODEL_CLASSES)
TOL = 1e-6  # same kernels on the same full sequence: only the loss reduction order differs


@pytest.mark.parametrize("family", FAMILIES)
def test_sp1_patched_equals_unpatched(family):
    model = build_model(family)
    reference = copy.deepcopy(model)
    batch = make_batch(family, seed=1, **({"left_pad": False} if family == "gemma2" else {}))
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    out, expected = model(**batch), reference(**batch)
    out.loss.backward(), expected.loss.backward()
    assert relative_error(out.loss, expected.loss) < TOL
    # logits of real tokens (a padding query that sees no key is a convention: SDPA 0, eager the mean)
    real = batch.get("decoder_attention_mask", batch["attention_mask"] if family not in SEQ2SEQ else None)
    real = torch.ones(out.logits.shape[:2], dtype=torch.bool) if real is None else real.bool()
    assert relative_error(out.logits[real], expected.logits[real]) < TOL
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            assert relative_error(p.grad, q.grad, floor=1e-4) < TOL, name


def test_unpatch_restores_the_plain_model():
    model = build_model("marian")
    implementation = _compat.attn_implementation(model.config)
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    assert seqpar_hf.is_patched(model) and _compat.attn_implementation(model.config) == "seqpar_hf"
    seqpar_hf.unpatch_model(model)
    assert not seqpar_hf.is_patched(model)
    assert _compat.attn_implementation(model.config) == implementation
    assert "forward" not in model.__dict__ and "generate" not in model.__dict__
    assert not any(hasattr(m, "_seqpar_site") for m in model.modules())
    assert all(not m._forward_pre_hooks for m in model.modules())
    model(**make_batch("marian", seed=0))  # still runs


def test_patch_is_per_instance():
    """A second model built from the same config object keeps its own attention."""
    first = build_model("marian")
    second = type(first)(first.config)
    seqpar_hf.patch_model(first, seqpar_hf.ParallelLayout(sp_size=1))
    assert _compat.attn_implementation(second.config) == "sdpa"
    assert not any(hasattr(m, "_seqpar_site") for m in second.modules())


def test_second_layout_is_refused():
    model = build_model("llama")
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    with pytest.raises(ValueError, match="already patched.*unpatch_model"):
        seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))


def test_relative_bias_other_than_t5s_is_refused_naming_the_table():
    """T5's table by distance is proven and sharded (tests/runs/parity.py); LongT5's local attention gathers its
    bias otherwise (no compute_bias by distance): refused, naming the module and the families that work."""
    from conformance.tiny import build_tiny

    model = build_tiny("longt5", "LongT5ForConditionalGeneration")[0]
    with pytest.raises(
        ValueError,
        match=r"LongT5ForConditionalGeneration: encoder.block.0.layer.0.LocalSelfAttention \(LongT5LocalAttention\) "
        r"adds a relative position bias other than T5's.*T5, mT5, UMT5 and Switch Transformers work",
    ):
        seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))


@pytest.mark.parametrize("family", ["marian", "llama"])
def test_generate_runs_without_sp_and_matches(family):
    model = build_model(family)
    reference = copy.deepcopy(model)
    batch = make_batch(family, seed=2)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    kwargs = dict(max_new_tokens=5, do_sample=False)
    if family not in SEQ2SEQ:
        inputs = {"input_ids": batch["input_ids"][:1, 3:], "attention_mask": batch["attention_mask"][:1, 3:]}
    assert torch.equal(model.generate(**inputs, **kwargs), reference.generate(**inputs, **kwargs))
    assert _compat.attn_implementation(model.config) == "seqpar_hf"  # back to SP after generation


def test_saved_patched_model_is_a_plain_checkpoint(tmp_path):
    model = build_model("marian")
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    model.save_pretrained(tmp_path)
    assert "seqpar" not in (tmp_path / "config.json").read_text()
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    batch = make_batch("marian", seed=3)
    model.eval()
    assert relative_error(loaded(**batch).loss, model(**batch).loss) < TOL


def test_four_dimensional_masks_are_refused():
    model = build_model("llama")
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    batch = make_batch("llama", seed=0)
    batch["attention_mask"] = torch.ones(3, 1, 11, 11, dtype=torch.bool)
    with pytest.raises(ValueError, match="2D padding masks"):
        model(**batch)


def test_structural_refusals_name_the_reason_and_the_fix():
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(BloomConfig(vocab_size=32, hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="BloomForCausalLM: transformer \\(BloomModel\\) computes attention itself"):
        seqpar_hf.patch_model(bloom, seqpar_hf.ParallelLayout(sp_size=1))
    # Llama 4's NoPE layers scale their queries by their index counted from 0 in each call, past floor_scale
    # (8192) tokens only, which no dry run reaches: the sharded attention rescales them, proven at patch time
    # against the module's own forward; a module whose scale is not the one re-derived is refused
    from transformers import Llama4ForCausalLM

    from conformance.tiny import build_config
    from seqpar_hf.models.proof import temperature

    config = build_config("llama4_text", {})
    seqpar_hf.patch_model(Llama4ForCausalLM(config), seqpar_hf.ParallelLayout(sp_size=1))  # proven: accepted
    wrong = temperature.scale
    temperature.scale = lambda module, index, floor_scale=None: wrong(module, index + 1, floor_scale)
    try:
        with pytest.raises(
            ValueError,
            match=r"model.layers.1.self_attn scales its queries.*floor_scale=8192.*its query scale is not.*"
            r"attn_temperature_tuning = False",
        ):
            seqpar_hf.patch_model(Llama4ForCausalLM(config), seqpar_hf.ParallelLayout(sp_size=1))
    finally:
        temperature.scale = wrong


def test_attention_outside_a_sharded_forward_stops_with_the_fix():
    model = build_model("marian")
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    batch = make_batch("marian", seed=0)
    with pytest.raises(RuntimeError, match="outside a sharded forward.*sp_disabled"):
        model.get_encoder()(input_ids=batch["input_ids"])  # a submodule called directly
    with seqpar_hf.sp_disabled(model):
        model.get_encoder()(input_ids=batch["input_ids"])  # fine without SP
    rebuilt = type(model)(model.config)  # selects "seqpar_hf" but was never patched
    with pytest.raises(RuntimeError, match="was not patched"):
        rebuilt(**batch)


def test_backbone_alone_and_its_outputs_are_the_unpatched_ones():
    model = build_model("llama")
    reference = copy.deepcopy(model)
    batch = make_batch("llama", seed=4)
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    got = model.model(**inputs, output_hidden_states=True)  # the backbone, as TRL calls it
    want = reference.model(**inputs, output_hidden_states=True)
    assert relative_error(got.last_hidden_state, want.last_hidden_state) < TOL
    assert all(relative_error(a, b) < TOL for a, b in zip(got.hidden_states, want.hidden_states))
    assert relative_error(model(**inputs).logits, reference(**inputs).logits) < TOL  # no labels: full logits


def test_deepcopy_is_patched_and_independent():
    model = build_model("llama")
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    copied = copy.deepcopy(model)
    assert seqpar_hf.is_patched(copied) and copied.model.forward.state is not model.model.forward.state
    assert copied.model.forward.state.layout is model.model.forward.state.layout
    batch = make_batch("llama", seed=5)
    assert relative_error(copied(**batch).loss, model(**batch).loss) < TOL
    seqpar_hf.unpatch_model(copied)
    assert seqpar_hf.is_patched(model) and not seqpar_hf.is_patched(copied)
