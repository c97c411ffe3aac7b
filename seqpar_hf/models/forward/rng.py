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
from typing import Any

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


class _SkippableForward:
    """A layer's forward that returns its input when this forward's LayerDrop decision drops it. An
    object, not a closure, so `copy.deepcopy` of the model rebinds it to the copied layer."""

    def __init__(self, sync: LayerDropSync, key: tuple[int, int], forward):
        self.sync, self.key, self.forward = sync, key, forward
        self.__wrapped__ = forward

    def __call__(self, hidden_states, *args, **kwargs):
        if self.sync.skip.get(self.key, False):
            return hidden_states  # the layer is dropped: identity, as in the model's own loop
        return self.forward(hidden_states, *args, **kwargs)


class LayerDropSync:
    """Replaces the LayerDrop of `stacks` (modules with `layerdrop` and `layers`) by decisions that
    every rank of the group draws identically; reversible with `remove()`."""

    def __init__(self, stacks: list[nn.Module]):
        # Any: nn.Module types neither `layerdrop` nor `layers` (a ModuleList)
        self.stacks: list[Any] = [s for s in stacks if hasattr(s, "layerdrop")]
        self.skip: dict[tuple[int, int], bool] = {}
        self._wrapped: list[tuple[nn.Module, object]] = []  # (layer, its previous instance forward or None)
        for i, stack in enumerate(self.stacks):
            for j, layer in enumerate(stack.layers):
                self._wrapped.append((layer, layer.__dict__.get("forward")))
                layer.forward = _SkippableForward(self, (i, j), layer.forward)

    @contextlib.contextmanager
    def decide(self, training: bool):
        """Draw this forward's decisions from the shared stream; disable the model's own."""
        saved = [s.layerdrop for s in self.stacks]
        self.skip = {}
        try:
            for i, (stack, p) in enumerate(zip(self.stacks, saved)):
                if training and p > 0:
                    draws = torch.rand(len(stack.layers))  # shared stream: same on every rank
                    self.skip.update({(i, j): bool(u < p) for j, u in enumerate(draws)})
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
