"""Per-forward metadata: built once by a sharded backbone forward, used by every layer of that forward.

The backbone forward builds a `ForwardContext` (shard plans, masks, positions) and hands it to the
layers through their keyword arguments, which transformers passes on to the attention function and
which gradient checkpointing keeps with the layer: a layer recomputed in backward sees its own
forward's context, never "the last forward's". Each kind of attention layer gets one `Pattern`
(masks, document batches, ring plan built lazily, once per forward), shared by all its layers.
"""

from __future__ import annotations

import torch

from ...attention.masks import Chunks, MaskSpec, SeqMeta, check_window
from ...attention.pattern import Pattern
from ...parallel.layout import ParallelLayout

CONTEXT_KWARG = "seqpar_ctx"  # the keyword argument that carries the context to the attention function
# ... and the attribute of the shard's padding mask that carries it too: an attention-free backbone that passes
# its layers no keyword arguments but the mask (Mamba) still hands it to them, gradient checkpointing included
# (transformers keeps a checkpointed layer's keyword arguments, the mask object itself, for the recompute)
CONTEXT_ATTR = "_seqpar_ctx"


def carry(kwargs: dict, ctx) -> None:
    """Put `ctx` on the call's attention_mask (the shard's own [b, s_loc] mask tensor, made per forward)."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        setattr(mask, CONTEXT_ATTR, ctx)


def carried(kwargs: dict):
    """The context a call carries: its keyword argument, else its attention_mask's; None if neither."""
    ctx = kwargs.get(CONTEXT_KWARG)
    if ctx is None:
        ctx = getattr(kwargs.get("attention_mask"), CONTEXT_ATTR, None)
    return ctx


class ForwardContext:
    def __init__(
        self,
        layout: ParallelLayout,
        seqs: dict[str, SeqMeta],
        positions: dict[str, torch.Tensor],
        full_positions: dict[str, torch.Tensor],
        local_outputs: bool,
        ids: dict | None = None,
    ):
        self.layout = layout
        self.seqs = seqs  # side -> what attention needs to know about that sequence
        self.positions = positions  # side -> [b or 1, s_loc] position ids of this rank's tokens
        self.full_positions = full_positions  # side -> [b or 1, S_pad] position ids of the whole sequence
        self.local_outputs = local_outputs  # the caller takes this rank's shard of the outputs (else gathered)
        self.ids = ids or {}  # side -> [b, S_pad] full token ids, for padding-aware positions (M2M100)
        self.patterns: dict[tuple[str, str, bool, int | Chunks | None], Pattern] = {}

    def plan(self, side: str):
        return self.seqs[side].plan

    def pattern(self, q_side: str, kv_side: str, causal: bool, window, batch: int = 1, device=None) -> Pattern:
        """The pattern of attention from `q_side` queries to `kv_side` keys, one per kind per forward.
        `window`: a sliding window's size, or `Chunks` (each chunk a document of its own; self-attention)."""
        key = (q_side, kv_side, causal, check_window(window, causal))
        if key not in self.patterns:
            q, k = self.seqs[q_side], self.seqs[kv_side]
            self.patterns[key] = Pattern(MaskSpec.of(q, q if q_side == kv_side else k, causal, key[3], batch, device))
        return self.patterns[key]
