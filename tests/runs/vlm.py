"""Vision-language models under SP (run in the `parity` groups): the patched model against the unpatched one
in the same process on a batch of rows holding one, two and no images (conformance/images.py: a two-block
vision tower, synthetic images as the processors give them). Loss, every gradient (the vision tower's and
the projector's included: it runs before the text model on the full batch on every rank), the gathered
eval logits, and greedy generation with the images in the prompt."""

from __future__ import annotations

import copy

import torch.distributed as dist

import seqpar_hf
from conformance import variants
from conformance.images import image_batch, tiny_vlm

CASES = {
    2: [
        dict(name="qwen2_5_vl-ulysses", model=("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"), generate=True),
        # Qwen3-VL adds its first vision block's features to the first text layer at the image tokens (deepstack)
        dict(name="qwen3_vl-ring", model=("qwen3_vl", "Qwen3VLForConditionalGeneration"), mode="ring", generate=True),
        dict(name="llava-ulysses", model=("llava", "LlavaForConditionalGeneration")),  # pixels [n, c, h, w]
    ],
    4: [
        dict(name="qwen2_5_vl-hybrid", model=("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"), mode="hybrid"),
        dict(name="qwen3_vl-ulysses4", model=("qwen3_vl", "Qwen3VLForConditionalGeneration")),
    ],
}


def run_case(case: dict) -> dict:
    world = dist.get_world_size()
    mode = case.get("mode", "ulysses")
    layout = seqpar_hf.ParallelLayout(sp_size=world, mode=mode, **({"ring_size": 2} if mode == "hybrid" else {}))
    model = tiny_vlm(*case["model"])
    batch = image_batch(model)
    reference = copy.deepcopy(model)
    ref, batch = variants.padded_reference(reference, batch)
    prompts = {k: v for k, v in batch.items() if k != "labels"}
    if case.get("generate"):
        ref_gen, _ = variants.generate_reference(reference, prompts)
    seqpar_hf.patch_model(model, layout)
    state = seqpar_hf.models.patch.state_of(model)
    out = {"name": case["name"], "backbone": type(state.family.backbone).__name__, "front": state.family.front}
    out.update(variants.padded_patched(model, ref, batch, layout))
    if case.get("generate"):
        out.update(variants.generate_patched(model, ref_gen, prompts, layout))
    return out


def all_checks(world: int) -> list[dict]:
    return [run_case(case) for case in CASES.get(world, [])]
