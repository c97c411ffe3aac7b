"""Which token mixers the dry run may run whole (models/mixers/gathered.py), and its stand-in for them.

A module the shard runs name as mixing tokens outside attention is run on the full sequence when it
- is neither the backbone nor holds an attention call (that attention must stay sharded);
- mixes by a convolution, a scan or a recurrence, not by a softmax over the sequence (attention written by
  hand would hold [S, S] scores on every rank: refused, as the issue of doing it right is the model's);
- is called with this side's hidden states [batch, s_loc, ...] and tensor parallelism is off;
and the shard runs, with every module of its class run that way, then agree with the full run at every
token: the wrapper's rebuilt call (`gathered.full_call`) is what is proven, fed with the full run's own
inputs of the same call in place of the all-gather.
"""

from __future__ import annotations

import torch
from torch import nn

from ..forward.context import carried
from ..mixers import gathered

REFUSED_OPS = ("softmax", "selection", "scan-tokens", "selection-tokens", "softmax-tokens")


def why_not(backbone: nn.Module, name: str, attention: set | frozenset, ops: dict, clean: set, tp: int) -> str | None:
    """Why the culprit at `name` (backbone-relative) cannot be run whole; None if it can."""
    if not name:
        return "is the backbone itself"
    if any(a == name or a.startswith(name + ".") for a in attention):
        return "holds an attention call"
    seen: set = set()
    for key, value in ops.items():
        if key == name or (key.startswith(name + ".") and key not in clean):
            seen |= value
    if seen & set(REFUSED_OPS):
        return "mixes by a softmax or a selection over the sequence"
    if tp > 1:
        return "would run whole under tensor parallelism, which shards its weights"
    return None


def side_of(calls: list, lengths: dict) -> str | None:
    """The side (sequence) of the module's first hidden-states-like input in the shard run's records."""
    for call in calls:
        for _, fp in sorted(call.get("in", {}).items()):
            if fp.side is not None:
                return fp.side
    return None


def _flatten(obj, path: str, out: dict) -> dict:
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _flatten(v, f"{path}.{i}", out)
    return out


class Capture:
    """Pre-hooks on the mixers to run whole: each call's full-sequence inputs, by the wrapper's paths."""

    def __init__(self, modules: dict):
        self.calls: dict[str, list[dict]] = {name: [] for name in modules}
        self.handles = [m.register_forward_pre_hook(self._hook(name), with_kwargs=True) for name, m in modules.items()]

    def _hook(self, name: str):
        def hook(module, args, kwargs):
            record: dict = {}
            for i, a in enumerate(args):
                _flatten(a, f"args.{i}", record)
            for k, v in kwargs.items():
                _flatten(v, f"kwargs.{k}", record)
            self.calls[name].append({k: v.detach().clone() for k, v in record.items()})

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


class NoContext(RuntimeError):
    """The forward context (the shard plans) cannot reach the mixer: the model calls its layers without
    keyword arguments nor the shard's attention_mask (Mamba's layers pass the mask: they get it there)."""


class Replayed(gathered.GatheredMixer):
    """The dry run's GatheredMixer: the all-gather's result is the full run's input of the same call."""

    def __init__(self, state, original, side, holder, calls: list):
        super().__init__(state, original, side, holder)
        self.calls, self.index = calls, 0

    def __call__(self, *args, **kwargs):
        ctx = carried(kwargs) or self.holder.ctx
        if ctx is None or self.side not in ctx.seqs:
            raise NoContext("its layer passes it neither keyword arguments nor the shard's attention_mask")
        record = self.calls[self.index] if self.index < len(self.calls) else {}
        self.index += 1

        def gather(path: str, x: torch.Tensor) -> torch.Tensor:
            if path not in record:
                raise RuntimeError(f"the full run passed no {path} of this shape")
            return record[path]

        full_args, full_kwargs = gathered.full_call(ctx, self.side, self.params, args, kwargs, gather)
        return gathered.local_output(ctx, self.side, self.original(*full_args, **full_kwargs))


def install_replayed(backbone: nn.Module, sides: dict, captured: Capture) -> list:
    """Install `Replayed` on each module in `sides` (path -> side); the handles to undo it."""
    handles: list = []
    for name, side in sides.items():
        module = backbone.get_submodule(name)
        calls = captured.calls[name]
        make = lambda state, original, s, holder, calls=calls: Replayed(state, original, s, holder, calls)
        handles += gathered.install(_NO_STATE, module, side, backbone, name, make)
    return handles


class _State:
    detached = False


_NO_STATE = _State()


def same_class(backbone: nn.Module, name: str) -> list[str]:
    """Every module of the backbone of the culprit's class (the model's other layers of that kind)."""
    kind = type(backbone.get_submodule(name))
    return [n for n, m in backbone.named_modules() if type(m) is kind and n]
