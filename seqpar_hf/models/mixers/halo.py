"""A mixer whose only reach along the sequence is a short causal convolution (LFM2's gated short convolutions),
split along the sequence: each rank runs the module on its own tokens, and the convolution gets, before each
run of consecutive tokens the rank holds, the k - 1 inputs that precede it (its halo) from the ranks holding
them. Nothing of the mixer is whole on any rank: its activations are 1/sp, as the attention layers'.

The halo: every rank contributes the last k - 1 convolution inputs of each of its runs (a few columns), one
all-gather, and each run takes the columns at the k - 1 global positions before its start (zeros before the
sequence start, as the convolution's own padding). Any shard plan works (contiguous, zigzag, hybrid): a run
shorter than k - 1 is all edge, so every column a halo needs was sent. The backward sums the gathered columns'
gradients over the group and each rank keeps its own.

Where the convolution is: the depthwise `nn.Conv1d` child with k - 1 padding, whose weight the module's code
hands `torch.nn.functional.conv1d` (directly, or through the module's own call); that call is intercepted
(a `TorchFunctionMode` for the module's forward). A forward in which it is not seen (a fused CUDA kernel,
causal-conv1d, computed it without the halo) is thrown away and the mixer runs whole from then on, with a
warning (every rank takes the same path: no collective ran). At `patch_model` the split is proven
on a padded random batch for contiguous and zigzag shards of every sp: the shards' outputs, run one by one in one
process with the halos their neighbours give, are the module's own output at their tokens; else the mixer runs
as before (split by heads or whole). Generation's prompt forward (the cache keeps the whole sequence's last
inputs) and a forward given a cache run it whole.
"""

from __future__ import annotations

import copy
import types
import warnings
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...parallel.sharding import ShardPlan
from ..forward.context import CONTEXT_KWARG, ForwardContext
from .gathered import GatheredMixer

CACHE_KWARGS = ("cache", "past_key_values", "cache_params")


def depthwise_conv(module: nn.Module) -> nn.Conv1d | None:
    """The one causal depthwise convolution inside `module` (k - 1 padding, stride and dilation 1), or None."""
    convs = [
        m
        for m in module.modules()
        if isinstance(m, nn.Conv1d)
        and m.groups == m.in_channels == m.out_channels
        and m.stride == (1,)
        and m.dilation == (1,)
        and m.padding == (m.kernel_size[0] - 1,)
    ]
    return convs[0] if len(convs) == 1 else None


def runs(plan: ShardPlan, rank: int) -> list[tuple[int, int, int]]:
    """(local start, length, global start) of each run of consecutive global positions `rank` holds."""
    idx = plan.global_index(rank).tolist()
    out, start = [], 0
    for i in range(1, len(idx) + 1):
        if i == len(idx) or idx[i] != idx[i - 1] + 1:
            out.append((start, i - start, idx[start]))
            start = i
    return out


class Halos:
    """The column plan of one shard plan and kernel size: which local columns each rank sends (its runs' last
    k - 1, padded to one width), and where in the gathered columns each of this rank's runs finds its halo."""

    def __init__(self, plan: ShardPlan, rank: int, k: int, device):
        self.k, self.rank, self.runs = k, rank, runs(plan, rank)
        sends, positions = [], {}
        width = max(len(runs(plan, r)) for r in range(plan.sp_size)) * (k - 1)
        for r in range(plan.sp_size):
            cols = [c for a, n, _ in runs(plan, r) for c in range(max(a + n - (k - 1), a), a + n)]
            glob = plan.global_index(r).tolist()
            for j, c in enumerate(cols):
                positions[glob[c]] = r * width + j
            sends.append(cols + [0] * (width - len(cols)))
        zero = plan.sp_size * width  # a column of zeros appended after the gathered ones
        self.width = width
        self.send = torch.tensor(sends[rank], dtype=torch.long, device=device)
        self.take = torch.tensor(
            [
                [positions.get(g - d, zero) if g - d >= 0 else zero for d in range(k - 1, 0, -1)]
                for _, _, g in self.runs
            ],
            dtype=torch.long,
            device=device,
        )  # [runs, k - 1]

    def halos(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """`gathered` [b, C, sp * width] -> each run's halo [b, C, k - 1]."""
        padded = F.pad(gathered, (0, 1))
        return [padded.index_select(-1, row) for row in self.take]


class _AllGatherColumns(torch.autograd.Function):
    """[b, C, w] on each rank -> [b, C, sp * w] in rank order; the backward sums the gradient over the group and
    keeps this rank's columns."""

    @staticmethod
    def forward(ctx, x, group, rank):
        ctx.group, ctx.rank, ctx.width = group, rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None, None


def _shares_storage(t, weight: torch.Tensor) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.numel() == weight.numel()
        and t.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    )


class ConvWithHalo(TorchFunctionMode):
    """Inside the module's forward: the convolution with `conv`'s weight runs on each run of this rank's tokens
    with its halo prepended; it returns what the padded convolution would, the causal outputs first (the
    module keeps the first s of them)."""

    def __init__(self, conv: nn.Conv1d, halos: Halos, gather):
        super().__init__()
        self.weight, self.plan, self.gather, self.seen = conv.weight, halos, gather, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if func is not F.conv1d or not _shares_storage(weight, self.weight):
            return func(*args, **kwargs)
        self.seen += 1
        x, bias = args[0], args[2] if len(args) > 2 else kwargs.get("bias")
        groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
        k = self.plan.k
        edges = x.index_select(-1, self.plan.send)
        gathered = self.gather(edges)
        outs = [
            func(torch.cat([halo.to(x.dtype), x.narrow(-1, a, n)], -1), weight, bias, 1, 0, 1, groups)
            for (a, n, _), halo in zip(self.plan.runs, self.plan.halos(gathered))
        ]
        return F.pad(torch.cat(outs, -1), (0, k - 1))  # the module keeps [:s]: the padded call's causal part


class HaloMixer(GatheredMixer):
    """`module.forward` of a mixer proven to split along the sequence with a convolution halo."""

    def __init__(self, state, module: nn.Module, original, side: str, holder, conv: nn.Conv1d):
        super().__init__(state, original, side, holder)
        self.module, self.conv = module, conv
        self._halos: dict = {}
        self.whole = False  # set when a fused kernel is seen computing the convolution: whole from then on

    def __call__(self, *args, **kwargs):
        ctx = kwargs.get(CONTEXT_KWARG) or self.holder.ctx
        if self.state.detached or not isinstance(ctx, ForwardContext) or self.side not in ctx.seqs:
            return self.step(ctx, args, {k: v for k, v in kwargs.items() if k != CONTEXT_KWARG})
        if self.whole or self.state.decoding is not None or any(kwargs.get(k) is not None for k in CACHE_KWARGS):
            return super().__call__(*args, **kwargs)  # the cache takes the whole sequence's last inputs
        layout, plan = ctx.layout, ctx.plan(self.side)
        key = (plan.length, plan.padded, plan.zigzag, plan.ring_size)
        x = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        if key not in self._halos:
            self._halos = {key: Halos(plan, layout.sp_rank, self.conv.kernel_size[0], x.device)}
        halos = self._halos[key]
        group, rank = layout.sp_group, layout.sp_rank
        mode = ConvWithHalo(self.conv, halos, lambda e: _AllGatherColumns.apply(e, group, rank))
        with mode:
            out = self.original(*args, **{k: v for k, v in kwargs.items() if k != CONTEXT_KWARG})
        if mode.seen == 0:  # a fused kernel (causal-conv1d on CUDA) ran it without the halo: every rank alike
            if not self.whole:
                self.whole = True
                warnings.warn(
                    f"seqpar_hf: {type(self.module).__name__}'s convolution ran in a fused kernel, not through "
                    "torch.nn.functional.conv1d: it runs on the whole sequence on every rank instead of with a halo",
                    stacklevel=2,
                )
            return super().__call__(*args, **kwargs)
        if mode.seen != 1:
            raise RuntimeError(
                f"seqpar_hf: {type(self.module).__name__} called its convolution {mode.seen} times in one forward; "
                "the halo was proven for one call"
            )
        return out


def prove(module: nn.Module, original, conv: nn.Conv1d, n: int) -> str | None:
    """None when, for contiguous and zigzag shards over `n` ranks, each shard's output (its halo from its
    neighbours' conv inputs) is the module's own output at its tokens, on a random batch (two rows, the second
    left-padded); else why not."""
    width = _width(module)
    if width is None:
        return "has no input width read here"
    # in float64 on a copy: a scan's reach into the previous shard can be small at initialisation, below an fp32
    # tolerance; in float64 only rounding is
    path = next(n for n, m in module.named_modules() if m is conv)
    module = copy.deepcopy(module).double()
    original = types.MethodType(getattr(original, "__func__", type(module).forward), module)
    conv = cast(nn.Conv1d, module.get_submodule(path) if path else module)
    p = conv.weight
    g = torch.Generator().manual_seed(0)
    length = 4 * n + 3
    x = torch.randn(2, length, width, generator=g, dtype=torch.float64).to(p.device, p.dtype)
    mask = torch.ones(2, length, dtype=torch.long, device=p.device)
    mask[1, :3] = 0
    k = conv.kernel_size[0]
    try:
        with torch.no_grad():
            want = original(x, attention_mask=mask)
            for zigzag in (False, True):
                plans = [ShardPlan.build(length, n, r, ring_size=n, zigzag=zigzag) for r in range(n)]
                edges: list = [None] * n  # first pass: each shard's sent columns
                for final in (False, True):
                    for r, plan in enumerate(plans):
                        halos = Halos(plan, r, k, p.device)
                        collect = _Collect(edges, r, final)
                        with ConvWithHalo(conv, halos, collect) as mode:
                            got = original(plan.pad_and_shard(x, 0.0), attention_mask=plan.pad_and_shard(mask, 0))
                        if mode.seen != 1:
                            return f"calls its convolution {mode.seen} times through torch.nn.functional.conv1d"
                        if final:
                            ref = plan.pad_and_shard(want, 0.0)
                            real = plan.global_index(r) < length
                            err = _relative(got[:, real], ref[:, real], want)
                            if err > 1e-9:
                                return f"its shards with their halos are not its output (relative error {err:.1e})"
    except Exception as exc:  # noqa: BLE001 - a split that does not apply: the mixer runs as before
        return (
            f"its shards with halos fail ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
        )
    return None


class _Collect:
    """The proof's stand-in for the all-gather: the first pass records each shard's columns, the second hands
    every shard all of them."""

    def __init__(self, edges: list, rank: int, final: bool):
        self.edges, self.rank, self.final = edges, rank, final

    def __call__(self, e: torch.Tensor) -> torch.Tensor:
        if not self.final:
            self.edges[self.rank] = e
            return torch.zeros_like(e).repeat(1, 1, len(self.edges))
        return torch.cat(self.edges, -1)


def _width(module: nn.Module) -> int | None:
    out = dict(module.named_children()).get("out_proj") or dict(module.named_children()).get("o_proj")
    if isinstance(out, nn.Linear):
        return int(out.out_features)
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return int(linears[0].in_features) if linears else None


def _relative(got: torch.Tensor, ref: torch.Tensor, whole: torch.Tensor) -> float:
    scale = whole.double().abs().max().clamp(min=1e-30)
    return float((got.double() - ref.double()).abs().max() / scale)
