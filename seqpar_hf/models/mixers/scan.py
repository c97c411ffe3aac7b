"""A linear recurrence (a gated delta rule, a Mamba2 / SSD chunked scan) split along the sequence by passing its
state: each rank runs the model's own scan function on its own runs of tokens, and each run starts from the state
the tokens before it leave, which the ranks compute together.

The scan's final state is affine in its initial state: S_end = T(S_in) + S0, where S0 is the run's final state from
a zero start and T acts on the state's key axis only (the value channels of the state evolve independently: a
gated delta rule's dk x dk product of (I - beta k k^T) exp(g), a Mamba2 head's scalar decay times I_n). So one call
of the function per run gives both: the value input widened by m zero channels (m = the key axis's size) and the
initial state widened by the identity there; the widened channels' final state is T, the others' S0 (pass 1).
Every rank's (S0, T) of each run goes to every rank in one all-gather; each rank folds the runs before its own in
sequence order, in fp32 (S = T S + S0, from zero at the sequence start), and calls the function again from that
state (pass 2; the sequence's first run keeps pass 1's outputs). The backward of the all-gather sums the states'
gradients over the group, each rank keeping its own: the gradient reaches the tokens of every earlier run.

Which function is the scan is read off the module's code: a callable its forward reaches by a global name (through
the functions of its module that it calls) whose parameters are one of the two kinds below. Nothing is assumed:
the split is proven at `patch_model` on a copy of the module in float64 (`sequence.prove`) before it is used. A call
given a state or document boundaries (`cu_seqlens`) is not split (`Unsplit`); one asking for the final state (a cache)
only in generation's prompt forward (`final_length`), where every rank gets the sequence's final state: the scan's
from the state before the run holding the last real token (the padding that makes the prompt divisible by sp left
out), summed over the ranks (only that rank's is not zero).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

BOUNDARIES = ("cu_seqlens", "seq_idx")  # a call's document boundaries (packed rows): such a call is not split


class Unsplit(Exception):
    """A scan call the state passing does not cover: the forward is redone with the mixer whole."""


@dataclass(frozen=True)
class Kind:
    """How one kind of scan function is called: its per-token inputs (sequence on dim 1), the value input
    [b, s, heads, width], the initial-state and final-state flags, and the state's value axis (-1: state
    [b, h, key, value], the transition multiplies from the left; -2: [b, h, value, key], from the right)."""

    name: str
    tokens: tuple[str, ...]
    value: str
    initial: str
    final_flag: str
    value_axis: int
    key_source: str  # the input whose last dim is the state's key axis
    pair: bool  # returns (output, final state or None) whether or not asked for the final state
    seq_dim: int = 1

    def matches(self, params: set) -> bool:
        if not self.initial:  # no initial state: the one kind whose state passing is added to its outputs
            return {*self.tokens, "A", "delta_bias", "delta_softplus", self.final_flag} <= params and not (
                {"initial_state", "initial_states"} & params
            )
        return {*self.tokens, self.initial, self.final_flag} <= params


KINDS = (
    Kind("gated delta rule", ("query", "key", "value", "g", "beta"), "value", "initial_state",
         "output_final_state", -1, "key", True),
    Kind("SSD chunk scan", ("hidden_states", "dt", "B", "C"), "hidden_states", "initial_states",
         "return_final_states", -2, "B", False),
    # Mamba's selective scan: [b, channels, s] inputs, a diagonal state [b, channels, n], and no initial state
    Kind("selective scan", ("hidden_states", "dt", "B", "C", "z"), "hidden_states", "", "return_last_state", 0, "B",
         False, seq_dim=-1),
)  # fmt: skip


def signature(fn) -> inspect.Signature | None:
    with contextlib.suppress(TypeError, ValueError):
        return inspect.signature(getattr(fn, "forward", fn) if isinstance(fn, torch.nn.Module) else fn)
    return None


def call_by_name(fn, sig: inspect.Signature, arguments: dict):
    """`fn` called with `arguments` (by the names of `sig`, its reference's signature) as the modeling code calls a
    scan: the required parameters by position, the others by name. A dispatcher hands them to a kernel whose leading
    parameters have other names (flash-linear-attention's q, k, v; mamba_ssm's x) and drops the names that kernel
    does not take (the reference's chunk_size)."""
    params = sig.parameters.values()
    positional = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or p.default is not p.empty:
            break
        if p.name not in arguments:
            break
        positional.append(p.name)
    return fn(*(arguments[n] for n in positional), **{k: v for k, v in arguments.items() if k not in positional})


def kind_of(fn) -> Kind | None:
    sig = signature(fn) if callable(fn) else None
    if sig is None:
        return None
    params = set(sig.parameters)
    return next((k for k in KINDS if k.matches(params)), None)


def find(module: torch.nn.Module, classify: Callable = kind_of) -> dict:
    """{global name: kind} of the scan functions `module`'s forward reaches through its module's functions (or of
    the functions `classify` gives a kind to: `halo.conv_functions`)."""
    forward = inspect.unwrap(type(module).forward)
    space = getattr(forward, "__globals__", None)
    if space is None:
        return {}
    found, seen, todo = {}, set(), [forward.__code__]
    while todo:
        code = todo.pop()
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                todo.append(const)
        for name in code.co_names:
            if name in seen or name not in space:
                continue
            seen.add(name)
            value = space[name]
            kind = classify(value) if callable(value) and not isinstance(value, type) else None
            if kind is not None:
                found[name] = kind
                continue
            for inner in plain_functions(value):
                if inner.__globals__ is space:  # a helper of the same module (mamba2_scan_forward)
                    todo.append(inner.__code__)
    return found


def plain_functions(value) -> list[types.FunctionType]:
    """The plain functions behind `value`: itself, or those a kernels-replaceable wrapper (an nn.Module whose
    forward calls the function it closes over) would call."""
    if isinstance(value, types.FunctionType):
        return [inspect.unwrap(value)]
    if isinstance(value, torch.nn.Module):
        cells = getattr(type(value).forward, "__closure__", None) or ()
        return [inspect.unwrap(c.cell_contents) for c in cells if isinstance(c.cell_contents, types.FunctionType)]
    return []


def global_space(module: torch.nn.Module) -> dict:
    return inspect.unwrap(type(module).forward).__globals__


class StatePassing:
    """While active (a context), the module's scan functions (global names of its modeling module) run split:
    `runs` are this rank's (local start, length, global start); `gather(x)` all-gathers a [1, 1, w] tensor
    over the ranks in rank order ([1, 1, sp * w]; the proof's stand-in records); `order` lists every rank's runs
    as (rank, index, global start)."""

    def __init__(
        self, space: dict, scans: dict[str, Kind], runs, order, rank: int, gather: Callable, final_length=None
    ):
        self.space, self.scans, self.runs, self.order, self.rank = space, scans, runs, order, rank
        self.gather, self.seen = gather, 0
        self.final_length: int | None = final_length  # the prompt's real tokens: a scan asked for its final state
        self.last: tuple | None = None
        self._saved: dict = {}
        counts: dict = {}
        for r, _, _ in order:
            counts[r] = counts.get(r, 0) + 1
        self.width = max(counts.values())

    def __enter__(self):
        for name, kind in self.scans.items():
            original = self.space.get(name)
            if kind_of(original) != kind:  # replaced since it was proven (another kernel): not split, not seen
                continue
            self._saved[name] = original
            self.space[name] = self._wrap(original, kind)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            self.space[name] = original
        self._saved = {}

    def _wrap(self, original, kind: Kind):
        sig = signature(original)

        def split(*args, **kwargs):
            self.seen += 1
            bound = sig.bind(*args, **kwargs)
            call = dict(bound.arguments)
            extra = call.pop(next((n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD), ""), {})
            call.update(extra)
            final = bool(call.get(kind.final_flag))
            if (kind.initial and call.get(kind.initial) is not None) or (final and self.final_length is None):
                raise Unsplit("a scan given a state or asked for its final state (a cache)")
            if any(call.get(k) is not None for k in BOUNDARIES):
                raise Unsplit("a scan given document boundaries")
            self.last = None  # (dtype, the final state of the run holding the last real token, or None)
            out = self._split(lambda arguments: call_by_name(original, sig, arguments), kind, call)
            if final:
                return out, self._final(kind, call)
            return (out, None) if kind.pair else out

        return split

    def _exchange(self, states: list) -> torch.Tensor:
        """Every rank's runs' states, [sp, runs, ...] (a rank with fewer runs pads zeros), in fp32 at least."""
        flat = torch.stack(states)
        flat = flat if flat.dtype == torch.float64 else flat.float()
        shape, pad = flat.shape, self.width - flat.shape[0]
        sent = torch.cat([flat, flat.new_zeros(pad, *shape[1:])]) if pad else flat
        return self.gather(sent.reshape(1, 1, -1)).reshape(-1, self.width, *shape[1:])

    def _split(self, fn, kind: Kind, call: dict):
        if not kind.initial:
            return self._split_selective(fn, kind, call)
        value = call[kind.value]
        m, dv = call[kind.key_source].shape[-1], value.shape[-1]
        dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
        starts = [g for _, _, g in self.order]
        parts, states = [], []
        for start, n, glob in self.runs:
            piece = {k: (v.narrow(1, start, n) if k in kind.tokens else v) for k, v in call.items()}
            v = piece[kind.value]
            if glob == starts[0]:  # the sequence's first run: its outputs and final state from a zero start
                out, final = fn({**piece, kind.final_flag: True})
                self._keep_final(fn, kind, piece, None, glob, n, final)
                parts.append(out)
                states.append(torch.cat([final.to(dtype), _zeros(v, m, dtype)], kind.value_axis))
            elif glob == starts[-1]:  # the last: no run needs its state; zeros, tied after its inputs (_Tie)
                parts.append(None)
                states.append(_Tie.apply(_widened_zeros(kind, v, m, dv, dtype), v))
            else:  # between: its zero-start state S0 and its transition T from one widened call
                widened = torch.cat([v, v.new_zeros(*v.shape[:-1], m)], -1)
                out, final = fn({**piece, kind.value: widened, kind.initial: _identity(kind, value, m, dv),
                                   kind.final_flag: True})  # fmt: skip
                parts.append(None)
                states.append(final.to(dtype))
        everyone = self._exchange(states)
        outs = []
        for (start, n, glob), first in zip(self.runs, parts):
            if first is not None:  # the first run: its zero start was the sequence's
                outs.append(_tie(first, everyone))
                continue
            incoming = None
            for r, i, g in self.order:  # the runs before this one, in sequence order
                if g >= glob:
                    break
                s0, t = _split_state(kind, everyone[r, i], dv)
                incoming = s0 if incoming is None else (_apply(kind, t, incoming) + s0)
            piece = {k: (v.narrow(1, start, n) if k in kind.tokens else v) for k, v in call.items()}
            out, final = fn({**piece, kind.initial: incoming, kind.final_flag: True})
            self._keep_final(fn, kind, piece, incoming, glob, n, final)
            outs.append(out)
        return torch.cat(outs, 1) if len(outs) > 1 else outs[0]

    def _keep_final(self, fn, kind: Kind, piece: dict, incoming, glob: int, n: int, final) -> None:
        """In the prompt's forward: the final state's dtype, and the sequence's final state if this run holds its
        last real token (the scan redone without the padding after it, if any)."""
        end = self.final_length
        if end is None:
            return
        if not glob < end <= glob + n:
            self.last = self.last or (final.dtype, None)
            return
        if end < glob + n:
            real = {k: (v.narrow(kind.seq_dim, 0, end - glob) if k in kind.tokens and v is not None else v)
                    for k, v in piece.items()}  # fmt: skip
            extra = {kind.initial: incoming} if kind.initial else {}
            final = fn({**real, **extra, kind.final_flag: True})[1]
        self.last = (final.dtype, final)

    def _final(self, kind: Kind, call: dict) -> torch.Tensor:
        """The sequence's final state on every rank: the one rank's that holds the last real token, summed with the
        others' zeros (one all-gather)."""
        assert self.last is not None  # every run of the call kept its final state's dtype
        dtype, final = self.last
        if final is None:
            final = torch.zeros(final_shape(kind, call), dtype=dtype, device=call[kind.value].device)
        everyone = self._exchange([final])
        return everyone.sum((0, 1)).to(dtype)

    def _split_selective(self, fn, kind: Kind, call: dict):
        """Mamba's selective scan takes no initial state, but its state decays elementwise: a run's final state
        is T * S_in + S0 with T = exp(A * the run's summed time steps), and the incoming state adds
        C_t . (exp(A * the time steps up to t) * S_in) to each output before its gate. Pass 1 returns S0; T and
        the added outputs are computed here from the call's own A, time steps, C and gate."""
        parts, states = [], []
        for start, n, _ in self.runs:
            piece = {k: (v.narrow(-1, start, n) if k in kind.tokens and v is not None else v) for k, v in call.items()}
            out, final = fn({**piece, kind.final_flag: True})
            dt = piece["dt"].float() if piece["dt"].dtype != torch.float64 else piece["dt"]
            if call.get("delta_bias") is not None:
                dt = dt + call["delta_bias"].to(dt.dtype)[..., None]
            if call.get("delta_softplus"):
                dt = torch.nn.functional.softplus(dt)
            cum = dt.cumsum(-1)  # [b, channels, n_tokens]
            parts.append((out, piece, cum, final.dtype))
            a = call["A"].to(cum.dtype)
            states.append(torch.stack([final.to(cum.dtype), torch.exp(a[None] * cum[..., -1:])]))
        everyone = self._exchange(states)
        outs = []
        for (_, _, glob), (first, piece, cum, dtype) in zip(self.runs, parts):
            incoming = None
            for r, i, g in self.order:
                if g >= glob:
                    break
                s0, t = everyone[r, i, 0], everyone[r, i, 1]
                incoming = s0 if incoming is None else t * incoming + s0
            self._keep_selective(fn, kind, piece, cum, incoming, glob, dtype)
            if incoming is None:
                outs.append(_tie(first, everyone))
                continue
            decay = torch.exp(call["A"].to(cum.dtype)[None, :, None, :] * cum[..., None])  # [b, ch, t, n]
            c = piece["C"].to(cum.dtype)  # [b, n, t]
            added = torch.einsum("bctn,bnt,bcn->bct", decay, c, incoming)
            if piece.get("z") is not None:
                added = added * torch.nn.functional.silu(piece["z"].to(added.dtype))
            outs.append(first + added.to(first.dtype))
        return torch.cat(outs, -1) if len(outs) > 1 else outs[0]

    def _keep_selective(self, fn, kind: Kind, piece: dict, cum, incoming, glob: int, dtype) -> None:
        """`_keep_final` for the selective scan: the run's own final state (from its real tokens) plus its incoming
        state decayed over them."""
        end, n = self.final_length, cum.shape[-1]
        if end is None:
            return
        if not glob < end <= glob + n:
            self.last = self.last or (dtype, None)
            return
        real = {k: (v.narrow(-1, 0, end - glob) if k in kind.tokens and v is not None else v) for k, v in piece.items()}
        _, final = fn({**real, kind.final_flag: True})
        final = final.to(cum.dtype)
        if incoming is not None:
            final = final + torch.exp(piece["A"].to(cum.dtype)[None] * cum[..., end - glob - 1, None]) * incoming
        self.last = (dtype, final)


def final_shape(kind: Kind, call: dict) -> tuple[int, ...]:
    """The shape of the final state of a call of a scan of `kind` (its arguments by name)."""
    value, key = call[kind.value], call[kind.key_source]
    if not kind.initial:  # the selective scan's [b, channels, n]
        return (value.shape[0], value.shape[1], key.shape[1])
    b, h, dv, m = value.shape[0], value.shape[2], value.shape[-1], key.shape[-1]
    return (b, h, m, dv) if kind.value_axis == -1 else (b, h, dv, m)


def _identity(kind: Kind, value: torch.Tensor, m: int, dv: int) -> torch.Tensor:
    """The widened initial state: zeros for the value channels, the identity on the m added ones."""
    b, h = value.shape[0], value.shape[2]
    dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
    eye = torch.eye(m, dtype=dtype, device=value.device).expand(b, h, m, m)
    zeros = torch.zeros(b, h, m, dv, dtype=dtype, device=value.device)
    if kind.value_axis == -1:  # [b, h, key, value]
        return torch.cat([zeros, eye], -1)
    return torch.cat([zeros.transpose(-1, -2), eye], -2)  # [b, h, value, key]


def _zeros(value: torch.Tensor, m: int, dtype) -> torch.Tensor:
    """The m added channels of a first run's state (its transition: unused), zeros."""
    return torch.zeros(value.shape[0], value.shape[2], m, m, dtype=dtype, device=value.device)


def _widened_zeros(kind: Kind, value: torch.Tensor, m: int, dv: int, dtype) -> torch.Tensor:
    b, h = value.shape[0], value.shape[2]
    shape = (b, h, m, dv + m) if kind.value_axis == -1 else (b, h, dv + m, m)
    return torch.zeros(shape, dtype=dtype, device=value.device)


def _split_state(kind: Kind, state: torch.Tensor, dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(S0, T) of a widened final state."""
    axis = kind.value_axis
    return state.narrow(axis, 0, dv), state.narrow(axis, dv, state.shape[axis] - dv)


def _apply(kind: Kind, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return t @ s if kind.value_axis == -1 else s @ t


class _Tie(torch.autograd.Function):
    """`x`, made to depend on `other` with a zero gradient, so that every rank's backward runs the states'
    all-gather (a collective every rank must join) in one order: the sequence's first run ties its outputs to the
    gathered states; its last run ties the zeros it sends to its scan's input (each rank's scan input then waits
    for the states' gradient, before the convolution halo's all-gather)."""

    @staticmethod
    def forward(ctx, x, other):
        ctx.shape, ctx.dtype, ctx.device = other.shape, other.dtype, other.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)


def _tie(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return _Tie.apply(x, other) if torch.is_grad_enabled() and other.requires_grad else x
