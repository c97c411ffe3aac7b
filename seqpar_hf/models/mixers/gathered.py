"""A token mixer run on the whole sequence: the module's own forward on every rank of the SP group, on the
group's full inputs (all-gathered), each rank keeping its own tokens of the output.

Exact for any module whose output is a function of its inputs along the sequence (a causal convolution, a
scan, a linear-attention recurrence): it computes what it computes unpatched. The price is that its own
activations (and compute) are those of the full sequence on every rank; the layers around it stay sharded.
The backward reduce-scatters each rank's gradient of the gathered inputs (`comm.gather_for_replica`).

What the module is given, rebuilt for the full sequence:
- every tensor argument laid out [batch, s_loc, ...] along this side's shard: gathered;
- `attention_mask`: the full sequence's padding mask (the unpatched model passes it, or None where it has no
  padding; a mask of ones and None agree wherever the dry run checked them), whatever the shard was given;
- `position_ids`: the full sequence's positions; `cache_position`: 0..S-1.
The dry run (models/proof/probe.py) proves the rebuilt call reproduces the unpatched module's outputs at
every rank's tokens before the model is patched.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ...parallel.comm import gather_for_replica
from ..forward.context import CONTEXT_KWARG, ForwardContext, carried


def _full_mask(ctx: ForwardContext, side: str, like) -> torch.Tensor | None:
    meta = ctx.seqs[side]
    if meta.valid is None:
        return None
    full = meta.valid.narrow(1, 0, meta.plan.length)
    return full.to(like.dtype) if isinstance(like, torch.Tensor) else full.long()


def full_call(ctx: ForwardContext, side: str, params: set, args: tuple, kwargs: dict, gather) -> tuple[tuple, dict]:
    """The call of the module on the full sequence that corresponds to this shard's call; `gather(path, x)`
    returns the full sequence of a sharded tensor (a collective, or the dry run's record)."""
    plan = ctx.plan(side)
    local, length = plan.local_length, plan.length
    kwargs = {k: v for k, v in kwargs.items() if k != CONTEXT_KWARG}

    def rebuild(path: str, value):
        if isinstance(value, torch.Tensor):
            if value.dim() >= 2 and value.shape[1] == local:
                return gather(path, value)
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(rebuild(f"{path}.{i}", v) for i, v in enumerate(value))
        return value

    args = tuple(rebuild(f"args.{i}", a) for i, a in enumerate(args))
    out: dict = {}
    for key, value in kwargs.items():
        if key == "attention_mask":
            continue
        if key == "position_ids" and isinstance(value, torch.Tensor):
            out[key] = ctx.full_positions[side].narrow(-1, 0, length)
        elif key == "cache_position" and isinstance(value, torch.Tensor) and value.dim() == 1:
            out[key] = torch.arange(length, device=value.device)
        else:
            out[key] = rebuild(f"kwargs.{key}", value)
    if "attention_mask" in params or "attention_mask" in kwargs:
        out["attention_mask"] = _full_mask(ctx, side, kwargs.get("attention_mask"))
    return args, out


def local_output(ctx: ForwardContext, side: str, output):
    """This rank's tokens of the module's full-sequence output (tensors [batch, S, ...]; tuples of them)."""
    plan = ctx.plan(side)
    if isinstance(output, torch.Tensor):
        return plan.pad_and_shard(output, 0.0) if output.dim() >= 2 and output.shape[1] == plan.length else output
    if isinstance(output, tuple):
        return type(output)(local_output(ctx, side, o) for o in output)
    return output


class ContextHolder:
    """The forward context of the layer a mixer runs in, for mixers their layer calls without its keyword
    arguments (Jamba; Mamba's layers, given it on their attention_mask): set by a pre-hook on each module around
    the mixer that receives it, so a layer
    recomputed by gradient checkpointing sets its own forward's context again; cleared when the backbone
    starts a forward (a forward without sequence parallelism passes none)."""

    def __init__(self):
        self.ctx: ForwardContext | None = None

    def clear(self, module, args, kwargs):
        self.ctx = None

    def take(self, module, args, kwargs):
        ctx = carried(kwargs)
        if ctx is not None:
            self.ctx = ctx
            _Rebinding.wrap(module, self)

    def __getstate__(self):
        return {"ctx": None}


class _Rebinding:
    """A layer's `_gradient_checkpointing_func` that sets its holders' context again when the layer is recomputed.

    transformers 5.25 checkpoints a layer's `forward`, not its `__call__`: the recompute in backward runs no
    pre-hook of the layer, so without this a mixer its layer calls without the context would read the last
    forward's (two forwards before one backward: the first one's recompute with the second's shards and masks).
    """

    def __init__(self, func):
        self.func, self.holders = func, []

    @staticmethod
    def wrap(module, holder: ContextHolder) -> None:
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None:
            return
        if not isinstance(func, _Rebinding):
            func = module._gradient_checkpointing_func = _Rebinding(func)
        if not any(h is holder for h in func.holders):
            func.holders.append(holder)

    def __call__(self, function, *args, **kwargs):
        bound = [(h, h.ctx) for h in self.holders]  # this forward's, taken by the layer's pre-hooks just before

        def run(*a, **k):
            for holder, ctx in bound:
                holder.ctx = ctx
            return function(*a, **k)

        return self.func(run, *args, **kwargs)

    @staticmethod
    def unwrap(module) -> None:
        func = module.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, _Rebinding):
            module._gradient_checkpointing_func = func.func


class _Unwrap:
    def __init__(self, module):
        self.module = module

    def remove(self):
        _Rebinding.unwrap(self.module)


class GatheredMixer:
    """`module.forward` of a mixer proven to need the whole sequence: gather, run, keep this rank's tokens."""

    def __init__(self, state, original, side: str, holder: ContextHolder):
        self.state, self.original, self.side, self.holder = state, original, side, holder
        self.params = set(inspect.signature(original).parameters)

    def __call__(self, *args, **kwargs):
        ctx = carried(kwargs) or self.holder.ctx
        if self.state.detached or not isinstance(ctx, ForwardContext) or self.side not in ctx.seqs:
            # no SP, or a decoding step (its tokens replicated): the module as it is, on its cached state
            return self.step(ctx, args, {k: v for k, v in kwargs.items() if k != CONTEXT_KWARG})
        plan, group = ctx.plan(self.side), ctx.layout.sp_group
        full_args, full_kwargs = full_call(
            ctx, self.side, self.params, args, kwargs, lambda path, x: gather_for_replica(x, plan, group)
        )
        return local_output(ctx, self.side, self.original(*full_args, **full_kwargs))

    def step(self, ctx, args, kwargs):
        return self.original(*args, **kwargs)


def install(state, module: nn.Module, side: str, backbone: nn.Module, path: str, make=None) -> list:
    """Wrap `module` (at `path` in the backbone) in `make(state, forward, side, holder)` (GatheredMixer); the
    handles to undo it (unpatch_model, the dry run)."""
    holder = ContextHolder()
    handles: list = [backbone.register_forward_pre_hook(holder.clear, with_kwargs=True)]
    parts = path.split(".")
    for i in range(1, len(parts)):
        around = backbone.get_submodule(".".join(parts[:i]))
        handles += [around.register_forward_pre_hook(holder.take, with_kwargs=True), _Unwrap(around)]
    wrapper = (make or GatheredMixer)(state, module.forward, side, holder)
    return handles + [_Restore(module, module.__dict__.get("forward"), wrapper)]


class _Restore:
    """Installs the wrapper as `module.forward`; `remove()` puts back what was there."""

    def __init__(self, module: nn.Module, previous, wrapper):
        self.module, self.previous, self.wrapper = module, previous, wrapper
        module.forward = wrapper

    def remove(self):
        if self.module.__dict__.get("forward") is self.wrapper:
            if self.previous is None:
                del self.module.__dict__["forward"]
            else:
                self.module.forward = self.previous
