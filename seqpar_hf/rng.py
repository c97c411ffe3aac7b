"""Randomness under SP: dropout differs between shards, control flow (LayerDrop) agrees.

The ranks of an SP group start each step with the same RNG state (they are one data-parallel
replica). Inside a patched training forward each rank draws from a stream offset by its SP rank, so
its shard gets its own dropout masks; the shared stream advances by one draw per step, identically
on every rank. LayerDrop decides which layers run: if ranks decided differently, one would wait in
an all-to-all the other never enters. Those decisions are drawn up front from the shared stream,
and the model's own LayerDrop is switched off for the duration of the forward.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def per_rank_stream(sp_rank: int, device: torch.device):
    """Fork the RNG of the CPU (and of `device` if it is an accelerator), seeded by the shared
    stream plus `sp_rank`; the shared stream advances by exactly one draw."""
    seed = int(torch.randint(0, 2**62, ()))
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.default_generator.manual_seed(seed + sp_rank)
        if devices:
            torch.cuda.manual_seed(seed + sp_rank)
        yield


class LayerDropSync:
    """Replaces the LayerDrop of `stacks` (modules with `layerdrop` and `layers`) by decisions that
    every rank of the group draws identically; reversible with `remove()`."""

    def __init__(self, stacks: list[nn.Module]):
        self.stacks = [s for s in stacks if hasattr(s, "layerdrop") and hasattr(s, "layers")]
        self.skip: dict[int, bool] = {}
        self._wrapped: list[tuple[nn.Module, object]] = []  # (layer, its previous instance forward or None)
        for stack in self.stacks:
            for layer in stack.layers:
                self._wrapped.append((layer, layer.__dict__.get("forward")))
                layer.forward = self._wrap(layer, layer.forward)

    def _wrap(self, layer: nn.Module, forward):
        def forward_or_skip(hidden_states, *args, **kwargs):
            if self.skip.get(id(layer), False):
                return hidden_states  # the layer is dropped: identity, as in the model's own loop
            return forward(hidden_states, *args, **kwargs)
        forward_or_skip.__wrapped__ = forward
        return forward_or_skip

    @contextlib.contextmanager
    def decide(self, training: bool):
        """Draw this forward's decisions from the shared stream; disable the model's own."""
        saved = [s.layerdrop for s in self.stacks]
        self.skip = {}
        try:
            for stack, p in zip(self.stacks, saved):
                if training and p > 0:
                    draws = torch.rand(len(stack.layers))  # shared stream: same on every rank
                    self.skip.update({id(layer): bool(u < p) for layer, u in zip(stack.layers, draws)})
                stack.layerdrop = 0.0
            yield
        finally:
            for stack, p in zip(self.stacks, saved):
                stack.layerdrop = p
            self.skip = {}

    def remove(self):
        for layer, previous in self._wrapped:
            if previous is None:
                del layer.forward  # back to the class's forward
            else:
                layer.forward = previous
        self._wrapped = []
