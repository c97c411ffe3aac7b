"""The vision tower of a VLM under SP: each rank encodes 1/sp of the batch's images (models/forward/images.py)
against every rank encoding all of them (the replicated path, as verl runs it), at sp 1, 2 and 4.

A Qwen2.5-VL with a 4-block vision tower (width 128) and a 2-layer text model; a training step on 2 rows holding
8 images of 16 x 16 patches (64 tokens each after the 2 x 2 merge). Per rank: the patches its tower encodes, the
time of its tower's forward and backward, the step's time; and the loss of both paths (equal).

    python -m benchmarks.vision_shards            # -> benchmarks/results/vision_shards.json (~2 min, 2 CPU cores)
    python -m benchmarks.vision_shards --quick    # smaller, writes nothing
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tests.helpers.spawn import spawn

RESULTS = Path(__file__).parent / "results" / "vision_shards.json"


def _model(width: int):
    from examples.vlm_images import build_model  # its text model; a wider, deeper vision tower

    return build_model(
        depth=4, hidden_size=width, intermediate_size=2 * width, num_heads=4, fullatt_block_indexes=[3], window_size=32
    )


def _batch(images: int, side: int) -> dict:
    g = torch.Generator().manual_seed(0)
    tokens = side * side // 4
    per_row = images // 2
    rows = []
    for _ in range(2):
        ids = []
        for _ in range(per_row):
            ids += torch.randint(3, 250, (16,), generator=g).tolist() + [253] + [255] * tokens + [254]
        rows.append(ids + torch.randint(3, 250, (32,), generator=g).tolist())
    ids = torch.tensor(rows)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.masked_fill(ids >= 253, -100),
        "mm_token_type_ids": (ids == 255).long(),
        "pixel_values": torch.randn(images * side * side, 3 * 2 * 16, generator=g),
        "image_grid_thw": torch.tensor([[1, side, side]] * images),
    }


def _rank(sp: int, cut: bool, width: int, images: int, side: int, steps: int) -> dict:
    import torch.distributed as dist

    import seqpar_hf

    model = _model(width)
    batch = _batch(images, side)
    if sp > 1:
        seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=sp, mode="ulysses"))
        if not cut:
            for shards in seqpar_hf.models.patch.state_of(model).image_shards:
                shards.checked = False  # the replicated path: every rank encodes every image
    visual = model.model.visual
    seen = {"patches": 0, "forward": 0.0, "backward": 0.0}

    # inside the tower (its first and last modules): what this rank encodes, not the gather around it
    def pre(module, args):
        seen["t0"] = time.perf_counter()
        seen["patches"] = args[0].shape[0]

    def post(module, args, out):
        seen["forward"] += time.perf_counter() - seen["t0"]
        if out.requires_grad:
            out.register_hook(lambda g: seen.__setitem__("b0", time.perf_counter()))

    visual.patch_embed.register_forward_pre_hook(pre)
    visual.merger.register_forward_hook(post)
    visual.patch_embed.proj.register_full_backward_hook(lambda m, gi, go: seen.__setitem__("b1", time.perf_counter()))
    times, vis_f, vis_b, losses = [], [], [], []
    for step in range(steps + 1):
        seen["forward"] = 0.0
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        if sp > 1:
            dist.barrier()
        if step:  # the first: warm-up (and the cut's check)
            times.append(time.perf_counter() - start)
            vis_f.append(seen["forward"])
            vis_b.append(seen["b1"] - seen["b0"])
        losses.append(float(loss))
    return {
        "patches": seen["patches"],
        "step_s": statistics.median(times),
        "vision_forward_s": statistics.median(vis_f),
        "vision_backward_s": statistics.median(vis_b),
        "loss": losses[-1],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    width, images, side, steps = (32, 4, 8, 1) if args.quick else (128, 8, 16, 3)
    records = []
    for sp, cut in ((1, False), (2, False), (2, True), (4, False), (4, True)):
        per_rank = spawn(_rank, sp, sp, cut, width, images, side, steps, timeout=900)
        worst = max(per_rank, key=lambda r: r["vision_forward_s"] + r["vision_backward_s"])
        records.append(
            {
                "sp": sp,
                "path": "cut" if cut else ("one process" if sp == 1 else "replicated"),
                "patches_per_rank": max(r["patches"] for r in per_rank),
                "vision_fwd_bwd_s": worst["vision_forward_s"] + worst["vision_backward_s"],
                "step_s": max(r["step_s"] for r in per_rank),
                "loss": per_rank[0]["loss"],
            }
        )
    print("| sp | vision tower | patches per rank | tower fwd + bwd per rank (s) | step (s) | loss |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(
            f"| {r['sp']} | {r['path']} | {r['patches_per_rank']:,} | {r['vision_fwd_bwd_s']:.3f} | "
            f"{r['step_s']:.3f} | {r['loss']:.6f} |"
        )
    if not args.quick:
        meta = {"images": images, "patch_side": side, "width": width}
        RESULTS.write_text(json.dumps({**meta, "records": records}, indent=1))
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
