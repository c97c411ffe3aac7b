"""The entry point of sequence-parallel attention: Ulysses inside a group, ring across groups.

mode "ulysses" has no ring (ring_size 1), "ring" no Ulysses (ulysses_size 1), "hybrid" both: the
all-to-all gives each rank some heads over the sequence its Ulysses group holds, and the ring passes
K/V blocks between Ulysses groups for those heads (USP, Fang & Zhao 2024, arXiv 2405.07719).
"""

from __future__ import annotations

import torch

from ..parallel.layout import ParallelLayout
from . import kernels
from .heads import max_chunks
from .pattern import MISSING, Pattern
from .ring import RingPlan, ring_attention
from .scores import NONE, ScoreMods
from .ulysses import auto_chunks, ulysses_attention


def ring_plan(layout: ParallelLayout, pattern: Pattern, device) -> RingPlan:
    """This rank's ring plan for `pattern`, built once per forward."""
    if pattern.ring is MISSING:
        spec, ring = pattern.spec, layout.sizes.ring_size
        assert ring is not None  # a layout that attends is built (an auto layout never attends itself)
        q_index = spec.q.plan.ring_index(layout.ring_rank, device)  # [s_q / ring] global positions
        k_index = [spec.k.plan.ring_index(j, device) for j in range(ring)]
        pattern.ring = RingPlan.build(spec, layout.ring_group, layout.ring_ranks, layout.ring_rank, q_index, k_index)
    return pattern.ring


def attend(
    layout: ParallelLayout,
    pattern: Pattern,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    dropout: float,
    mods: ScoreMods = NONE,
) -> torch.Tensor:
    """q [b, h, s_q/sp, d], k [b, h_kv, s_k/sp, d], v [b, h_kv, s_k/sp, d_v] (this rank's tokens; v's width
    may differ from q/k's, as in multi-head latent attention) -> [b, h, s_q/sp, d_v]. `mods`: soft-capping
    and sinks (`scores.py`), for all h heads; they take the block kernels, which return the log-sum-exp
    (under Ulysses as a ring of one over the whole sequence)."""
    if layout.sizes.ring_size == 1 and not mods.active:

        def inner(q, k, v, kv_for_q, heads=None):
            return kernels.attention(q, k, v, pattern, scale, dropout, kv_for_q)
    else:
        if dropout > 0:
            what = (
                "ring attention"
                if layout.sizes.ring_size != 1
                else "attention with soft-capping, sinks or a relative position bias"
            )
            raise NotImplementedError(
                f"{what} under sequence parallelism does not support attention dropout (got {dropout}); set the "
                "model's attention dropout to 0 (attention_dropout in most configs; T5's is its dropout_rate, or "
                "each attention module's `dropout` attribute)" + (" or use mode='ulysses'" if not mods.active else "")
            )
        plan = ring_plan(layout, pattern, q.device)

        def inner(q, k, v, kv_for_q, heads=None):
            return ring_attention(q, k, v, plan, scale, kv_for_q, mods if heads is None else mods.heads(*heads))

    if layout.ulysses_size == 1:
        rep = q.shape[1] // k.shape[1]
        return inner(q, k, v, None if rep == 1 else tuple(i // rep for i in range(q.shape[1])))
    return ulysses_attention(
        q, k, v, layout.ulysses_group, layout.ulysses_rank, inner, head_chunks(layout, q, k, v, dropout)
    )


def head_chunks(layout: ParallelLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> int:
    """How many parts the Ulysses exchange goes in (the same on every rank: it depends on shapes only).
    Attention dropout keeps one, so that its random stream is the unchunked kernel's."""
    setting = layout.head_chunks
    if dropout > 0:
        return 1
    n = layout.ulysses_size
    assert n is not None  # a built layout (an auto layout never attends itself)
    if isinstance(setting, str):  # "auto" (check_head_chunks lets no other string through)
        return auto_chunks(q, k, v, n)
    return min(setting, max_chunks(q.shape[1], n))
