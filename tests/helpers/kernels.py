"""Stand-ins for a fused scan kernel (flash-linear-attention's gated delta rule, mamba_ssm's SSD scan) and the
dispatcher transformers binds a scan's name to: the kernels' interfaces (their own leading parameter names, no
float64) computing the reference at another chunk size (another rounding). tests/test_scan_kernels.py, and the
parity cases with `kernel` (tests/runs/parity.py)."""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.nn.functional as F

from seqpar_hf.models.mixers import halo, kernels, scan


def dispatcher(reference, kernel):
    """What transformers binds a scan's name to: a module whose forward has the reference's signature and closes
    over it, handing each call to `kernel` with only the names `kernel` takes (hub_kernels' fallback wrapper)."""
    takes = set(inspect.signature(kernel).parameters)

    def forward(self, *args, **kwargs):
        assert reference is not None  # the wrapper closes over its reference, as transformers' does
        return kernel(*args, **{k: v for k, v in kwargs.items() if k in takes})

    sig = inspect.signature(reference)
    this = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = sig.replace(parameters=[this, *sig.parameters.values()])  # type: ignore[attr-defined]
    return type("Func", (torch.nn.Module,), {"forward": forward})()


class Calls(list):
    """The calls a stand-in kernel saw: (value width, whether it was given an initial state, dtype)."""


def gated_delta_rule_kernel(reference, calls: Calls, *, ignores_state=False, detaches_state=False, widths=None):
    """flash-linear-attention's interface (q, k, v, ..., scale, initial_state, ...): the reference at another chunk
    size. `ignores_state` / `detaches_state`: a kernel that drops the initial state, or its gradient; `widths`: the
    value widths it takes (a kernel built for the model's head size only)."""

    def chunk_gated_delta_rule(
        q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False
    ):
        if q.dtype == torch.float64:
            raise TypeError("no float64 kernel")
        if widths is not None and v.shape[-1] not in widths:
            raise ValueError(f"value head size {v.shape[-1]} not supported")
        calls.append((v.shape[-1], initial_state is not None, q.dtype))
        state = None if ignores_state else initial_state
        if state is not None and detaches_state:
            state = state.detach()
        return reference(
            q, k, v, g=g, beta=beta, chunk_size=4, initial_state=state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )  # fmt: skip

    return chunk_gated_delta_rule


def ssd_kernel(reference, calls: Calls):
    """mamba_ssm's `mamba_chunk_scan_combined` interface (x, dt, A, B, C, chunk_size, ...): the reference at half the
    chunk size."""

    def mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
        dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
    ):  # fmt: skip
        if x.dtype == torch.float64:
            raise TypeError("no float64 kernel")
        calls.append((x.shape[-1], initial_states is not None, x.dtype))
        return reference(
            x, dt, A, B, C, max(chunk_size // 2, 1), D=D, dt_bias=dt_bias, initial_states=initial_states,
            dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=return_final_states,
        )  # fmt: skip

    return mamba_chunk_scan_combined


def conv_kernel(calls: Calls, *, shifted: bool = False):
    """causal-conv1d's interface (x, weight, bias, seq_idx, initial_states, ..., activation): a depthwise causal
    convolution written out by its windows (no F.conv1d, no float64). `shifted`: windows one token early (not the
    reference)."""

    def causal_conv1d_fn(
        x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False, final_states_out=None,
        activation=None,
    ):  # fmt: skip
        if x.dtype == torch.float64:
            raise TypeError("no float64 kernel")
        calls.append((x.shape[-1], False, x.dtype))
        k, s = weight.shape[-1], x.shape[-1]
        windows = F.pad(x, (k - 1 + shifted, 0))[..., : s + k - 1].unfold(-1, k, 1)  # [b, C, s, k]
        out = torch.einsum("bcsk,ck->bcs", windows, weight.to(x.dtype))
        out = out if bias is None else out + bias[:, None].to(x.dtype)
        return F.silu(out) if activation in ("silu", "swish") else out

    return causal_conv1d_fn


@contextlib.contextmanager
def stand_in(model: torch.nn.Module, names):
    """While entered, the scans or convolution dispatchers `names` (one name or several) of `model`'s mixers run
    stand-in kernels behind dispatchers; yields their calls."""
    calls, saved = Calls(), []
    for name in [names] if isinstance(names, str) else names:
        module = next(m for m in model.modules() if name in scan.find(m) or name in halo.conv_functions(m))
        space = scan.global_space(module)
        original = space[name]
        reference = kernels.reference(original)
        kind = scan.kind_of(reference)
        if kind is None:
            kernel = conv_kernel(calls)
        else:
            kernel = (ssd_kernel if kind.name == "SSD chunk scan" else gated_delta_rule_kernel)(reference, calls)
        saved.append((space, name, original))
        space[name] = dispatcher(reference, kernel)
    try:
        yield calls
    finally:
        for space, name, original in saved:
            space[name] = original
