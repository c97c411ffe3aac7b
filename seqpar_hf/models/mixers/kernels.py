"""A fused kernel behind a scan's or a convolution's name (flash-linear-attention's gated delta rule, mamba_ssm's SSD
scan, causal-conv1d), used by the split along the sequence and checked against the reference.

transformers' modeling modules call a scan (and a convolution) by a global name bound to a dispatcher: the installed
kernel package where it runs on the inputs' device (CUDA), else the module's own PyTorch function, the reference.
The convolution's halo is prepended at the dispatcher's call (`halo.py`), and the same check covers it. The state
passing (`scan.py`) is proven in float64 (`sequence.prove`), which no fused kernel takes; so the proof runs the
reference (`References`), recording every call the split makes, and the dispatcher is then checked on those calls,
on the module's device, in fp32 (`check`): the outputs, the final states and the gradients of every input (the
initial state's included: the split's backward reaches the earlier runs through it) within `TOL` of the reference's,
each call also from a random initial state of the size of the others, so that a kernel ignoring it, or the widened
value channels that carry the transition, is off by O(1). Proven math (the reference, float64) and a kernel that
computes the reference's function on the split's own calls (fp32): the split runs the kernel. Where the dispatcher
runs the reference on this device (a CPU), the check compares it with itself: a few tiny calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from . import scan

# A kernel's rounding (fp32, TF32 matmuls on a GPU) against the reference's over the proof's few dozen tokens is
# ~1e-6-1e-3 of the largest output; an initial state it ignores, or value channels it drops, is O(1).
TOL = 1e-2


def reference(value):
    """The reference behind a dispatcher: the PyTorch function it falls back to (its parameters are the
    dispatcher's), or `value` itself."""
    sig = scan.signature(value)
    if sig is None:
        return value
    names = list(sig.parameters)
    return next(
        (
            f
            for f in scan.plain_functions(value)
            if f is not value and (fs := scan.signature(f)) is not None and list(fs.parameters) == names
        ),
        value,
    )


class References:
    """While entered, each of `scans`' global names in `space` (scans and convolutions: name -> kind) that dispatches
    to something other than its reference runs the reference, and its calls are recorded in `calls`: (name, the
    call's arguments by name)."""

    def __init__(self, space: dict, scans: dict):
        self.space, self.scans = space, scans
        self.calls: list[tuple[str, dict]] = []
        self.kernels: dict = {}  # name -> the dispatcher the module calls

    def __enter__(self):
        for name in self.scans:
            original = self.space.get(name)
            ref = reference(original) if original is not None else None
            if ref is None or ref is original:
                continue
            self.kernels[name] = original
            self.space[name] = self._recording(name, ref)
        return self

    def __exit__(self, *exc):
        self.space.update(self.kernels)

    def _recording(self, name: str, ref: Callable) -> Callable:
        sig = scan.signature(ref)

        @functools.wraps(ref)  # the reference's signature: the state passing binds the call's arguments by it
        def run(*args, **kwargs):
            if sig is not None:
                bound = sig.bind(*args, **kwargs)
                self.calls.append((name, dict(bound.arguments)))
            return ref(*args, **kwargs)

        return run

    def check(self, device) -> str | None:
        return check(self.kernels, self.scans, self.calls, device)


def check(kernels: dict, scans: dict, calls: list[tuple[str, dict]], device) -> str | None:
    """None when each dispatcher in `kernels` (name -> what the module calls) gives its reference's numbers on the
    recorded `calls`, else why not."""
    seen: set = set()
    for name, call in calls:
        fn, kind = kernels[name], scans[name]
        ref = reference(fn)
        call = _flat(ref, call)
        key = (name, *((k, tuple(v.shape)) if isinstance(v, torch.Tensor) else (k, repr(v)) for k, v in call.items()))
        if key in seen:
            continue
        seen.add(key)
        try:
            err = _error(fn, ref, kind, call, device)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot take the split's call: the split is not used
            text = str(exc).splitlines()[0][:120] if str(exc) else ""
            return f"the kernel behind {name} fails on the split's calls ({type(exc).__name__}: {text})"
        if err > TOL:
            return f"the kernel behind {name} is not its reference on the split's calls (relative error {err:.1e})"
    return None


def _flat(ref, call: dict) -> dict:
    """The call's arguments by name, a `**kwargs` catch-all spread out."""
    sig = scan.signature(ref)
    var = next((n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD), "") if sig is not None else ""
    out = {k: v for k, v in call.items() if k != var}
    out.update(call.get(var) or {})
    return out


def _error(fn, ref, kind, call: dict, device) -> float:
    """The largest relative error of `fn` against `ref` on `call` in fp32: outputs, then every input's gradient; the
    call as recorded and, for a scan with an initial state, from a random one."""
    g = torch.Generator().manual_seed(0)
    variants = [call]
    if isinstance(kind, scan.Kind) and kind.initial and kind.final_flag in call:
        shape = scan.final_shape(kind, call)
        variants.append({**call, kind.initial: torch.randn(shape, generator=g, dtype=torch.float64)})
    err = 0.0
    for variant in variants:
        inputs = {k: _fp32(v, device) for k, v in variant.items()}
        with torch.no_grad():
            got, want = _tensors(_call(fn, ref, inputs)), _tensors(_call(ref, ref, inputs))
        if len(got) != len(want) or any(a.shape != b.shape for a, b in zip(got, want)):
            return float("inf")
        err = max(err, *(_relative(a, b) for a, b in zip(got, want)))
        err = max(err, _gradient_error(fn, ref, inputs, g))
    return err


def _gradient_error(fn, ref, inputs: dict, g: torch.Generator) -> float:
    leaves = [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    grads = []
    weights: list | None = None
    for f in (fn, ref):
        args = {k: (v.detach().clone().requires_grad_() if k in leaves else v) for k, v in inputs.items()}
        outs = _tensors(_call(f, ref, args))
        if weights is None:
            weights = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype) for o in outs]
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
        used = [k for k in leaves if args[k].requires_grad]
        got = torch.autograd.grad(loss, [args[k] for k in used], allow_unused=True)
        grads.append({k: d for k, d in zip(used, got) if d is not None})
    mine, theirs = grads
    if set(mine) != set(theirs):
        return float("inf")
    return max((_relative(mine[k], theirs[k]) for k in theirs), default=0.0)


def _call(fn, ref, arguments: dict):
    sig = scan.signature(ref)
    return scan.call_by_name(fn, sig, arguments) if sig is not None else fn(**arguments)


def _fp32(v, device):
    if isinstance(v, torch.Tensor):
        v = v.detach().to(device)
        return v.float() if v.is_floating_point() else v
    return v


def _tensors(out) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.double().abs().max().clamp(min=1e-30)
    return float((got.double() - want.double()).abs().max() / scale)
