"""Vision-language rows: tiny vision towers and synthetic images as the processors give them.

Two input conventions cover the models built here:
  grid    Qwen2-VL and its descendants: every image's patches flattened into one `pixel_values`
          [patches, channels * temporal * patch * patch] with `image_grid_thw` [images, 3]; an image takes
          t * h * w / merge**2 tokens, framed by the vision start / end ids; `mm_token_type_ids` marks them.
  pixels  LLaVA-style: `pixel_values` [images, channels, size, size]; an image takes as many tokens as
          its features have rows (read off the model's own `get_image_features`).
A model with any other convention is "not runnable" here (the sweep says so); the batch: three rows of
different image counts (one, two, none), left-padded, labels on the text tokens only.
"""

from __future__ import annotations

import inspect

import torch
import transformers

from .tiny import _family_overrides, base_type, build_config, perturbed

# sizes of the tiny vision towers (each config takes the fields it has)
VISION = {
    "depth": 2,
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "num_attention_heads": 2,
    "fullatt_block_indexes": [1],  # Qwen2.5-VL: one windowed block, one full
    "window_size": 16,
    "deepstack_visual_indexes": [0],  # Qwen3-VL: the first block's features added to the first text layer
    "image_size": 16,  # pixels: 16 x 16 images of 4 x 4 patches
    "patch_size": 4,
}
GRIDS = ((1, 4, 4), (1, 4, 8), (1, 8, 4))  # (t, h, w) in patches: 4, 8 and 8 tokens after a 2 x 2 merge
ROWS = ((0,), (1, 2), ())  # which images each row holds
LENGTH = 40
PIXEL_IMAGES = 3


class NoImages(Exception):
    """This model's image inputs are not built here."""


def tiny_vlm(model_type: str, class_name: str, seed: int = 0, perturb: float = 0.02):
    """The tiny fp32 model with a two-block vision tower whose output width is the text model's."""
    model_class = getattr(transformers, class_name)
    config = build_config(base_type(model_type), _family_overrides(model_type), model_class.config_class)
    text = config.get_text_config()
    vision = getattr(config, "vision_config", None)
    if vision is None:
        raise NoImages(f"{class_name} has no vision_config")
    for key, value in VISION.items():
        if hasattr(vision, key):
            paired = isinstance(getattr(vision, key), (list, tuple)) and key in ("image_size", "patch_size")
            setattr(vision, key, (value, value) if paired else value)  # InternVL keeps (height, width)
    if getattr(vision, "pixel_shuffle_ratio", None):  # Llama 4: the shuffled patches' width feeds its adapter
        vision.intermediate_size = int(vision.hidden_size / vision.pixel_shuffle_ratio**2)
        for key in ("projector_input_dim", "projector_output_dim", "vision_output_dim"):
            setattr(vision, key, 64)
    if getattr(vision, "head_dim", None) is not None:  # Pixtral: its rotary is as wide as its heads
        vision.head_dim = vision.hidden_size // vision.num_attention_heads
    if getattr(config, "image_grid_pinpoints", None) is not None:  # LLaVA-NeXT: one tile beside the base image
        config.image_grid_pinpoints = [[VISION["image_size"], VISION["image_size"]]]
    for key in ("out_hidden_size", "projection_dim", "text_hidden_size"):
        if hasattr(vision, key):
            setattr(vision, key, text.hidden_size)
    for c in (config, text):  # a released pad id past the tiny vocabulary (Idefics3: 128002)
        if isinstance(getattr(c, "pad_token_id", None), int) and c.pad_token_id >= text.vocab_size:
            c.pad_token_id = 0
    if hasattr(config, "mm_tokens_per_image"):  # Gemma 3: its 4 x 4 patches pooled to 2 x 2
        config.mm_tokens_per_image = 4
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, dict) and hasattr(vision, "spatial_merge_size"):  # M-RoPE sections fit the head
        head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        half = head // 2
        text.rope_parameters = {**rope, "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]}
    torch.manual_seed(seed)
    try:
        model = model_class._from_config(config, attn_implementation="sdpa", dtype=torch.float32).float()
    except ValueError as exc:  # a model without SDPA (GOT-OCR2): eager, as conformance/tiny.py builds it
        if "does not support" not in str(exc):
            raise
        torch.manual_seed(seed)
        model = model_class._from_config(config, attn_implementation="eager", dtype=torch.float32).float()
    return perturbed(model, seed, perturb)


def _style(model) -> str:
    vision = model.config.vision_config
    if hasattr(vision, "temporal_patch_size") and hasattr(vision, "spatial_merge_size"):
        return "grid"
    if hasattr(vision, "image_size") and callable(getattr(model, "get_image_features", None)):
        return "pixels"
    raise NoImages(f"{type(model).__name__}: no synthetic-image convention for its processor here")


def image_batch(
    model, rows=ROWS, length: int = LENGTH, seed: int = 100, pad: int = 0, labels: bool = True, left: bool = True
) -> dict:
    """Rows holding the images `rows` names (indices into GRIDS, or into PIXEL_IMAGES images), left-padded (or
    right-padded: under eager attention, as variants.padded_inputs says why)."""
    config = model.config
    image_id = getattr(config, "image_token_id", None)
    if image_id is None:
        image_id = getattr(config, "image_token_index", None)
    if image_id is None:
        raise NoImages(f"{type(model).__name__}: its config names no image token")
    g = torch.Generator().manual_seed(seed)
    style = _style(model)
    starts = [getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)]
    specials = {image_id, *starts, getattr(config, "video_token_id", None), pad}
    vocab = config.get_text_config().vocab_size

    def text(n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = int(torch.randint(3, vocab, (1,), generator=g))
            if t not in specials:
                out.append(t)
        return out

    used = [i for row in rows for i in row]
    extra: dict = {}
    if style == "grid":
        vision = config.vision_config
        merge = vision.spatial_merge_size**2
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        tokens = [t * h * w // merge for t, h, w in GRIDS]
        if used:
            patches = [GRIDS[i][0] * GRIDS[i][1] * GRIDS[i][2] for i in used]
            extra["pixel_values"] = torch.cat([torch.randn(n, width, generator=g) for n in patches])
            extra["image_grid_thw"] = torch.tensor([GRIDS[i] for i in used])
    else:
        size = config.vision_config.image_size
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(config.vision_config, "num_channels", 3)
        images = torch.randn(PIXEL_IMAGES, channels, size, size, generator=g)
        sizes = {}
        if "image_sizes" in inspect.signature(model.get_image_features).parameters:  # Mistral 3, LLaVA-NeXT
            sizes = {"image_sizes": torch.tensor([[size, size]] * PIXEL_IMAGES)}
        tiles = getattr(config, "image_grid_pinpoints", None) is not None  # LLaVA-NeXT: [images, tiles, c, h, w]
        per_row = "pixel_attention_mask" in inspect.signature(model.get_image_features).parameters  # Idefics3
        if tiles:
            images = torch.stack([images, torch.randn(images.shape, generator=g)], dim=1)
        with torch.no_grad():
            first = images[:1].unsqueeze(1) if per_row else images[:1]
            features = model.get_image_features(pixel_values=first, **{k: v[:1] for k, v in sizes.items()})
        features = getattr(features, "pooler_output", features)
        features = features[0] if isinstance(features, (list, tuple)) else features
        per_image = features.reshape(-1, features.shape[-1]).shape[0]
        tokens = [per_image] * PIXEL_IMAGES
        if used and per_row:  # [rows, images, c, h, w], a row's missing images all zeros (dropped by the model)
            most = max(len(row) for row in rows)
            padded = torch.zeros(len(rows), most, *images.shape[1:])
            for r, held in enumerate(rows):
                for j, i in enumerate(held):
                    padded[r, j] = images[i]
            extra["pixel_values"] = padded
        elif used:
            extra["pixel_values"] = images[list(used)]
            extra.update({k: v[list(used)] for k, v in sizes.items()})
    ids, masks, seqs = [], [], []
    for held in rows:
        seq = text(3)
        for i in held:
            frame = [starts[0]] if style == "grid" else []
            seq += frame + [image_id] * tokens[i] + ([starts[1]] if style == "grid" else []) + text(2)
        seqs.append(seq)
    length = max(length, max(len(seq) for seq in seqs) + 2 * len(rows) + 4)  # images of many tokens: longer rows
    for r, seq in enumerate(seqs):
        seq = seq + text(length - len(seq) - 2 * r)
        fill = length - len(seq)
        ids.append([pad] * fill + seq if left else seq + [pad] * fill)
        masks.append([0] * fill + [1] * len(seq) if left else [1] * len(seq) + [0] * fill)
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(masks), **extra}
    inner = getattr(model, "model", model)
    for key in ("mm_token_type_ids", "token_type_ids"):  # image tokens marked 1 (Gemma 3: they see each other)
        if key in inspect.signature(inner.forward).parameters:
            batch[key] = (batch["input_ids"] == image_id).long()
    if labels:
        target = batch["input_ids"].clone()
        target[(batch["attention_mask"] == 0) | (target == image_id)] = -100
        batch["labels"] = target
    return batch


def _inputs(model, info: dict) -> dict:
    from .batches import pad_id

    return image_batch(model, pad=pad_id(model), left=info.get("attn") == "sdpa")


def _generate_inputs(model, info: dict) -> dict:
    from .batches import pad_id

    return image_batch(model, pad=pad_id(model), labels=False)  # prompts: left-padded, as generate needs


def _variants() -> dict:
    from .variants import (
        GENERATE_ERRORS,
        TRAIN_ERRORS,
        Variant,
        generate_patched,
        generate_reference,
        padded_patched,
        padded_reference,
    )

    return {
        "images": Variant("images", _inputs, padded_reference, padded_patched, TRAIN_ERRORS),
        "images-generate": Variant(
            "images-generate", _generate_inputs, generate_reference, generate_patched, GENERATE_ERRORS
        ),
    }


IMAGE_VARIANTS = _variants()
