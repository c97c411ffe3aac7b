"""In-rank bodies of tests/test_ring_gloo.py: ring attention numerics at the function level (world 4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import seqpar_hf
from seqpar_hf.attention.masks import MaskSpec, SeqMeta
from seqpar_hf.attention.ring import RingPlan, ring_attention
from seqpar_hf.parallel.comm import all_gather_cat
from seqpar_hf.parallel.sharding import ShardPlan


def _ring_on_shards(q, k, v, key_mask, causal, layout):
    """Run ring attention over the ring group with this rank's zigzag shards of full q, k, v;
    return (gathered output, gathered dq, dk, dv) in full sequence order."""
    n = layout.sp_size
    plan = ShardPlan.build(q.shape[2], n, layout.sp_rank, n, zigzag=causal)
    idx = plan.global_index()
    shard = [x.index_select(2, idx).detach().requires_grad_() for x in (q, k, v)]
    meta = SeqMeta(plan, key_mask, None)
    ring = RingPlan.build(
        MaskSpec(meta, meta, causal),
        layout.ring_group,
        layout.ring_ranks,
        layout.ring_rank,
        plan.ring_index(layout.ring_rank),
        [plan.ring_index(j) for j in range(n)],
    )
    out = ring_attention(*shard, ring, q.shape[-1] ** -0.5)
    g = torch.Generator().manual_seed(7)
    grad_out = torch.randn(q.shape, generator=g).to(q.dtype).index_select(2, idx)
    out.backward(grad_out)
    gathered = [
        plan.unshard(all_gather_cat(t.detach(), layout.sp_group, dim=2), dim=2)
        for t in (out, shard[0].grad, shard[1].grad, shard[2].grad)
    ]
    return gathered


def _reference(q, k, v, key_mask, causal, dtype):
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    mask = None if key_mask is None else key_mask[:, None, None, :]
    if causal:
        tril = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
        mask = tril if mask is None else mask & tril
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    g = torch.Generator().manual_seed(7)
    out.backward(torch.randn(q.shape, generator=g).to(dtype))
    return [t.detach().double() for t in (out, q.grad, k.grad, v.grad)]


def _err(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _bf16_errors():
    layout = seqpar_hf.ParallelLayout(sp_size=4, mode="ring")
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 64, 32
    q, k, v = (torch.randn(b, h, s, d) * 2 for _ in range(3))  # larger logits stress the merge
    exact = _reference(q, k, v, None, True, torch.float64)
    plain = _reference(q, k, v, None, True, torch.bfloat16)
    ring = _ring_on_shards(q.bfloat16(), k.bfloat16(), v.bfloat16(), None, True, layout)
    return [(_err(p, e), _err(r, e)) for p, r, e in zip(plain, ring, exact)]


def _masked_rows():
    layout = seqpar_hf.ParallelLayout(sp_size=4, mode="ring")
    torch.manual_seed(1)
    b, h, s, d = 2, 2, 16, 8
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    key_mask = torch.ones(b, s, dtype=torch.bool)
    key_mask[0] = False  # sample 0: every key masked, on every ring step
    key_mask[1, :9] = False  # sample 1: rows whose keys are all masked on some steps
    results = {}
    for causal in (False, True):
        ring = _ring_on_shards(q, k, v, key_mask, causal, layout)
        exact = _reference(q, k, v, key_mask, causal, torch.float32)
        results[causal] = {
            "finite": all(bool(torch.isfinite(t).all()) for t in ring),
            "sample0_zero": bool((ring[0][0] == 0).all()),
            "errors": [_err(r[1], e[1]) for r, e in zip(ring, exact)],
        }
    return results


def all_checks():
    return {"bf16": _bf16_errors(), "masked": _masked_rows()}
