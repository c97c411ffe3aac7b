"""Tier 1: the local SDPA wrapper takes the math path on CPU in half precision for short keys (faster
there, see seqpar_hf/attention/kernels.py), the fused kernel elsewhere, with the same result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from seqpar_hf.attention import kernels


@pytest.mark.parametrize(
    "dtype,keys,path", [(torch.bfloat16, 64, SDPBackend.MATH), (torch.bfloat16, 256, None), (torch.float32, 64, None)]
)
def test_cpu_sdpa_path_by_dtype_and_length(dtype, keys, path):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, keys, 16, dtype=dtype) for _ in range(3))
    mask = torch.ones(keys, keys, dtype=torch.bool).tril()
    got = kernels.sdpa(q, k, v, attn_mask=mask)
    with sdpa_kernel(path or SDPBackend.FLASH_ATTENTION):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(got, want)  # exactly the kernel the rule picks
    with sdpa_kernel(SDPBackend.MATH):
        math = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert (got.double() - math).abs().max() < (2e-2 if dtype == torch.bfloat16 else 1e-5)
