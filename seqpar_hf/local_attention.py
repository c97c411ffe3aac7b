"""The attention math on one rank, written once: SDPA over full-length q/k/v for some heads.

Masks arrive as a key-padding vector [b, s_k] (True = attend) or None, plus a causal flag; this
module turns them into what SDPA needs. On CUDA SDPA picks flash / memory-efficient kernels, on
CPU the CPU flash kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa_mask(key_mask: torch.Tensor | None, q_len: int, causal: bool) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) for SDPA from a key-padding mask [b, s_k] and a causal flag."""
    if key_mask is None:
        return None, causal and q_len > 1
    mask = key_mask[:, None, None, :]  # [b, s_k] -> [b, 1, 1, s_k]
    if causal:
        s_k = key_mask.shape[-1]
        rows = torch.arange(q_len, device=key_mask.device)[:, None]
        cols = torch.arange(s_k, device=key_mask.device)[None, :]
        mask = mask & (rows >= cols)  # [b, 1, s_q, s_k]
    return mask, False


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
              causal: bool, scale: float | None, dropout: float = 0.0,
              kv_for_q: tuple[int, ...] | None = None) -> torch.Tensor:
    """q [b, h, s_q, d], k/v [b, h_kv, s_k, d] -> [b, h, s_q, d].

    `kv_for_q` gives each query head's kv head (grouped-query attention); None means the heads
    correspond one to one. Fully masked rows give zeros (SDPA's behaviour).
    """
    mask, is_causal = sdpa_mask(key_mask, q.shape[2], causal)
    gqa = False
    if kv_for_q is not None:
        rep = q.shape[1] // k.shape[1]
        regular = kv_for_q == tuple(i // rep for i in range(q.shape[1]))
        # SDPA's own GQA avoids copying K/V per query head; CUDA kernels take it only without a mask
        # (as transformers decides), else SDPA would fall back to the math kernel.
        if regular and (q.device.type == "cpu" or mask is None):
            gqa = True
        else:
            index = torch.tensor(kv_for_q, device=q.device)
            k, v = k.index_select(1, index), v.index_select(1, index)  # [b, h_kv, s_k, d] -> [b, h, s_k, d]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                                          scale=scale, enable_gqa=gqa)


# ---------------------------------------------------------------------------------------------
# Blocks with log-sum-exp, for ring attention: the forward returns (out, lse) so partial results
# over different key blocks can be merged; the backward recomputes from the final out and lse.
# Shapes: q [b, h, s_q, d], k/v [b, h, s_k, d], bias [b, 1, s_q, s_k] additive (0 / -inf) or None,
# lse [b, h, s_q] fp32.

_aten = torch.ops.aten


def _aligned_bias(bias: torch.Tensor) -> torch.Tensor:
    """CUDA's memory-efficient kernel wants the bias rows 16-element aligned: pad, then view."""
    s_k = bias.shape[-1]
    padded = (s_k + 15) // 16 * 16
    if padded == s_k:
        return bias.contiguous()
    out = bias.new_zeros((*bias.shape[:-1], padded))
    out[..., :s_k] = bias
    return out[..., :s_k]


def block_forward(q, k, v, bias, causal: bool, scale: float):
    if q.device.type == "cpu":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
        return out, lse
    if q.device.type == "cuda":
        b = None if bias is None else _aligned_bias(bias.expand(q.shape[0], q.shape[1], -1, -1))
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]].float()
    return _math_forward(q, k, v, bias, causal, scale)


def block_backward(dout, q, k, v, out, lse, bias, causal: bool, scale: float):
    if q.device.type == "cpu":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    if q.device.type == "cuda":
        b = None if bias is None else _aligned_bias(bias.expand(q.shape[0], q.shape[1], -1, -1))
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, b if b is not None else torch.empty(0, device=q.device, dtype=q.dtype), out,
            lse.contiguous(), zero, zero, 0.0, [True, True, True, False], causal, scale=scale)
        return dq, dk, dv
    return _math_backward(dout, q, k, v, out, lse, bias, causal, scale)


def _scores(q, k, bias, causal, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [b, h, s_q, s_k]
    if bias is not None:
        s = s + bias.float()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_forward(q, k, v, bias, causal, scale):
    s = _scores(q, k, bias, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # [b, h, s_q]
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None])
    return torch.matmul(p, v.float()).to(q.dtype), lse.nan_to_num(neginf=0.0)


def _math_backward(dout, q, k, v, out, lse, bias, causal, scale):
    s = _scores(q, k, bias, causal, scale)
    p = torch.exp(s - lse[..., None])  # [b, h, s_q, s_k]
    do = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, v.float().transpose(-1, -2))
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Online-softmax merge of two partial results over disjoint key sets, in fp32.

    out/block_out [b, h, s, d], lse/block_lse [b, h, s] (-inf: the row saw no key). Rows that saw no
    key in either part stay 0 with lse -inf, without producing NaN.
    """
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w_old, w_new = torch.exp(lse - m), torch.exp(block_lse - m)  # [b, h, s]
    total = w_old + w_new
    safe = torch.where(total > 0, total, torch.ones_like(total))
    merged = (out * w_old[..., None] + block_out.float() * w_new[..., None]) / safe[..., None]
    return merged, m + torch.log(total)
