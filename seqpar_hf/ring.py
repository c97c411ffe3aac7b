"""Ring attention (Liu et al. 2023, arXiv 2310.01889; ring self-attention of Li et al. 2021,
arXiv 2105.13120), load-balanced for causal attention by zigzag sharding.

Each rank keeps its queries and passes its K/V block around the ring with batch_isend_irecv; the
transfer of the next block overlaps the attention on the current one. Partial results merge with a
log-sum-exp update in fp32. The backward is a second ring: K/V travel again, together with fp32
dK/dV accumulators that arrive home after the last step; block gradients are recomputed from the
final output and log-sum-exp. K/V travel with their own (grouped-query) head count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .local_attention import block_backward, block_forward, merge


@dataclass
class RingSpec:
    """What one ring attention call needs besides q, k, v (identical on every ring rank)."""

    group: object
    ranks: tuple[int, ...]  # global ranks in ring order
    index: int  # this rank's position in the ring
    q_index: torch.Tensor  # [s_q] global positions of the local queries
    k_index: list[torch.Tensor]  # per ring rank: [s_k] global positions of its keys
    key_mask: torch.Tensor | None  # [b, S_k] full key-padding mask (True = attend) or None
    causal: bool
    zigzag: bool  # causal sequences in zigzag order: chunks i and 2n-1-i per ring rank
    scale: float
    kv_for_q: tuple[int, ...] | None  # kv head of each query head, None for one to one


class _Ring:
    """Point-to-point exchange with the ring neighbours."""

    def __init__(self, spec: RingSpec):
        n = len(spec.ranks)
        self.group, self.next, self.prev = spec.group, spec.ranks[(spec.index + 1) % n], spec.ranks[(spec.index - 1) % n]

    def start(self, send: torch.Tensor):
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending):
        recv, works = pending
        for w in works:
            w.wait()
        return recv


def _block(spec: RingSpec, source: int, s_q: int, s_k: int):
    """(q rows, k cols, causal, bias-mask) of the work between local queries and ring rank
    `source`'s keys. Zigzag causal: own block causal; an earlier rank's block is seen whole by all
    queries through its first chunk; a later rank's block is seen whole by the second query chunk."""
    me = spec.index
    rows, cols, causal = slice(0, s_q), slice(0, s_k), False
    if spec.causal and spec.zigzag:
        if source == me:
            causal = True
        elif source < me:
            cols = slice(0, s_k // 2)
        else:
            rows = slice(s_q // 2, s_q)
    allowed = None
    k_idx = spec.k_index[source][cols]
    if spec.key_mask is not None:
        allowed = spec.key_mask.index_select(1, k_idx)[:, None, None, :]  # [b, 1, 1, s_k']
    if spec.causal and not spec.zigzag:  # general causal by global position (unbalanced)
        visible = spec.q_index[rows, None] >= k_idx[None, :]  # [s_q', s_k']
        allowed = visible if allowed is None else allowed & visible
    if allowed is not None and causal:
        n = rows.stop - rows.start
        allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()
        causal = False  # the bias carries it
    if allowed is not None and bool(allowed.all()):
        allowed = None
    return rows, cols, causal, allowed


def _bias(allowed: torch.Tensor | None, dtype, s_q: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Additive bias [b, 1, s_q, s_k] and row validity [b, 1, s_q] (False: the row sees no key)."""
    if allowed is None:
        return None, None
    allowed = allowed.expand(allowed.shape[0], 1, s_q, allowed.shape[-1])
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))
    return bias, allowed.any(-1)


def _expand(x: torch.Tensor, kv_for_q) -> torch.Tensor:
    return x if kv_for_q is None else x.index_select(1, kv_for_q)  # [b, h_kv, s, d] -> [b, h, s, d]


def _reduce(dx: torch.Tensor, kv_for_q, heads_kv: int) -> torch.Tensor:
    if kv_for_q is None:
        return dx
    out = dx.new_zeros((dx.shape[0], heads_kv, *dx.shape[2:]))
    return out.index_add_(1, kv_for_q, dx)  # [b, h, s, d] -> [b, h_kv, s, d]


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec: RingSpec):
        n, ring = len(spec.ranks), _Ring(spec)
        kv_index = None if spec.kv_for_q is None else torch.tensor(spec.kv_for_q, device=q.device)
        b, h, s_q, d = q.shape
        out = torch.zeros(b, h, s_q, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, s_q), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # [2, b, h_kv, s_k, d]: one message per step
        for step in range(n):
            pending = ring.start(kv) if step + 1 < n else None
            source = (spec.index - step) % n
            rows, cols, causal, allowed = _block(spec, source, s_q, k.shape[2])
            bias, valid = _bias(allowed, q.dtype, rows.stop - rows.start)
            kb, vb = _expand(kv[0][:, :, cols], kv_index), _expand(kv[1][:, :, cols], kv_index)
            o, l = block_forward(q[:, :, rows].contiguous(), kb.contiguous(), vb.contiguous(), bias, causal, spec.scale)
            if valid is not None:  # kernels report lse 0 for rows that saw no key: make it -inf
                l = l.masked_fill(~valid, float("-inf"))
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l)
            if pending is not None:
                kv = _Ring.wait(pending)
        out = out.to(q.dtype)
        lse = lse.masked_fill(torch.isinf(lse), 0.0)  # rows that saw no key at all: grads are 0 anyway
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.kv_index = spec, kv_index
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        spec, kv_index = ctx.spec, ctx.kv_index
        n, ring = len(spec.ranks), _Ring(spec)
        s_q, s_k, heads_kv = q.shape[2], k.shape[2], k.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # travels as in the forward
        carried = None  # pending fp32 dK/dV accumulator of the block held at this step
        for step in range(n):
            pending_kv = ring.start(kv) if step + 1 < n else None
            source = (spec.index - step) % n
            rows, cols, causal, allowed = _block(spec, source, s_q, s_k)
            bias, _ = _bias(allowed, q.dtype, rows.stop - rows.start)
            kb, vb = _expand(kv[0][:, :, cols], kv_index), _expand(kv[1][:, :, cols], kv_index)
            dq_b, dk_b, dv_b = block_backward(dout[:, :, rows], q[:, :, rows].contiguous(), kb.contiguous(),
                                              vb.contiguous(), out[:, :, rows].contiguous(),
                                              lse[:, :, rows].contiguous(), bias, causal, spec.scale)
            dq[:, :, rows] += dq_b.float()
            acc = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device) if carried is None \
                else _Ring.wait(carried)
            acc[0][:, :, cols] += _reduce(dk_b.float(), kv_index, heads_kv)
            acc[1][:, :, cols] += _reduce(dv_b.float(), kv_index, heads_kv)
            carried = ring.start(acc)  # to the next rank, who holds this block at the next step
            if pending_kv is not None:
                kv = _Ring.wait(pending_kv)
        dkv = _Ring.wait(carried)  # our own block's gradient, home after a full turn
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec) -> torch.Tensor:
    """q [b, h, s_q, d], k/v [b, h_kv, s_k, d] (this rank's blocks) -> [b, h, s_q, d]."""
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), spec)
