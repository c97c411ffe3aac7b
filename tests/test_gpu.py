"""Tier 3 (CUDA only; skipped elsewhere): the CUDA kernels of the ring blocks and the patched model
on a GPU. One GPU suffices: block kernels need no process group, the model runs at sp_size=1."""

from __future__ import annotations

import copy

import pytest
import torch

import seqpar_hf
from seqpar_hf.attention.kernels import block_backward, block_forward, math_backward as _math_backward, math_forward as _math_forward

from .models import build_model, make_batch, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("causal,masked,s_k", [(False, False, 64), (True, False, 64), (False, True, 61),
                                               (True, True, 64)])
def test_cuda_block_kernels_match_the_math(causal, masked, s_k):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 32, device="cuda")
    k, v = torch.randn(2, 4, s_k, 32, device="cuda"), torch.randn(2, 4, s_k, 32, device="cuda")
    bias = None
    if masked:
        allowed = torch.rand(2, 1, 64, s_k, device="cuda") > 0.3
        bias = torch.zeros(allowed.shape, device="cuda").masked_fill(~allowed, float("-inf"))
    out, lse = block_forward(q, k, v, bias, causal, 32 ** -0.5)
    ref_out, ref_lse = _math_forward(q, k, v, bias, causal, 32 ** -0.5)
    assert relative_error(out, ref_out) < 1e-5 and relative_error(lse, ref_lse) < 1e-5
    dout = torch.randn_like(out)
    grads = block_backward(dout, q, k, v, out, lse, bias, causal, 32 ** -0.5)
    ref = _math_backward(dout, q, k, v, ref_out, ref_lse, bias, causal, 32 ** -0.5)
    for g, r in zip(grads, ref):
        assert relative_error(g, r) < 1e-4


@pytest.mark.parametrize("family", ["marian", "llama"])
def test_patched_model_on_cuda_bf16(family):
    model = build_model(family).cuda().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    batch = {k: v.cuda() for k, v in make_batch(family, seed=0).items()}
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    assert relative_error(model(**batch).loss.float(), reference(**batch).loss.float()) < 1e-2
