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
              kv_for_q: torch.Tensor | None = None) -> torch.Tensor:
    """q [b, h, s_q, d], k/v [b, h_kv, s_k, d] -> [b, h, s_q, d].

    `kv_for_q` [h] maps each query head to its kv head (grouped-query attention); None means the
    heads correspond one to one. Fully masked rows give zeros (SDPA's behaviour).
    """
    if kv_for_q is not None:
        k = k.index_select(1, kv_for_q)  # [b, h_kv, s_k, d] -> [b, h, s_k, d]
        v = v.index_select(1, kv_for_q)
    mask, is_causal = sdpa_mask(key_mask, q.shape[2], causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, scale=scale)
