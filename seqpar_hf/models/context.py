"""Per-forward metadata: built once by a sharded backbone forward, used by every layer of that forward.

The backbone forward builds a `ForwardContext` (shard plans, masks, positions) and hands it to the
layers through their keyword arguments, which transformers passes on to the attention function and
which gradient checkpointing keeps with the layer: a layer recomputed in backward sees its own
forward's context, never "the last forward's". Masks and ring plans are built lazily, once per
forward and attention pattern, and shared by all layers.
"""

from __future__ import annotations

import torch

from ..attention.masks import MaskSpec, SeqMeta, check_window
from ..attention.ring import RingPlan
from ..parallel.layout import ParallelLayout

CONTEXT_KWARG = "seqpar_ctx"  # the keyword argument that carries the context to the attention function


class ForwardContext:
    def __init__(self, layout: ParallelLayout, seqs: dict[str, SeqMeta], positions: dict[str, torch.Tensor],
                 full_positions: dict[str, torch.Tensor], local_outputs: bool, extra: dict | None = None):
        self.layout = layout
        self.seqs = seqs  # side -> what attention needs to know about that sequence
        self.positions = positions  # side -> [b or 1, s_loc] position ids of this rank's tokens
        self.full_positions = full_positions  # side -> [b or 1, S_pad] position ids of the whole sequence
        self.local_outputs = local_outputs  # the caller takes this rank's shard of the outputs (else gathered)
        self.extra = extra or {}  # side-specific inputs of position modules (e.g. full token ids)
        self.cache: dict = {}  # masks and ring plans of this forward

    def plan(self, side: str):
        return self.seqs[side].plan

    def spec(self, q_side: str, kv_side: str, causal: bool, window) -> MaskSpec:
        window = check_window(window, causal)
        key = ("spec", q_side, kv_side, causal, window)
        if key not in self.cache:
            self.cache[key] = MaskSpec(self.seqs[q_side], self.seqs[kv_side], causal, window)
        return self.cache[key]

    def ring_plan(self, spec: MaskSpec, device) -> RingPlan:
        key = ("ring", id(spec))
        if key not in self.cache:
            layout, ring = self.layout, self.layout.sizes.ring_size
            q_index = spec.q.plan.ring_index(layout.ring_rank, device)
            k_index = [spec.k.plan.ring_index(j, device) for j in range(ring)]
            self.cache[key] = RingPlan.build(spec, layout.ring_group, layout.ring_ranks, layout.ring_rank,
                                             q_index, k_index)
        return self.cache[key]
