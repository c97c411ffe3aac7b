"""Call time of a relative position bias (the T5 family, proven at patch time: proof/relative_bias.py).

An owner's `compute_bias` would build a [1, h, s, s] bias from this rank's lengths with local positions:
wrong under a split, and [s, s] per head. In a sharded forward it returns a `RelativeBias` instead, which
the model passes along its layers as it would the tensor, and the sequence-parallel attention turns it into
by-distance values over the whole padded sequence (`table`), from the owner's own code, at each call (so that
gradient checkpointing's recompute builds its own). Outside a sharded forward (a decoding step, `sp_disabled`)
it is the original.
"""

from __future__ import annotations

import torch

from ..proof.relative_bias import by_distance
from .context import ForwardContext


class RelativeBias:
    """What an owner's compute_bias returns in a sharded forward: the owner's code and the device."""

    def __init__(self, source: BiasSource, device):
        self.source, self.device = source, device

    def table(self, ctx: ForwardContext, side: str) -> tuple[torch.Tensor, int]:
        """([h, 2S - 1] values by distance over `side`'s padded length S, the center S - 1)."""
        length = ctx.seqs[side].plan.padded
        return by_distance(self.source.original, length, self.device), length - 1


class BiasSource:
    """Installed as an owner's `compute_bias` (instance attribute; unpatch_model restores the method)."""

    def __init__(self, state, original):
        self.state, self.original = state, original

    def __call__(self, query_length, key_length, device=None, past_seen_tokens=0):
        state = self.state
        if state.detached or state.plain_depth or state.step is not None:  # not a sharded forward
            return self.original(query_length, key_length, device=device, past_seen_tokens=past_seen_tokens)
        return RelativeBias(self, device)
