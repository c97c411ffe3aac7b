"""Tier 1: the full-batch validation (seqpar_hf/models/forward/validate.py) raises what the unpatched model raises,
with a message naming the tensor and the sizes; where the unpatched model silently accepts a bad batch
(a padding mask shorter than the sequence, shift_labels of another length), a ValueError. No process
group: `validate.check` is a function of the model and the batch. The same batches run under sp=2 in
tests/runs/robustness.py (every rank raises, in tests/test_robustness_gloo.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from seqpar_hf.models.forward import validate
from seqpar_hf.models.proof.inspection import inspect_model

from .runs.robustness import build, validation_batches

BATCHES = validation_batches()
build = functools.cache(build)  # one model per family: forwards under no_grad leave it as it is
STRICTER = {"attention-mask-shorter", "seq2seq-decoder-mask-shorter", "shift-labels-shorter"}  # plain: no error


def _plain_error(model, batch):
    try:
        with torch.no_grad():
            model(**batch)
    except Exception as exc:  # noqa: BLE001 - its class is what we compare
        return exc
    return None


def _validation_error(model, batch):
    kw = dict(batch)
    labels, shift_labels = kw.pop("labels", None), kw.pop("shift_labels", None)
    family = inspect_model(model)
    try:
        values = validate.extremes(family.kind, kw, labels, shift_labels, torch.device("cpu")).tolist()
        validate.check(family, kw, labels, shift_labels, values)
    except Exception as exc:  # noqa: BLE001 - likewise: its class is compared with the plain model's
        return exc
    return None


@pytest.mark.parametrize("name", list(BATCHES))
def test_validation_raises_what_the_unpatched_model_raises(name):
    family, batch = BATCHES[name]
    model = build(family)
    plain, ours = _plain_error(model, batch), _validation_error(model, batch)
    assert ours is not None, name
    if name in STRICTER:
        assert plain is None and isinstance(ours, ValueError), (plain, ours)
    else:
        assert plain is not None and type(ours) is type(plain), (type(plain), plain, type(ours), ours)
    tensor = next(
        k
        for k in (
            "decoder_attention_mask",
            "attention_mask",
            "shift_labels",
            "position_ids",
            "labels",
            "decoder_input_ids",
            "input_ids",
        )
        if k in str(ours)
    )
    assert tensor and any(ch.isdigit() for ch in str(ours)), ours  # names the tensor and the sizes


@pytest.mark.parametrize("family,length", [("bart", 128), ("marian", 128), ("gpt2", 64), ("llama", 300)])
def test_lengths_at_the_position_table_pass(family, length):
    """No false refusal: exactly the table's length (rotary models have no table)."""
    model = build(family)
    ids = torch.randint(3, 90, (1, length))
    batch = {"input_ids": ids, "labels": ids}
    assert _plain_error(model, batch) is None and _validation_error(model, batch) is None


def test_position_tables_are_found_by_module():
    """Learned and sinusoidal tables looked up by id (BART's offset of 2 included) and GPT-2's wpe, a plain
    nn.Embedding of max_position_embeddings rows; none for rotary models."""
    tables = {f: validate.limits(inspect_model(build(f))).positions for f in ("bart", "marian", "gpt2", "llama")}
    assert {side: n for side, (n, _) in tables["bart"].items()} == {"encoder": 128, "decoder": 128}
    assert {side: n for side, (n, _) in tables["marian"].items()} == {"encoder": 128, "decoder": 128}
    assert tables["gpt2"]["decoder"][0] == 64 and "wpe" in tables["gpt2"]["decoder"][1]
    assert tables["llama"] == {}


def test_encoder_only_models_are_refused():
    """BertConfig has no is_causal: refused, not patched as causal (its masked-LM labels would have been
    shifted): the dry run sees its loss read the label at the same position."""
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(
        BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40)
    )
    with pytest.raises(
        ValueError,
        match=r"BertForMaskedLM: its forward computes its loss against the label at the "
        r"same position \(no shift\)",
    ):
        inspect_model(model)


def test_inputs_the_forward_would_pass_unsharded_are_refused():
    """Images reach a vision-language model's forward whole (its vision tower runs before its text model, the
    backbone, on every rank); what it hands its text model besides the sharded inputs is refused by name;
    masks it prepared with the mask function (Gemma 3's) are read there; a text model's per-token extras are
    refused by name."""
    from transformers import Gemma3ForConditionalGeneration, Qwen2VLForConditionalGeneration

    from conformance.tiny import build_config

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}  # M-RoPE over 8-wide heads
    config = build_config("qwen2_vl", {"text_config": {"rope_parameters": rope}, "vision_config": {"depth": 1}})
    model = Qwen2VLForConditionalGeneration(config).float()
    family = inspect_model(model)
    assert family.backbone is model.model.language_model and family.front == ("model.visual",)
    kw = {
        "input_ids": torch.randint(3, 50, (1, 12)),
        "pixel_values": torch.randn(16, 3 * 2 * 4 * 4),  # 16 patches of 2 frames x 4 x 4 pixels
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }
    values = validate.extremes(family.kind, kw, None, None, torch.device("cpu")).tolist()
    validate.check(family, kw, None, None, values, outer=True)  # the language model's forward takes them
    inner = {"inputs_embeds": torch.randn(1, 12, 32), "pixel_values": kw["pixel_values"]}
    with pytest.raises(NotImplementedError, match=r"hands its text model pixel_values, which sequence parallelism"):
        validate.check_unsharded(family, inner)
    # Gemma 3's front hands its text model the masks it prepared (image blocks that see each other both ways):
    # the dry run sees them made by the mask function from the padding mask, and descends all the same
    gemma = Gemma3ForConditionalGeneration(build_config("gemma3", {"mm_tokens_per_image": 4})).float()
    family = inspect_model(gemma)
    assert family.front == ("model.vision_tower", "model.multi_modal_projector") and not family.no_front
    llama = build("llama")
    batch = dict(BATCHES["causal-labels-longer"][1], token_type_ids=torch.zeros(3, 11, dtype=torch.long))
    kw = {"input_ids": batch["input_ids"], "token_type_ids": batch["token_type_ids"]}
    values = validate.extremes("causal", kw, None, None, torch.device("cpu")).tolist()
    with pytest.raises(NotImplementedError, match=r"token_type_ids= \(\(3, 11\)\)"):
        validate.check(inspect_model(llama), kw, None, None, values)


def test_multi_axis_positions_are_refused_by_name():
    """M-RoPE positions [axes, b, s] (what a vision-language model's generate passes) are not sharded: refused
    as not supported, not as a bad batch (Cosmos3-Omni's generate raised the shape error before)."""
    llama = build("llama")
    ids = BATCHES["causal-labels-longer"][1]["input_ids"]
    kw = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).expand(3, *ids.shape)}
    values = validate.extremes("causal", kw, None, None, torch.device("cpu")).tolist()
    with pytest.raises(NotImplementedError, match=r"position_ids of shape \(3, 3, 11\): multi-axis positions"):
        validate.check(inspect_model(llama), kw, None, None, values)


def test_masks_a_front_prepared_are_read_or_refused():
    """Gemma 3's front hands its text model masks with image blocks: patched (sp=1, the same path as a group's)
    its loss and gradients are the unpatched model's; what the sharded attention cannot apply as the masks say is
    refused before sharding, on the full batch (so on every rank alike): packed rows whose full and sliding masks
    keep documents apart differently (transformers' own masks here), packed rows with image blocks, masks whose
    documents are not the positions', masks that differ in padding."""
    import copy

    import seqpar_hf
    from conformance.images import image_batch, tiny_vlm
    from seqpar_hf.models.forward import front_masks
    from seqpar_hf.models.forward.inputs import shard_causal
    from seqpar_hf.models.generation.decoding import DeferredMask

    model = tiny_vlm("gemma3", "Gemma3ForConditionalGeneration")
    reference = copy.deepcopy(model)
    batch = image_batch(model)
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    out, want = model(**batch), reference(**batch)
    out.loss.backward(), want.loss.backward()
    assert abs(float(out.loss) - float(want.loss)) < 1e-6
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            assert float((p.grad - q.grad).abs().max()) <= 1e-5 * max(float(q.grad.abs().max()), 1e-4), name
    one = image_batch(reference, rows=((0,),))
    length = one["input_ids"].shape[1]
    packed = {k: v for k, v in one.items() if k != "attention_mask"}
    packed["position_ids"] = torch.cat([torch.arange(length - 5), torch.arange(5)])[None]
    with pytest.raises(NotImplementedError, match="differ in their padding, documents or blocks"):
        model(**packed)
    layout = seqpar_hf.ParallelLayout(sp_size=1)
    ids = torch.randint(3, 50, (1, 12))
    restart = {"input_ids": ids, "position_ids": torch.cat([torch.arange(6), torch.arange(6)])[None]}
    blocks = torch.full((1, 12), -1)
    blocks[0, 2:5] = 0
    with pytest.raises(NotImplementedError, match=r"packed rows .* with blocks of tokens"):
        documents = torch.tensor([[0] * 6 + [1] * 6])  # what the positions say
        shard_causal(layout, dict(restart), 0, False, blocks=blocks, documents=documents, front=True)
    with pytest.raises(NotImplementedError, match=r"other documents than its positions say \(none in the masks"):
        shard_causal(layout, dict(restart), 0, False, documents=None, front=True)
    causal = lambda b, h, q, kv: kv <= q
    masks = {
        "full_attention": DeferredMask((1, 12, 12, 0, 0, causal, torch.ones(1, 12)), {}),
        "sliding_attention": DeferredMask((1, 12, 12, 0, 0, causal, torch.zeros(1, 12)), {}),
    }
    with pytest.raises(NotImplementedError, match="differ in their padding"):
        front_masks.take(masks, lambda *a: None)
