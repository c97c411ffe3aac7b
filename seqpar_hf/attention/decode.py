"""Attention of a decoding step over keys that are spread across the SP group, written once.

Each rank attends the step's queries (replicated: every rank holds the same few new tokens) to the keys
it holds (its shard of the encoder states in cross-attention, its shard of the KV cache in decoder-only
self-attention) and returns the partial output with its log-sum-exp. The partials are all-gathered in
ONE collective per layer and step (queries' size, not the keys') and merged on every rank in the same
order, in fp32 (the online-softmax merge of Milakov & Gimelshein 2018, arXiv 1805.02867), so the result
is bitwise identical on every rank: sampling then draws the same tokens everywhere.
"""

from __future__ import annotations

import torch

from ..parallel.comm import all_gather_into, group_size
from .kernels import merge
from .scores import NONE, ScoreMods, capped, with_sinks


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [b, h, s_q, d], k [b, h_kv, n, d], v [b, h_kv, n, d_v] (this rank's keys), allowed [b or 1, 1, s_q, n]
    bool or None -> (out [b, h, s_q, d_v] fp32, lse [b, h, s_q] fp32). A row that sees no key here: out 0,
    lse -inf.

    Grouped-query heads are folded into the query rows instead of copying K/V per query head: the
    cache is read once per step, whatever the group size."""
    b, h, s_q, d = q.shape
    h_kv, n = k.shape[1], k.shape[2]
    rep = h // h_kv
    qg = q.float().reshape(b, h_kv, rep * s_q, d)  # [b, h, s_q, d] -> [b, h_kv, rep * s_q, d] (heads grouped)
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [b, h_kv, rep * s_q, n]
    scores = capped(scores, softcap).view(b, h_kv, rep, s_q, n)
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))  # [b, 1, 1, s_q, n] over the groups
    lse = torch.logsumexp(scores, dim=-1)  # [b, h_kv, rep, s_q]; -inf where no key is allowed
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - finite[..., None]).view(b, h_kv, rep * s_q, n)
    out = torch.matmul(p, v.float())  # [b, h_kv, rep * s_q, d_v]
    return out.view(b, h, s_q, v.shape[-1]), lse.reshape(b, h, s_q)  # [b, h_kv, rep, s_q, ..] -> [b, h, s_q, ..]


def merge_over_group(out: torch.Tensor, lse: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's (out [b, h, s_q, d_v], lse [b, h, s_q]) fp32 -> the merged (out, lse) fp32, identical on
    every rank of `group` (gathered, then merged in rank order)."""
    n = group_size(group)
    if n == 1:
        return out, lse
    packed = torch.cat([out, lse[..., None]], dim=-1).contiguous()  # [b, h, s_q, d_v + 1]: one message
    everyone = packed.new_empty((n, *packed.shape))
    all_gather_into(everyone, packed[None], group=group)  # [n, b, h, s_q, d_v + 1]
    merged, total = everyone[0, ..., :-1], everyone[0, ..., -1]
    for r in range(1, n):
        merged, total = merge(merged, total, everyone[r, ..., :-1], everyone[r, ..., -1])
    return merged, total


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    group,
    mods: ScoreMods = NONE,
) -> torch.Tensor:
    """q [b, h, s_q, d] (replicated), k [b, h_kv, n_local, d], v [b, h_kv, n_local, d_v] (this rank's keys)
    -> [b, h, s_q, d_v] in q's dtype: attention over the union of every rank's keys (soft-capped scores;
    sinks joining the merged denominator once)."""
    out, lse = local_attention(q, k, v, allowed, scale, mods.softcap)
    out, lse = merge_over_group(out, lse, group)
    if mods.sinks is not None:
        out, _ = with_sinks(out, lse, mods.sinks)
    return out.to(q.dtype)
