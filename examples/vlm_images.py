"""Train a tiny Qwen2.5-VL on rows of text and images with sequence parallelism.

Each row (256 tokens, holding 0 to 2 images) is split over an SP group; the vision tower encodes the
batch's images on every rank of the group, the text model runs sharded. Launch it from the repository root:

    torchrun --standalone --nproc_per_node 2 examples/vlm_images.py              # CPU: one SP group of 2
    torchrun --standalone --nproc_per_node 2 examples/vlm_images.py --sp_size 1  # the same rows without SP

The model comes from a config (no download) and the images are random pixels with the shapes Qwen2.5-VL's
processor gives: `pixel_values` [patches, 3 * 2 * 14 * 14 / ...] of every image of the batch, `image_grid_thw`
[images, 3], and `input_ids` holding one image token per 2 x 2 patches between the vision start and end ids.
"""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Trainer, TrainingArguments

from seqpar_hf import SequenceParallelArguments, SequenceParallelTrainer

VOCAB, IMAGE, START, END, PAD = 256, 255, 253, 254, 0
LENGTH = 256
PATCH, TEMPORAL, MERGE = 4, 2, 2


def build_model(seed: int = 0, **vision_sizes) -> Qwen2_5_VLForConditionalGeneration:
    """The tiny model; `vision_sizes` override its vision tower's (benchmarks/vision_shards.py: a wider one)."""
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL,
        spatial_merge_size=MERGE,
        out_hidden_size=64,
        fullatt_block_indexes=[1],
        window_size=16,
    )
    vision.update(vision_sizes)
    config = Qwen2_5_VLConfig(
        text_config={**text, "bos_token_id": 1, "eos_token_id": 2},
        vision_config=vision,
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        pad_token_id=PAD,
    )
    torch.manual_seed(seed)  # the same initial weights on every rank
    return Qwen2_5_VLForConditionalGeneration(config)


def synthetic_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows of counting text (learnable) with 0-2 images of 8 x 8 or 8 x 16 patches in them."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        count = int(torch.randint(0, 3, (1,), generator=g))
        grids = [(1, 8, 8 * int(torch.randint(1, 3, (1,), generator=g))) for _ in range(count)]
        ids: list[int] = []
        start = int(torch.randint(1, 200, (1,), generator=g))
        pixels = []
        for t, h, w in grids:
            ids += [(start + k) % 200 + 1 for k in range(8)] + [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]
            pixels.append(torch.randn(t * h * w, 3 * TEMPORAL * PATCH * PATCH, generator=g))
        ids += [(start + k) % 200 + 1 for k in range(LENGTH - len(ids) - int(torch.randint(0, 40, (1,), generator=g)))]
        rows.append({"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grids})
    return rows


def collate(rows: list[dict]) -> dict:
    """Right-padded ids, every image of the batch in one `pixel_values`, labels on the text tokens only."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [PAD] * (longest - len(r["input_ids"])) for r in rows])
    mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (longest - len(r["input_ids"])) for r in rows])
    labels = ids.masked_fill((mask == 0) | (ids == IMAGE) | (ids == START) | (ids == END), -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": (ids == IMAGE).long()}
    pixels = [p for r in rows for p in r["pixel_values"]]
    if pixels:
        batch["pixel_values"] = torch.cat(pixels)
        batch["image_grid_thw"] = torch.tensor([g for r in rows for g in r["image_grid_thw"]])
    return batch


def make_trainer(sp_size: int, max_steps: int = 8, output_dir: str = "runs/vlm_images", callbacks=None) -> Trainer:
    """sp_size 0: the plain transformers Trainer (one process); else SequenceParallelTrainer."""
    common = dict(
        output_dir=output_dir,
        max_steps=max_steps,
        learning_rate=2e-3,
        per_device_train_batch_size=4,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        remove_unused_columns=False,  # the collator reads the images
        use_cpu=True,
        seed=0,
    )
    args = TrainingArguments(**common) if sp_size == 0 else SequenceParallelArguments(sp_size=sp_size, **common)
    cls = Trainer if sp_size == 0 else SequenceParallelTrainer
    return cls(
        model=build_model(), args=args, train_dataset=synthetic_rows(64), data_collator=collate, callbacks=callbacks
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp_size", type=int, default=2, help="ranks that split each row (1: no SP)")
    parser.add_argument("--max_steps", type=int, default=8)
    args = parser.parse_args()
    make_trainer(args.sp_size, args.max_steps).train()


if __name__ == "__main__":
    main()
