"""Vision-language (and audio-language) models under SP (run in the `parity` groups): the patched model
against the unpatched one in the same process on a batch of rows holding one, two and no images
(conformance/images.py: a two-block vision tower, synthetic images as the processors give them). Loss, every
gradient (the vision tower's and the projector's included: it runs before the text model on the full batch on
every rank), the gathered eval logits, and greedy generation with the images in the prompt. An audio LM
(Qwen2-Audio) takes its audio features the same way: its audio tower runs before its text model."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers

import seqpar_hf
from conformance import variants
from conformance.images import image_batch, tiny_vlm

CASES = {
    2: [
        dict(name="qwen2_5_vl-ulysses", model=("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"), generate=True),
        # Qwen3-VL adds its first vision block's features to the first text layer at the image tokens (deepstack)
        dict(name="qwen3_vl-ring", model=("qwen3_vl", "Qwen3VLForConditionalGeneration"), mode="ring", generate=True),
        dict(name="llava-ulysses", model=("llava", "LlavaForConditionalGeneration")),  # pixels [n, c, h, w]
        # each image's tokens see each other both ways inside causal attention, also across the ranks' shards
        dict(name="gemma3-ring", model=("gemma3", "Gemma3ForConditionalGeneration"), mode="ring", generate=True),
        dict(name="qwen2_audio-ring", model=("qwen2_audio", "Qwen2AudioForConditionalGeneration"), mode="ring"),
        # a vision tower that mixes its images (each patch embedding shifted by the mean of all of them): the
        # check on the first batch sees it, and the tower runs on all images on every rank
        dict(name="mixing-tower", model=("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"), mixing=True),
    ],
    4: [
        # five images: at least one per rank for the vision tower's cut (rows of 2, 2 and 1 images)
        dict(
            name="qwen2_5_vl-hybrid",
            model=("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
            mode="hybrid",
            rows=((0, 1), (1, 2), (2,)),
        ),
        # deepstack features at sp=4, the rows' image counts 2, 2 and 1
        dict(
            name="qwen3_vl-ulysses",
            model=("qwen3_vl", "Qwen3VLForConditionalGeneration"),
            rows=((0, 1), (1, 2), (2,)),
        ),
    ],
}


def run_case(case: dict) -> dict:
    world = dist.get_world_size()
    mode = case.get("mode", "ulysses")
    layout = seqpar_hf.ParallelLayout(sp_size=world, mode=mode, **({"ring_size": 2} if mode == "hybrid" else {}))
    audio = case["model"][0] == "qwen2_audio"
    model = tiny_audio() if audio else tiny_vlm(*case["model"])
    batch = audio_batch(model) if audio else image_batch(model, **({"rows": case["rows"]} if "rows" in case else {}))
    reference = copy.deepcopy(model)
    if case.get("mixing"):
        for m in (model, reference):
            _mix_images(m.model.visual.patch_embed)
    ref, batch = variants.padded_reference(reference, batch)
    prompts = {k: v for k, v in batch.items() if k != "labels"}
    if case.get("generate"):
        ref_gen, _ = variants.generate_reference(reference, prompts)
    seqpar_hf.patch_model(model, layout)
    state = seqpar_hf.models.patch.state_of(model)
    out = {"name": case["name"], "backbone": type(state.family.backbone).__name__, "front": state.family.front}
    out.update(variants.padded_patched(model, ref, batch, layout))
    out["images_cut"] = [(s.checked, s.cut_calls) for s in state.image_shards]  # the tower on 1/sp of them
    if case.get("generate"):
        out.update(variants.generate_patched(model, ref_gen, prompts, layout))
    return out


def all_checks(world: int) -> list[dict]:
    return [run_case(case) for case in CASES.get(world, [])]


def tiny_audio(seed: int = 0):
    """A tiny Qwen2-Audio: a two-layer audio encoder over 8 mel bins, 32 frames per clip (8 audio tokens)."""
    from conformance.tiny import _family_overrides, build_config

    model_class = transformers.Qwen2AudioForConditionalGeneration
    config = build_config("qwen2_audio", _family_overrides("qwen2_audio"), model_class.config_class)
    sizes = dict(num_mel_bins=8, encoder_layers=2, encoder_attention_heads=2, d_model=32, encoder_ffn_dim=64)
    for key, value in {**sizes, "max_source_positions": 16}.items():
        setattr(config.audio_config, key, value)
    torch.manual_seed(seed)
    model = model_class._from_config(config, attn_implementation="sdpa", dtype=torch.float32).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def audio_batch(model) -> dict:
    """Two left-padded rows, an 8-token clip in each (at the start of one, the end of the other)."""
    token = model.config.audio_token_id
    rows = [[5, 6, 7] + [token] * 8 + list(range(10, 40)), [9] * 3 + list(range(20, 50)) + [token] * 8]
    longest = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (longest - len(r)) + r for r in rows])
    mask = (ids != 0).long()
    features = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(5))
    labels = ids.masked_fill((mask == 0) | (ids == token), -100)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "input_features": features,
        "feature_attention_mask": torch.ones(2, 32, dtype=torch.long),
        "labels": labels,
    }


class _Mixed:
    """A patch embedding whose output is shifted by the mean over every image's patches (mixes images)."""

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, *args, **kwargs):
        y = self.forward(*args, **kwargs)
        return y + y.mean(0, keepdim=True)


def _mix_images(module) -> None:
    module.forward = _Mixed(module.forward)
