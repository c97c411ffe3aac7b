"""flash-linear-attention's own gated delta rule (its Triton kernels, in Triton's interpreter on the CPU) behind the
DeltaNet's scan name, as transformers dispatches to it on a GPU: the split along the sequence is proven with the
reference and checked on the kernel, then runs the kernel from the states passed (the widened value channels
included), its shards the module's own output within fp32 rounding.

Skipped without `flash-linear-attention` and `triton` (not in `.[dev]`: `pip install flash-linear-attention triton
numpy`); slow (the interpreter runs the kernels in numpy: about a minute)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("flash-linear-attention and triton are not installed", allow_module_level=True)

from .helpers import triton_cpu

triton_cpu.enable()  # at collection: before anything imports fla's kernels (they are interpreted from their import)

from seqpar_hf.models.mixers import halo, scan, sequence  # noqa: E402

from .helpers.kernels import dispatcher  # noqa: E402
from .test_scan_kernels import _mixer, _split_output  # noqa: E402


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_flash_linear_attention_runs_the_split(model_type, monkeypatch):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    module, space, name, reference = _mixer(model_type)
    calls = []

    def fla(*args, **kwargs):
        calls.append(kwargs.get("initial_state") is not None)
        return chunk_gated_delta_rule(*args, **kwargs)

    fla.__signature__ = __import__("inspect").signature(chunk_gated_delta_rule)  # type: ignore[attr-defined]
    monkeypatch.setitem(space, name, dispatcher(reference, fla))
    scans, conv = scan.find(module), halo.depthwise_conv(module)
    assert sequence.prove(module, module.forward, conv, scans, 2) is None
    assert any(calls)  # the check ran fla from an initial state
    calls.clear()
    x = torch.randn(2, 13, sequence._width(module))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :3] = 0
    assert _split_output(module, 3, x, mask) < 1e-5
    assert any(calls)
