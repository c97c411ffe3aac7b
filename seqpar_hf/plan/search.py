"""Which layouts to count for a number of ranks, which one to recommend, and the longest sequence that fits.

The recommendation is the fitting layout that should run fastest: no checkpointing before
checkpointing, the fewest ranks per sequence (least communication), Ulysses before ring, TP last.
"""

from __future__ import annotations

from . import checks
from .memory import Breakdown, Layout, Model, plan


def layouts(model: Model, gpus: int, offload: bool = False, tiled_mlp: bool = False) -> list[Layout]:
    """Every layout `plan` can count on `gpus` ranks: sp x tp dividing them, tp dividing the heads,
    Ulysses no wider than the heads, with and without checkpointing and the tiled loss; with `offload`
    also the checkpointed ones with their layer inputs in host memory, with `tiled_mlp` also a tiled MLP
    (not under TP, where seqpar_hf refuses it)."""
    checks.positive_int("gpus", gpus)
    out = []
    for tp in (1, 2, 4, 8):
        if gpus % tp or model.kv_heads % tp or model.heads % tp:
            continue
        for sp in (1, 2, 4, 8, 16, 32, 64):
            if sp * tp > gpus or gpus % (sp * tp):
                continue
            modes = ["ulysses", "ring"] if sp > 1 else ["ulysses"]
            for mode in modes:
                if mode == "ulysses" and (model.heads // tp) < sp:
                    continue  # Ulysses splits the heads: no more ranks than heads
                for checkpointing in (False, True):
                    for tiled in (False, True):
                        for off in (False, True) if offload and checkpointing else (False,):
                            for mlp in (False, True) if tiled_mlp else (False,):
                                out.append(Layout(sp, tp, mode, checkpointing, tiled, offload=off, tiled_mlp=mlp))
    return out


def recommend(rows: list[Breakdown], budget: float) -> Breakdown | None:
    """The fitting row that should run fastest, or None when none fits in `budget` bytes."""
    checks.positive_number("budget", budget)
    fitting = [r for r in rows if r.peak <= budget]
    if not fitting:
        return None
    # fastest first: no recompute, no offload, no MLP recompute, fewest ranks per sequence, Ulysses (fewest
    # bytes), no TP, then memory
    return min(
        fitting,
        key=lambda r: (
            r.layout.checkpointing,
            r.layout.offload,
            r.layout.tiled_mlp,
            r.layout.sp * r.layout.tp,
            r.layout.mode != "ulysses",
            r.layout.tp,
            r.peak,
        ),
    )


def best_per_group(rows: list[Breakdown], budget: float) -> list[Breakdown]:
    """Per sp x tp x mode: the fitting row with the least recompute and memory, else the smallest peak."""
    out = []
    for key in dict.fromkeys((r.layout.sp, r.layout.tp, r.layout.mode) for r in rows):
        group = [r for r in rows if (r.layout.sp, r.layout.tp, r.layout.mode) == key]
        fitting = [r for r in group if r.peak <= budget]
        out.append(
            min(fitting, key=lambda r: (r.layout.checkpointing, r.layout.offload, r.layout.tiled_mlp, r.peak))
            if fitting
            else min(group, key=lambda r: r.peak)
        )
    return out


def longest(model: Model, layout: Layout, budget: float, gpus: int, act_bytes: int = 4) -> int:
    """The longest sequence (a multiple of 64 x sp) whose predicted peak fits in `budget` bytes (0: none)."""
    checks.positive_number("budget", budget)
    unit = 64 * layout.sp
    lo, hi = 0, 1
    while plan(model, layout, hi * unit, gpus, act_bytes).peak <= budget and hi < 1 << 24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(model, layout, mid * unit, gpus, act_bytes).peak <= budget else (lo, mid)
    return lo * unit
