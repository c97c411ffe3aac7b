"""`mode="auto"`: Ulysses, ring or hybrid (and its ring size), chosen from the model's heads and the
machine, the way axolotl-ringmaster's selector does, but by expected speed rather than by what is
possible: seqpar_hf's Ulysses also splits uneven heads and kv heads fewer than its ranks.

A layout is built before the model is known, so `ParallelLayout(mode="auto")` creates no Ulysses or
ring groups; `patch_model` calls `resolve` with the model's attention head counts. Every rank sends
its head counts and host name to every other (one small all-gather over the world): ranks that
patched different models, or ranks on hosts of different sizes, are refused on every rank before
any group exists. The choice is then the same pure function of the same numbers on every rank, and
is logged with its reason (parallel/announce.py). The auto layout itself is never changed: each model gets the
layout chosen for it (`ParallelLayout.resolved`, a new layout kept with the model's patch state), so one auto
layout can patch several models, each resolved on its own (models with the same choice share one resolved
layout).

The rule (`choose`), per TP rank (heads / tp of each attention kind):
- a Ulysses group of u ranks (u divides sp, u <= the fewest heads) must sit inside a node (u x tp
  ranks per node at most): its all-to-all needs the fast links; ring hops cross nodes and overlap
  with the kernel;
- with u ranks, the busiest one computes ceil(h / u) heads where the average is h / u: the layer
  takes ceil(h / u) u / h times as long (e.g. 12 heads over 8 ranks: 1.33);
- a ring costs RING_OVERHEAD on top (zigzag ring attention reaches ~90% of the unsplit kernel:
  ring-flash-attention on 8 H800; the hops themselves hide behind the kernel);
- kv heads fewer than u are replicated: more all-to-all bytes, no more compute; not counted.
The lowest cost wins; ties go to the larger Ulysses group (fewer ring hops).
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass

import torch.distributed as dist

RING_OVERHEAD = 1.1


@dataclass(frozen=True)
class Choice:
    mode: str
    ring_size: int | None
    reason: str


def _imbalance(heads: int, u: int) -> float:
    return math.ceil(heads / u) * u / heads


def choose(sp_size: int, heads: list[tuple[int, int]], ranks_per_node: int, tp_size: int = 1) -> Choice:
    """`heads`: (query heads, kv heads) of each kind of attention layer, whole model (not per TP rank)."""
    per_tp = sorted({(h // tp_size, g // tp_size) for h, g in heads})
    fewest = min(h for h, _ in per_tp)
    node_cap = max(ranks_per_node // tp_size, 1)
    best: tuple[float, int] | None = None
    seen: list[str] = []
    for u in (d for d in range(1, sp_size + 1) if sp_size % d == 0):
        ring = sp_size // u
        if u > fewest:
            seen.append(f"Ulysses {u}: fewer heads ({fewest}) than ranks")
            continue
        if u > node_cap:
            seen.append(f"Ulysses {u}: wider than a node ({node_cap} ranks per TP group)")
            continue
        cost = max(_imbalance(h, u) for h, _ in per_tp) * (RING_OVERHEAD if ring > 1 else 1.0)
        seen.append(f"Ulysses {u} x ring {ring}: {cost:.2f}")
        if best is None or cost <= best[0] + 1e-9:  # equal cost: the larger u, seen later
            best = (cost, u)
    assert best is not None  # u = 1 always fits
    cost, u = best
    ring = sp_size // u
    mode = "ulysses" if ring == 1 else "ring" if u == 1 else "hybrid"
    shown = ", ".join(f"{h} heads / {g} kv" for h, g in per_tp)
    reason = (
        f"sp={sp_size}, {shown} per TP rank, {ranks_per_node} ranks per node; estimated time over the balanced "
        f"kernel's (busiest rank's heads / average, x{RING_OVERHEAD} with a ring): {'; '.join(seen)}"
    )
    return Choice(mode, None if mode != "hybrid" else ring, reason)


def _gather(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def resolve(layout, heads: list[tuple[int, int]]):
    """The layout a model with these attention heads runs on: `layout` itself unless its mode is "auto", else
    the layout chosen for them (a new one; collective over the world: every rank, the same model)."""
    if layout.mode != "auto":
        return layout
    mine = (socket.gethostname(), sorted(set(heads)))
    everyone = _gather(mine)  # the same list on every rank: every rank takes the same branch below
    if any(h != mine[1] for _, h in everyone) or any(h != everyone[0][1] for _, h in everyone):
        kinds: dict[str, list[int]] = {}
        for r, (_, h) in enumerate(everyone):
            kinds.setdefault(str(h), []).append(r)
        seen = "; ".join(f"ranks {ranks[:8]}: (heads, kv heads) {h}" for h, ranks in kinds.items())
        raise ValueError(
            f"mode='auto': the ranks patched models with different attention heads ({seen}); every rank "
            "must patch the same model, or give the layout an explicit mode"
        )
    per_host: dict[str, int] = {}
    for host, _ in everyone:
        per_host[host] = per_host.get(host, 0) + 1
    choice = choose(layout.sp_size, list(heads), min(per_host.values()), layout.tp_size)
    resolved = layout.resolved(choice)
    return resolved
