"""A token mixer split by heads: each rank of the SP group runs the module's own forward on the whole sequence
for its own heads only (a gated DeltaNet's key-head groups, a Mamba2 mixer's head groups, a short convolution's
channels), and the ranks' output projections are summed at each rank's tokens.

The layer's input is all-gathered (as for a mixer run whole, `gathered.py`); then, in place of the full
module, a head slice of it runs: every parameter indexed to this rank's key heads (the value heads, gates,
decay, convolution channels and output-projection columns that belong to them), the module's head counts set
to the slice's, and the same forward code run on it. What a head group computes depends on no other head, and
the output projection is a sum over heads, so the group's sum of the slices' outputs is the module's output:
one reduce-scatter returns it to the ranks' tokens (`comm.sum_to_shard`; its backward all-gathers). Each rank
then holds the activations of 1/sp of the heads, and does 1/sp of the mixer's work.

Which parameter rows belong to which head is read off the module's structure (three layouts: the fused
`in_proj_qkvz` / `in_proj_ba` of Qwen3-Next, the separate `in_proj_qkv` / `z` / `b` / `a` of Qwen3.5 and the models
built like it, and Mamba2's `in_proj` of z, x, B, C, dt split by head group), and proven at `patch_model` for the
layout's head ranges: the slices' outputs, summed, must be the module's own on a random batch with padding. A module
neither layout covers, or whose proof fails, or with fewer key heads than ranks, runs whole (`gathered.py`) and the
reason is logged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from ...parallel.comm import gather_for_replica, group_size, group_sum, sum_to_shard
from ..forward.context import CONTEXT_KWARG, ForwardContext, carried
from .gathered import ContextHolder, full_call

_SHAPE = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
_FUSED = {"in_proj_qkvz", "in_proj_ba", "conv1d", "out_proj"}
_SEPARATE = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "out_proj"}
_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj", "conv1d"}  # OLMo-hybrid


@dataclass(frozen=True)
class HeadLayout:
    """The head structure of a gated DeltaNet: key heads, value heads per key head, head widths, layout.
    The ranks split its `units` (key heads) into contiguous ranges."""

    fused: bool
    k_heads: int
    ratio: int
    dk: int
    dv: int
    projections: bool = False  # one projection per input (q_proj ... g_proj, o_proj), as OLMo-hybrid's

    @property
    def units(self) -> int:
        return self.k_heads

    def rows(self, name: str, k0: int, k1: int) -> tuple[int, torch.Tensor] | None:
        """(dim, indices) of parameter `name` that belong to key heads [k0, k1); None: shared by all heads."""
        r, dk, dv, hk = self.ratio, self.dk, self.dv, self.k_heads
        span = lambda start, width: torch.arange(start + k0 * width, start + k1 * width)
        qkv = torch.cat([span(0, dk), span(hk * dk, dk), span(2 * hk * dk, r * dv)])
        table = {
            "conv1d.weight": (0, qkv),
            "conv1d.bias": (0, qkv),
            "dt_bias": (0, span(0, r)),
            "A_log": (0, span(0, r)),
            "out_proj.weight": (1, span(0, r * dv)),
        }
        if self.projections:
            del table["out_proj.weight"]
            table.update(
                {
                    "q_proj.weight": (0, span(0, dk)),
                    "k_proj.weight": (0, span(0, dk)),
                    "v_proj.weight": (0, span(0, r * dv)),
                    "g_proj.weight": (0, span(0, r * dv)),
                    "a_proj.weight": (0, span(0, r)),
                    "b_proj.weight": (0, span(0, r)),
                    "o_proj.weight": (1, span(0, r * dv)),
                }
            )
        elif self.fused:  # one row block per key head: q, k, then its value heads' v and z (b, a likewise)
            table["in_proj_qkvz.weight"] = (0, span(0, 2 * dk + 2 * r * dv))
            table["in_proj_ba.weight"] = (0, span(0, 2 * r))
        else:
            table["in_proj_qkv.weight"] = (0, qkv)
            table["in_proj_z.weight"] = (0, span(0, r * dv))
            table["in_proj_b.weight"] = (0, span(0, r))
            table["in_proj_a.weight"] = (0, span(0, r))
        return table.get(name)

    def attributes(self, k0: int, k1: int) -> dict:
        k, v = k1 - k0, (k1 - k0) * self.ratio
        return {
            "num_k_heads": k,
            "num_v_heads": v,
            "key_dim": k * self.dk,
            "value_dim": v * self.dv,
            "conv_dim": 2 * k * self.dk + v * self.dv,
        }


@dataclass(frozen=True)
class SsdLayout:
    """The head structure of a Mamba2 (SSD) mixer: `groups` groups of B / C state projections, `per_group`
    heads of width `dim` each, state size `state`. The ranks split its groups (the gated norm normalises
    over a group's channels, so a rank holds whole groups)."""

    groups: int
    per_group: int
    dim: int
    state: int
    by_heads: bool = False  # fewer groups than ranks: each rank some heads of one group, the norm's sums all-reduced

    @property
    def units(self) -> int:
        return self.groups * self.per_group if self.by_heads else self.groups

    def _span(self, u0: int, u1: int) -> tuple[int, int, int, int]:
        """(first head, end head, first group, end group) of units [u0, u1)."""
        if not self.by_heads:
            return u0 * self.per_group, u1 * self.per_group, u0, u1
        group = u0 // self.per_group
        if (u1 - 1) // self.per_group != group:
            raise ValueError(f"heads {u0}..{u1 - 1} span two groups")
        return u0, u1, group, group + 1

    def rows(self, name: str, g0: int, g1: int) -> tuple[int, torch.Tensor] | None:
        heads, n, d = self.groups * self.per_group, self.state, self.dim
        h0, h1, g0, g1 = self._span(g0, g1)
        inner = heads * d
        block = lambda start, a, b, width: torch.arange(start + a * width, start + b * width)
        xbc = [block(0, h0, h1, d), block(inner, g0, g1, n), block(inner + self.groups * n, g0, g1, n)]
        projection = torch.cat(
            [block(0, h0, h1, d)] + [x + inner for x in xbc] + [block(2 * inner + 2 * self.groups * n, h0, h1, 1)]
        )
        table = {
            "in_proj.weight": (0, projection),
            "in_proj.bias": (0, projection),
            "conv1d.weight": (0, torch.cat(xbc)),
            "conv1d.bias": (0, torch.cat(xbc)),
            "dt_bias": (0, block(0, h0, h1, 1)),
            "A_log": (0, block(0, h0, h1, 1)),
            "D": (0, block(0, h0, h1, 1)),
            "norm.weight": (0, block(0, h0, h1, d)),
            "out_proj.weight": (1, block(0, h0, h1, d)),
        }
        return table.get(name)

    def attributes(self, g0: int, g1: int) -> dict:
        h0, h1, g0, g1 = self._span(g0, g1)
        groups, heads = g1 - g0, h1 - h0
        return {
            "num_heads": heads,
            "n_groups": groups,
            "intermediate_size": heads * self.dim,
            "conv_dim": heads * self.dim + 2 * groups * self.state,
        }


@dataclass(frozen=True)
class ChannelLayout:
    """A gated short convolution (LFM2's): `channels` independent channels, each with its B, C and x rows of the
    input projection, its depthwise filter and its output-projection column. The ranks split the channels; an
    output bias is added once (the first range's)."""

    channels: int

    @property
    def units(self) -> int:
        return self.channels

    def rows(self, name: str, c0: int, c1: int) -> tuple[int, torch.Tensor] | None:
        n = self.channels
        own = torch.arange(c0, c1)
        table = {
            "in_proj.weight": (0, torch.cat([own, own + n, own + 2 * n])),
            "in_proj.bias": (0, torch.cat([own, own + n, own + 2 * n])),
            "conv.weight": (0, own),
            "conv.bias": (0, own),
            "out_proj.weight": (1, own),
        }
        return table.get(name)

    def attributes(self, c0: int, c1: int) -> dict:
        return {}


def _channel_layout(module: nn.Module) -> ChannelLayout | None:
    children = dict(module.named_children())
    conv, inp, out = children.get("conv"), children.get("in_proj"), children.get("out_proj")
    if not (isinstance(conv, nn.Conv1d) and isinstance(inp, nn.Linear) and isinstance(out, nn.Linear)):
        return None
    n = conv.in_channels
    if not (conv.groups == n == conv.out_channels and inp.out_features == 3 * n and out.in_features == n):
        return None
    return ChannelLayout(n)


FIRST_ONLY = ("out_proj.bias",)  # shared by every slice, but summed over the group: kept by the first range only


_SSD = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size")


class GroupNorm:
    """A Mamba2 gated RMS norm over channels that several ranks hold: this rank's sum of squares per group, summed
    over the ranks by `combine` (an all-reduce; the dry run's proof, the other slices' sums), then the norm's own
    formula. Stands in for `norm.forward` while a head slice of a mixer whose groups span ranks runs."""

    def __init__(self, norm: nn.Module, group: int, groups: int, combine):
        self.norm, self.group, self.groups, self.combine = norm, group, groups, combine

    def __call__(self, hidden_states, gate=None):
        norm = self.norm
        dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        if gate is not None:
            h = h * nn.functional.silu(gate.to(torch.float32))
        local = h.pow(2).sum(-1, keepdim=True)  # [..., 1]: this rank's channels of its group
        sums = torch.zeros(*local.shape[:-1], self.groups, dtype=local.dtype, device=local.device)
        sums = sums.index_add(-1, torch.tensor([self.group], device=local.device), local)
        total = self.combine(sums).narrow(-1, self.group, 1)
        h = h * torch.rsqrt(total / int(norm.group_size) + norm.variance_epsilon)
        return norm.weight * h.to(dtype)


def _ssd_layout(module: nn.Module) -> SsdLayout | None:
    if not all(isinstance(getattr(module, a, None), int) for a in _SSD):
        return None
    if not {"in_proj", "conv1d", "out_proj", "norm"} <= {n for n, _ in module.named_children()}:
        return None
    heads, dim, groups, state, inner = (int(getattr(module, a)) for a in _SSD)
    if groups < 1 or heads % groups or inner != heads * dim:
        return None
    return SsdLayout(groups, heads // groups, dim, state)


def _placed(layout, module: nn.Module) -> bool:
    """Every parameter is one the layout places (or a gated DeltaNet's norm weight, shared by all heads)."""
    for name, p in module.named_parameters():
        placed = layout.rows(name, 0, layout.units)
        shared = (isinstance(layout, HeadLayout) and name.startswith(("norm.", "o_norm."))) or name in FIRST_ONLY
        if placed is None and not shared:
            return False
        if placed is not None and p.shape[placed[0]] != placed[1].numel():
            return False
    return True


def head_layout(module: nn.Module) -> HeadLayout | SsdLayout | ChannelLayout | None:
    """The module's head layout, or None when it is not a gated DeltaNet of a layout known here (every
    parameter must be one the layout places, or shared by all heads: the norm's per-channel weight)."""
    for other in (_ssd_layout(module), _channel_layout(module)):
        if other is not None:
            return other if _placed(other, module) else None
    if not all(isinstance(getattr(module, a, None), int) for a in _SHAPE):
        return None
    children = {n for n, _ in module.named_children()}
    fused, projections = _FUSED <= children, _PROJECTIONS <= children
    if not fused and not projections and not _SEPARATE <= children:
        return None
    hk, hv, dk, dv = (int(getattr(module, a)) for a in _SHAPE)
    if hk < 1 or hv % hk:
        return None
    layout = HeadLayout(fused, hk, hv // hk, dk, dv, projections)
    return layout if _placed(layout, module) else None


def ranges(k_heads: int, n: int) -> list[tuple[int, int]]:
    """Contiguous key-head ranges of the n ranks, as even as the count allows (the first ranks one more)."""
    base, extra = divmod(k_heads, n)
    bounds = [0]
    for r in range(n):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return list(zip(bounds[:-1], bounds[1:]))


@contextlib.contextmanager
def sliced(module: nn.Module, layout: HeadLayout | SsdLayout | ChannelLayout, k0: int, k1: int, combine=None):
    """Inside: `module` (its parameters and head counts) is its slice for key heads [k0, k1). The parameters
    are index views of the module's own, so gradients reach them at the slice's rows."""
    saved_params: list = []
    saved_attrs: dict = {}
    try:
        for name, p in list(module.named_parameters()):
            placed = layout.rows(name, k0, k1)
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if placed is None:
                if name in FIRST_ONLY and k0 > 0:  # added once over the group: zero here, and no gradient
                    saved_params.append((owner, leaf, owner._parameters[leaf]))
                    owner._parameters[leaf] = p.detach() * 0  # type: ignore[assignment]
                continue
            saved_params.append((owner, leaf, owner._parameters[leaf]))
            dim, index = placed
            start, count = int(index[0]), index.numel()
            if int(index[-1]) - start + 1 == count:  # one block of rows: a view, no copy of the weights
                owner._parameters[leaf] = p.narrow(dim, start, count)  # type: ignore[assignment]
            else:
                owner._parameters[leaf] = p.index_select(dim, index.to(p.device))  # type: ignore[assignment]
        if isinstance(layout, SsdLayout) and layout.by_heads:
            norm = module.get_submodule("norm")
            group = layout._span(k0, k1)[2]
            saved_attrs["norm.forward"] = norm.__dict__.get("forward")
            norm.forward = GroupNorm(norm, group, layout.groups, combine or (lambda t: t))
        for attr, value in layout.attributes(k0, k1).items():
            if hasattr(module, attr):
                saved_attrs[attr] = getattr(module, attr)
                object.__setattr__(module, attr, value)
        yield module
    finally:
        for owner, leaf, p in saved_params:
            owner._parameters[leaf] = p
        for attr, value in saved_attrs.items():
            if attr == "norm.forward":
                norm = module.get_submodule("norm")
                if value is None:
                    norm.__dict__.pop("forward", None)
                else:
                    norm.forward = value
            else:
                object.__setattr__(module, attr, value)


def prove(module: nn.Module, original, layout: HeadLayout | SsdLayout | ChannelLayout, n: int) -> str | None:
    """None when the slices of `n` ranks' head ranges, summed, give the module's own output on a random
    batch (two rows, the second left-padded); else why not."""
    hk = layout.units
    if hk < n:
        what = {HeadLayout: "key heads", SsdLayout: "head groups", ChannelLayout: "channels"}[type(layout)]
        return f"has {hk} {what}, fewer than the {n} ranks"
    p = next(module.parameters())
    out = dict(module.named_children()).get("out_proj") or module.get_submodule("o_proj")
    width = int(out.weight.shape[0])  # type: ignore[index]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, width, generator=g, dtype=torch.float64).to(p.device, p.dtype)
    mask = torch.ones(2, 11, dtype=torch.long, device=p.device)
    mask[1, :3] = 0
    try:
        with torch.no_grad():
            want = original(x, attention_mask=mask)
            spans = ranges(hk, n)
            combine = _Summed()  # the norm's all-reduce: the slices' own sums, added (first pass: collected)
            call = lambda k0, k1: _call(module, original, layout, k0, k1, (x,), {"attention_mask": mask}, combine)
            for k0, k1 in spans if isinstance(layout, SsdLayout) and layout.by_heads else ():
                call(k0, k1)
            combine.ready = True
            got = sum(call(k0, k1) for k0, k1 in spans)
    except Exception as exc:  # noqa: BLE001 - a layout that does not apply: the module runs whole
        return f"its head slices fail ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(p.dtype, 5e-2)
    scale = want.double().abs().max().clamp(min=1e-30)
    err = ((got.double() - want.double()).abs().max() / scale).item()
    return None if err <= tol else f"its head slices, summed, are not its output (relative error {err:.1e})"


def _call(module, original, layout, k0, k1, args, kwargs, combine=None):
    with sliced(module, layout, k0, k1, combine):
        return original(*args, **kwargs)


class _Summed:
    """The proof's stand-in for the norm's all-reduce: collects each slice's sums, then hands back their total."""

    def __init__(self):
        self.parts: list = []
        self.ready = False

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if not self.ready:
            self.parts.append(t)
            return t
        return torch.stack(self.parts).sum(0)


class _AllReduce(torch.autograd.Function):
    """Sum over the group; the backward sums the ranks' gradients (every rank's output is the same total)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce(group):
    return lambda t: _AllReduce.apply(t, group)


class HeadParallelMixer:
    """`module.forward` of a gated DeltaNet proven to split by heads: gather, run this rank's head slice,
    reduce-scatter the output projection's partial sums to the ranks' tokens."""

    def __init__(self, state, module: nn.Module, original, side: str, holder: ContextHolder, layout):
        self.state, self.module, self.original, self.side, self.holder = state, module, original, side, holder
        self.layout = layout
        import inspect

        self.params = set(inspect.signature(original).parameters)

    def __call__(self, *args, **kwargs):
        ctx = carried(kwargs) or self.holder.ctx
        if self.state.detached or not isinstance(ctx, ForwardContext) or self.side not in ctx.seqs:
            return self.step(ctx, args, {k: v for k, v in kwargs.items() if k != CONTEXT_KWARG})
        plan, group, layout = ctx.plan(self.side), ctx.layout.sp_group, ctx.layout
        full_args, full_kwargs = full_call(
            ctx, self.side, self.params, args, kwargs, lambda path, x: gather_for_replica(x, plan, group)
        )
        k0, k1 = ranges(self.layout.units, layout.sp_size)[layout.sp_rank]
        partial = _call(self.module, self.original, self.layout, k0, k1, full_args, full_kwargs, all_reduce(group))
        return sum_to_shard(partial, plan, group)

    def step(self, ctx, args, kwargs):
        """A decoding step under SP (its tokens replicated, the cache holding this rank's heads' states, as
        the prompt's forward left them): this rank's slice, summed over the group. Else the whole module."""
        layout = getattr(ctx, "layout", None)
        if self.state.detached or layout is None or group_size(layout.sp_group) == 1:
            return self.original(*args, **kwargs)
        k0, k1 = ranges(self.layout.units, layout.sp_size)[layout.sp_rank]
        partial = _call(self.module, self.original, self.layout, k0, k1, args, kwargs, all_reduce(layout.sp_group))
        return group_sum(partial, layout.sp_group)
