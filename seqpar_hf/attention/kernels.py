"""The attention math on one rank, written once.

- `attention`: SDPA over whole sequences for some heads (Ulysses after its all-to-all), with the
  mask built once per forward and pattern (`pattern.Pattern`); on CUDA, packed or windowed attention
  in fp16 / bf16 takes the varlen flash kernel instead, with no mask (fp32 has no flash kernel: packed
  rows go document by document, `_by_document`).
- `block_forward` / `block_backward`: one block of queries against one block of keys, returning /
  taking the log-sum-exp, for ring attention. They call private aten kernels (through `_compat`,
  checked once) and fall back to the math here.
- `merge`: the online-softmax merge of partial results over disjoint key sets, in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _compat
from .masks import DocumentBatch, segments
from .pattern import MISSING, Pattern


def _expand_kv(q, k, v, kv_for_q, mask_present: bool):
    """(k, v, enable_gqa): SDPA's own GQA avoids copying K/V per query head; CUDA kernels take it only
    without a mask (as transformers decides), else SDPA would fall back to the math kernel."""
    if kv_for_q is None:
        return k, v, False
    rep = q.shape[1] // k.shape[1]
    regular = kv_for_q == tuple(i // rep for i in range(q.shape[1]))
    if regular and (q.device.type == "cpu" or not mask_present):
        return k, v, True
    index = torch.tensor(kv_for_q, device=q.device)
    return k.index_select(1, index), v.index_select(1, index), False  # [b, h_kv, s, d] -> [b, h, s, d]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: Pattern,
    scale: float,
    dropout: float,
    kv_for_q: tuple[int, ...] | None,
) -> torch.Tensor:
    """q [b, h, S_q, d], k/v [b, h_kv, S_k, d] over whole padded sequences -> [b, h, S_q, d].

    `kv_for_q` gives each query head's kv head (grouped-query attention); None: one to one.
    Masks and document plans are built once per forward and pattern, not per layer.
    Fully masked rows (padding queries) give zeros, as SDPA does.
    """
    spec = pattern.spec
    if q.device.type == "cuda" and not spec.trivial and dropout == 0.0 and spec.blocks is None:
        out = _varlen(q, k, v, pattern, scale, kv_for_q)
        if out is not None:
            return out
    if spec.q.doc is not None and spec.blocks is None:  # (packed rows with blocks are refused before sharding)
        out = _by_document(q, k, v, pattern, scale, dropout, kv_for_q)
        if out is not None:
            return out
    mask, is_causal = pattern.full_mask(q.device)
    k, v, gqa = _expand_kv(q, k, v, kv_for_q, mask is not None)
    return sdpa(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal and q.shape[2] > 1, scale=scale, enable_gqa=gqa
    )


def unmasked(q, k, v, causal: bool, scale: float, kv_for_q=None) -> torch.Tensor:
    """SDPA with no mask (plain causal or bidirectional): q [b, h, s, d], k/v [b, h_kv, s, d]."""
    k, v, gqa = _expand_kv(q, k, v, kv_for_q, False)
    return sdpa(q, k, v, is_causal=causal and q.shape[2] > 1, scale=scale, enable_gqa=gqa)


# On CPU in half precision, SDPA's flash kernel loses to its math path (bf16 matmuls) on short keys: forward +
# backward, 4 heads of 64, 2 cores with AVX512-BF16, math / flash time 0.60 at 64 keys, 0.81 at 128, 1.25 at 256.
CPU_HALF_MATH_MAX_KEYS = 128


def sdpa(q, k, v, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, on the math path where that is faster (see above)."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and k.shape[-2] <= CPU_HALF_MATH_MAX_KEYS:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


DOCUMENT_WORK_RATIO = 8


def _buckets(docs: DocumentBatch) -> list[DocumentBatch]:
    """The documents grouped by length (up to 8 tokens, 16, 32, ...), each group padded to its own
    longest: attention work follows each document's length, not the batch's longest document's."""
    lq, lk = docs.q_valid.sum(1), docs.k_valid.sum(1)
    key = torch.ceil(torch.log2(torch.maximum(lq, lk).clamp(min=8).float())).long()
    if key.numel() == 0:
        return [docs]
    out = []
    for u in torch.unique(key).tolist():
        sel = (key == u).nonzero().flatten()
        mq, mk = int(lq[sel].max()), int(lk[sel].max())
        out.append(
            DocumentBatch(
                docs.q_index[sel, :mq], docs.q_valid[sel, :mq], docs.k_index[sel, :mk], docs.k_valid[sel, :mk]
            )
        )
    return out


def _by_document(q, k, v, pattern: Pattern, scale, dropout, kv_for_q):
    """Packed rows: gather the documents into batches of their own (grouped by length, `_buckets`),
    attend there, scatter back. Work and memory grow with the documents' lengths, not the row's. Taken
    when it does at least 8x less attention work than the row-long mask (the gathers and the scatter
    cost the rest)."""
    spec = pattern.spec
    if pattern.documents is MISSING:
        docs = DocumentBatch.build(spec.q, spec.k)
        buckets = None if docs is None else _buckets(docs)
        if (
            buckets is not None
            and DOCUMENT_WORK_RATIO * sum(d.q_valid.numel() * d.k_valid.shape[1] for d in buckets)
            > q.shape[0] * spec.q.plan.padded * spec.k.plan.padded
        ):
            buckets = None  # short rows: one row-long mask is cheaper
        plans = []
        for d in buckets or ():
            lq, lk = d.q_valid.shape[1], d.k_valid.shape[1]
            mask: str | torch.Tensor
            if spec.causal and spec.window is None:
                mask = "causal"  # padding sits at each document's end: causal queries never reach it
            else:
                mask = d.k_valid[:, None, None, :]  # [n, 1, 1, Lk]
                i, j = torch.arange(lq, device=q.device)[:, None], torch.arange(lk, device=q.device)[None, :]
                if spec.window is not None:  # causal: j <= i and i - j < w; bidirectional: |i - j| < w
                    mask = mask & ((j <= i) & (i - j < spec.window) if spec.causal else (i - j).abs() < spec.window)
            plans.append((d, mask, d.q_index[d.q_valid]))
        pattern.documents = (plans, torch.cat([index for _, _, index in plans])) if plans else None
    if pattern.documents is None:
        return None
    plans, q_rows = pattern.documents
    b, h, s_q, _ = q.shape
    causal = isinstance(plans[0][1], str)
    k, v, gqa = _expand_kv(q, k, v, kv_for_q, not causal)
    # [b, heads, s, d] -> [b * s, heads, d] once (v: its own width d_v); each group gathers its rows from there
    flat_q, flat_k, flat_v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (q, k, v))

    def gather(flat, index):  # -> [n, heads, L, d]
        return flat.index_select(0, index.flatten()).view(*index.shape, *flat.shape[1:]).transpose(1, 2)

    outs = []
    for docs, mask, _ in plans:
        out = sdpa(
            gather(flat_q, docs.q_index),
            gather(flat_k, docs.k_index),
            gather(flat_v, docs.k_index),
            attn_mask=None if causal else mask,
            dropout_p=dropout,
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
        )
        outs.append(out.transpose(1, 2)[docs.q_valid])  # [n, h, Lq, d] -> [real queries, h, d]
    d_v = v.shape[3]
    full = outs[0].new_zeros(b * s_q, h, d_v).index_copy(0, q_rows, torch.cat(outs))
    return full.view(b, s_q, h, d_v).transpose(1, 2)  # -> [b, h, s_q, d_v]


def _varlen(q, k, v, pattern: Pattern, scale, kv_for_q):
    """Packed / windowed self-attention on CUDA through the varlen flash kernel: documents (and runs
    of padding) become segments of one flattened batch, so no [s, s] mask exists. None if the pattern
    is not expressible that way (cross-attention, padding inside a document)."""
    spec = pattern.spec
    varlen_attn = _compat.varlen_attention()
    if varlen_attn is None or spec.q is not spec.k or spec.q.doc is None and spec.window is None:
        return None
    if (
        q.dtype not in (torch.float16, torch.bfloat16)
        or q.shape[-1] % 8
        or q.shape[-1] > 256
        or v.shape[-1] != q.shape[-1]
    ):
        return None  # flash kernels: half precision, one head dim (v's too) a multiple of 8 up to 256
    if pattern.segments is MISSING:
        pattern.segments = segments(spec.q)
    seg = pattern.segments
    if seg is None:
        return None
    cu, longest = seg
    b, h, s, d = q.shape
    if kv_for_q is not None:
        index = torch.tensor(kv_for_q, device=q.device)
        k, v = k.index_select(1, index), v.index_select(1, index)
    flat = [x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (q, k, v)]  # [b, h, s, d] -> [b*s, h, d]
    left = -1 if spec.window is None else spec.window - 1  # keys i - left .. i + right
    out = varlen_attn(*flat, cu, cu, longest, longest, scale=scale, window_size=(left, 0 if spec.causal else left))
    return out.view(b, s, h, d).transpose(1, 2)  # [b*s, h, d] -> [b, h, s, d]


# ---------------------------------------------------------------------------------------------
# Blocks with log-sum-exp, for ring attention: the forward returns (out, lse) so partial results
# over different key blocks can be merged; the backward recomputes from the final out and lse.
# Shapes: q/k [b, h, s, d], v [b, h, s_k, d_v] (its own width), bias [b, 1, s_q, s_k] additive (0 / -inf) or None,
# lse [b, h, s_q] fp32.


def _aligned_bias(bias: torch.Tensor) -> torch.Tensor:
    """CUDA's memory-efficient kernel wants the bias rows 16-element aligned: pad, then view."""
    s_k = bias.shape[-1]
    padded = (s_k + 15) // 16 * 16
    if padded == s_k:
        return bias.contiguous()
    out = bias.new_zeros((*bias.shape[:-1], padded))
    out[..., :s_k] = bias
    return out[..., :s_k]


FUSED_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the fused CPU kernel's backward takes


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and half precision, float64 for float64 (the sweep re-checks near misses there)."""
    return torch.promote_types(dtype, torch.float32)


def _fused(q):
    ops = _compat.ring_kernel_ops(q.device.type)
    return None if ops is None or (q.device.type == "cpu" and q.dtype not in FUSED_CPU_DTYPES) else ops


def _one_width(*xs: torch.Tensor) -> list[torch.Tensor]:
    """The CPU flash kernel takes q/k and v of one head width only ("Q/K/V should have the same head size";
    CUDA's memory-efficient kernel takes v's own): the narrower side gets zero columns, which add exact zeros
    to q.k and p.v (and to dO.O and dO.v^T in the backward); the caller drops the padded columns."""
    width = max(x.shape[-1] for x in xs)
    return [x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1])) for x in xs]  # [.., d] -> [.., width]


def block_forward(q, k, v, bias, causal: bool, scale: float, softcap: float | None = None, relative=None):
    """`relative` [1, h, s_q, s_k]: a learned additive bias (its gradient: `block_backward`'s fourth output)."""
    ops = None if softcap is not None or relative is not None else _fused(q)  # no fused kernel caps or learns
    if ops is None:
        return math_forward(q, k, v, bias, causal, scale, softcap, relative)
    if q.device.type == "cpu":
        out, lse = ops[0](*_one_width(q, k, v), 0.0, causal, attn_mask=bias, scale=scale)
        return out[..., : v.shape[-1]], lse
    b = None if bias is None else _aligned_bias(bias.expand(q.shape[0], q.shape[1], -1, -1))
    out, lse, _, _ = ops[0](q, k, v, b, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[2]].to(accumulation_dtype(q.dtype))


def block_backward(dout, q, k, v, out, lse, bias, causal: bool, scale: float, softcap=None, relative=None):
    """(dq, dk, dv) and, with `relative`, its gradient [h, s_q, s_k] (summed over the batch)."""
    ops = None if softcap is not None or relative is not None else _fused(q)
    if ops is None:
        return math_backward(dout, q, k, v, out, lse, bias, causal, scale, softcap, relative)
    if q.device.type == "cpu":
        d, d_v = q.shape[-1], v.shape[-1]
        dout, q, k, v, out = _one_width(dout, q, k, v, out)
        dq, dk, dv = ops[1](dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
        return dq[..., :d], dk[..., :d], dv[..., :d_v]
    b = None if bias is None else _aligned_bias(bias.expand(q.shape[0], q.shape[1], -1, -1))
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    # no bias: None (an undefined tensor); an empty one counts as given and fails the kernel's shape check
    dq, dk, dv, _ = ops[1](
        dout, q, k, v, b, out, lse.contiguous(), zero, zero, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


# The math kernels (soft-capping, float64, no fused kernel) go over query rows in chunks of at most this many
# score elements, so that a whole sequence's block (a ring of one under Ulysses) never holds [b, h, S, S] at once.
MATH_CHUNK_ELEMENTS = 1 << 25


def _row_chunks(q, k) -> list[slice]:
    rows = max(1, MATH_CHUNK_ELEMENTS // max(1, q.shape[0] * q.shape[1] * k.shape[2]))
    return [slice(i, min(i + rows, q.shape[2])) for i in range(0, q.shape[2], rows)]


def _scores(q, k, bias, causal, scale, softcap, row0: int, relative=None):
    """Scores [b, h, rows, s_k] in the accumulation dtype of query rows row0.. (q holds only those), and
    tanh(raw / softcap) (None without a cap) for the backward: soft-capping applies before the mask, as the
    models do; `causal`: key j is seen by query row i when j <= i (the blocks' top-left alignment)."""
    t = accumulation_dtype(q.dtype)
    s = torch.matmul(q.to(t), k.to(t).transpose(-1, -2)) * scale
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(s / softcap)
        s = tanh * softcap
    if relative is not None:
        s = s + relative.to(t)
    if bias is not None:
        s = s + bias.to(t)
    if causal:
        i = torch.arange(row0, row0 + s.shape[-2], device=s.device)[:, None]
        s = s.masked_fill(torch.arange(s.shape[-1], device=s.device)[None, :] > i, float("-inf"))
    return s, tanh


def _rows(bias, rows: slice):
    return None if bias is None else bias[..., rows, :]


def math_forward(q, k, v, bias, causal, scale, softcap=None, relative=None):
    outs, lses = [], []
    for rows in _row_chunks(q, k):
        s, _ = _scores(q[:, :, rows], k, _rows(bias, rows), causal, scale, softcap, rows.start, _rows(relative, rows))
        lse = torch.logsumexp(s, dim=-1).nan_to_num(neginf=0.0)  # [b, h, rows]
        outs.append(torch.matmul(torch.exp(s - lse[..., None]), v.to(s.dtype)).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def math_backward(dout, q, k, v, out, lse, bias, causal, scale, softcap=None, relative=None):
    t = accumulation_dtype(q.dtype)
    dqs, dk, dv = [], torch.zeros(k.shape, dtype=t, device=k.device), torch.zeros(v.shape, dtype=t, device=v.device)
    drel = []
    for rows in _row_chunks(q, k):
        qr = q[:, :, rows]
        s, tanh = _scores(qr, k, _rows(bias, rows), causal, scale, softcap, rows.start, _rows(relative, rows))
        p = torch.exp(s - lse[:, :, rows].to(t)[..., None])  # [b, h, rows, s_k]
        do = dout[:, :, rows].to(t)
        dv += torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, v.to(t).transpose(-1, -2))
        ds = p * (dp - (do * out[:, :, rows].to(t)).sum(-1, keepdim=True))
        if relative is not None:  # added after the cap: its gradient is the capped score's
            drel.append(ds.sum(0))
        if tanh is not None:  # d(c tanh(x / c)) / dx = 1 - tanh^2
            ds = ds * (1 - tanh * tanh)
        dqs.append(torch.matmul(ds, k.to(t)) * scale)
        dk += torch.matmul(ds.transpose(-1, -2), qr.to(t)) * scale
    grads = torch.cat(dqs, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    return grads if relative is None else (*grads, torch.cat(drel, dim=1))


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Online-softmax merge of two partial results over disjoint key sets, in `out`'s dtype (fp32, or
    float64 for float64 inputs).

    out/block_out [b, h, s, d], lse/block_lse [b, h, s] (-inf: the row saw no key). Rows that saw no
    key in either part stay 0 with lse -inf, without producing NaN.
    """
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w_old, w_new = torch.exp(lse - m), torch.exp(block_lse - m)  # [b, h, s]
    total = w_old + w_new
    safe = torch.where(total > 0, total, torch.ones_like(total))
    merged = (out * w_old[..., None] + block_out.to(out.dtype) * w_new[..., None]) / safe[..., None]
    return merged, m + torch.log(total)
