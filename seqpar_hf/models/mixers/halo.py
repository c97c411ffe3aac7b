"""A short causal convolution split along the sequence: the convolution gets, before each run of consecutive
tokens a rank holds, the k - 1 inputs that precede it (its halo) from the ranks holding them.

The halo: every rank contributes the last k - 1 convolution inputs of each of its runs (a few columns), one
all-gather, and each run takes the columns at the k - 1 global positions before its start (zeros before the
sequence start, as the convolution's own padding). Any shard plan works (contiguous, zigzag, hybrid): a run
shorter than k - 1 is all edge, so every column a halo needs was sent. The backward sums the gathered columns'
gradients over the group and each rank keeps its own.

Where the convolution is: the depthwise `nn.Conv1d` child with k - 1 padding, whose weight the module's code
hands `torch.nn.functional.conv1d` (directly, or through the module's own call); that call is intercepted
(a `TorchFunctionMode` for the module's forward). Where the code calls it through a dispatcher to a fused kernel
(transformers' `causal_conv1d_fn`: causal-conv1d on CUDA, else its PyTorch reference, `conv_functions`), the
dispatcher's call with the weight is intercepted instead: each run's halo is prepended to its inputs and the first
k - 1 outputs dropped, whatever runs the convolution (`kernels.py` checks such a kernel). The mixer that uses it, and
its proof: `sequence.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ...parallel.sharding import ShardPlan
from . import kernels, scan

# the parameters of a causal convolution function (transformers' causal_conv1d_fn and its dispatcher); a decoding
# step's (causal_conv1d_update) also takes the convolution state
CONV_PARAMS = frozenset({"hidden_states", "weight", "bias", "activation"})


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


def conv_kind(fn) -> str | None:
    """ "convolution" for a dispatcher of a causal convolution function to a kernel (`reference` is another), else
    None."""
    sig = scan.signature(fn)
    if sig is None or not CONV_PARAMS <= set(sig.parameters) or "conv_state" in sig.parameters:
        return None
    return "convolution" if kernels.reference(fn) is not fn else None


def conv_functions(module: nn.Module) -> dict[str, str]:
    """{global name: "convolution"} of the convolution dispatchers `module`'s forward reaches."""
    return scan.find(module, conv_kind)


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


class ConvTail:
    """In generation's prompt forward: the whole prompt's last k convolution inputs (zeros before its start, as the
    cache pads a short prompt; the padding that makes it divisible by sp left out), each from the rank holding it,
    one all-gather: the convolution state the unpatched cache keeps. The sequence-sharded cache calls it
    (`SequenceShardedCache.update_conv_state`); returns (the state [b, C, k], the prompt's length)."""

    def __init__(self, plan: ShardPlan, rank: int, k: int, gather):
        self.plan, self.rank, self.k, self.gather = plan, rank, k, gather

    def __call__(self, x: torch.Tensor, k: int | None = None) -> tuple[torch.Tensor, int]:
        k, length = k or self.k, self.plan.length
        index = self.plan.global_index(self.rank).to(x.device)
        keep = (index >= length - k) & (index < length)
        placed = x.new_zeros(*x.shape[:-1], k)
        placed[..., index[keep] - (length - k)] = x[..., keep]
        return self.gather(placed).unflatten(-1, (-1, k)).sum(-2), length


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
    module keeps the first s of them). `functions` ({name: kind} in `space`, the module's globals): convolution
    dispatchers, whose calls with the weight run each run with its halo prepended, their first k - 1 outputs
    dropped (what runs inside them, F.conv1d included, is left alone)."""

    def __init__(self, conv: nn.Conv1d, halos: Halos, gather, space: dict | None = None, functions=None):
        super().__init__()
        self.weight, self.plan, self.gather, self.seen = conv.weight, halos, gather, 0
        self.space, self.functions, self._inside = space or {}, functions or {}, False
        self._saved: dict = {}

    def __enter__(self):
        for name in self.functions:
            original = self.space.get(name)
            if original is None:
                continue
            self._saved[name] = original
            self.space[name] = self._wrap(original)
        return super().__enter__()

    def __exit__(self, *exc):
        self.space.update(self._saved)
        self._saved = {}
        return super().__exit__(*exc)

    def _wrap(self, original):
        sig = scan.signature(original)

        def with_halo(*args, **kwargs):
            call = dict(sig.bind(*args, **kwargs).arguments)
            extra = call.pop(next((n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {})
            weight, x = call.get("weight"), call.get("hidden_states")
            if self._inside or x is None or not _shares_storage(weight, self.weight):
                return original(*args, **kwargs)
            if any({**call, **extra}.get(k) is not None for k in scan.BOUNDARIES):
                raise scan.Unsplit("a convolution given document boundaries")
            self.seen += 1
            k = self.plan.k
            gathered = self.gather(x.index_select(-1, self.plan.send))
            outs = []
            self._inside = True  # the dispatcher's own F.conv1d (its reference) is the convolution, not another
            try:
                for (a, n, _), halo in zip(self.plan.runs, self.plan.halos(gathered)):
                    joined = torch.cat([halo.to(x.dtype), x.narrow(-1, a, n)], -1)
                    y = scan.call_by_name(original, sig, {**call, "hidden_states": joined, **extra})
                    outs.append(y.narrow(-1, k - 1, n))
            finally:
                self._inside = False
            return torch.cat(outs, -1)

        return with_halo

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if self._inside or func is not F.conv1d or not _shares_storage(weight, self.weight):
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
