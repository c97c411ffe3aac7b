"""Tier 1 (no process group): the head arithmetic of the fused, chunked Ulysses exchange
(seqpar_hf/attention/heads.py), its packing (`pipeline.Pack`, a pure copy), the chunk-count rule, and
mode="auto"'s choice (seqpar_hf/parallel/auto.py)."""

from __future__ import annotations

import pytest
import torch

from seqpar_hf.attention.heads import chunk_plan, max_chunks, split_heads
from seqpar_hf.attention.pipeline import Pack
from seqpar_hf.attention.ulysses import MIN_CHUNK_BYTES, auto_chunks
from seqpar_hf.parallel.auto import choose
from seqpar_hf.parallel.layout import ParallelLayout, validate_sizes

SHAPES = [(8, 2, 2), (8, 2, 4), (6, 2, 4), (12, 4, 8), (5, 1, 2), (4, 1, 4), (10, 2, 4), (7, 7, 3), (32, 8, 8)]


def _plans():
    return [(h, g, n, c) for h, g, n in SHAPES for c in range(1, max_chunks(h, n) + 1)]


@pytest.mark.parametrize("h,g,n,chunks", _plans())
def test_chunks_carry_every_head_once_and_the_kv_heads_a_rank_needs(h, g, n, chunks):
    plan, split = chunk_plan(h, g, n, chunks), split_heads(h, g, n)
    assert plan.chunks == chunks and plan.kv_rows == sum(split.kv_sizes)
    for j in range(n):
        pieces = [plan.pieces[c][j] for c in range(chunks)]
        q = [i for p in pieces for i in range(*p.q)]
        assert q == list(range(sum(split.q_sizes[:j]), sum(split.q_sizes[: j + 1])))  # in order, once each
        rows = [r for p in pieces for r in range(*p.kv)]
        assert rows == list(range(sum(split.kv_sizes[:j]), sum(split.kv_sizes[: j + 1])))  # no kv head twice
        assert all(p.heads >= 1 for p in pieces)  # every rank computes in every chunk
        for c, p in enumerate(pieces):
            carried = {t for earlier in pieces[: c + 1] for t in range(*earlier.kv_new)}
            assert set(range(*p.kv_use)) <= carried  # a chunk's kernel has its kv heads by then
            local = split.kv_for_q[j] or tuple(range(split.q_sizes[j]))
            want = tuple(local[i] - p.kv_use[0] for i in range(*p.q_local))
            assert (p.kv_for_q or tuple(range(p.heads))) == want


@pytest.mark.parametrize("h,g,n", SHAPES)
def test_one_chunk_is_the_plain_split(h, g, n):
    plan, split = chunk_plan(h, g, n, 1), split_heads(h, g, n)
    for j, p in enumerate(plan.pieces[0]):
        assert (p.heads, p.kv_heads, p.kv_for_q) == (split.q_sizes[j], split.kv_sizes[j], split.kv_for_q[j])


def test_chunk_count_is_refused_beyond_the_heads_of_a_rank():
    with pytest.raises(ValueError, match="head_chunks=3: each of the 4 Ulysses ranks holds at least 2 .* use 1..2"):
        chunk_plan(10, 2, 4, 3)


@pytest.mark.parametrize("h,g,n,chunks", [(8, 2, 4, 2), (6, 2, 4, 1), (12, 4, 8, 1), (5, 1, 2, 2), (10, 2, 4, 2)])
@pytest.mark.parametrize("s_k,d_v", [(5, 4), (3, 6), (5, 2)])  # s_k != s_q: cross-attention; d_v != d: MLA's v
def test_pack_is_a_copy_and_its_backward_its_inverse(h, g, n, chunks, s_k, d_v):
    """The send buffers hold exactly the heads each destination needs; fed back as gradients they
    give q, k, v again, with kv heads sent to several ranks counted once per copy."""
    plan, split = chunk_plan(h, g, n, chunks), split_heads(h, g, n)
    b, s_q, d = 2, 3, 4
    q, k, v = torch.randn(b, h, s_q, d), torch.randn(b, g, s_k, d), torch.randn(b, g, s_k, d_v)
    sends = Pack.apply(q, k, v, plan)
    assert sum(x.numel() for x in sends) == b * (h * s_q * d + sum(split.kv_sizes) * s_k * (d + d_v))
    first = sends[0][: plan.pieces[0][0].heads * b * s_q * d].view(-1, b, s_q, d)
    assert torch.equal(first, q.transpose(0, 1)[: plan.pieces[0][0].heads])
    dq, dk, dv, _ = Pack.backward(type("ctx", (), {"plan": plan, "shapes": (q.shape, k.shape, v.shape)})(), *sends)
    copies = torch.bincount(torch.tensor(split.kv_send or range(g)), minlength=g).float()[None, :, None, None]
    assert torch.equal(dq, q)
    assert torch.allclose(dk, k * copies) and torch.allclose(dv, v * copies)


def test_auto_chunks_by_size(monkeypatch):
    n = 2
    kv = torch.empty(1, 8, 1 << 14, 128)
    assert auto_chunks(torch.empty(1, 32, 1 << 14, 128), kv, kv, n) == 1  # CPU: never
    monkeypatch.setitem(MIN_CHUNK_BYTES, "meta", 8 << 20)
    small = torch.empty(1, 32, 256, 128, device="meta")
    assert auto_chunks(small, small[:, :8], small[:, :8], n) == 1  # latency-bound: one exchange
    mid = torch.empty(1, 32, 4096, 128, device="meta")  # (32 + 16) heads x 4096 x 128 x 4 B / 2 = 48 MiB sent
    assert auto_chunks(mid, mid[:, :8], mid[:, :8], n) == 4  # capped by MAX_AUTO_CHUNKS
    assert auto_chunks(mid[:, :, :1024], mid[:, :8, :1024], mid[:, :8, :1024], n) == 1  # 12 MiB: one chunk of 8 MiB
    assert auto_chunks(mid[:, :2], mid[:, :2], mid[:, :2], 2) == 1  # one head per rank: nothing to split
    # a v narrower than q / k (latent attention) counts as it is: (16 + 4 + 4 / 2) heads x 4 MiB / 2 = 22 MiB
    assert auto_chunks(mid[:, :16], mid[:, :4], mid[:, :4, :, :64], n) == 2


@pytest.mark.parametrize(
    "sp,heads,per_node,tp,want",
    [
        (8, [(32, 8)], 8, 1, ("ulysses", None)),
        (8, [(32, 4)], 8, 1, ("ulysses", None)),  # kv < sp: replicated, still Ulysses (ringmaster: 4 x ring 2)
        (8, [(12, 4)], 8, 1, ("hybrid", 2)),  # 12 heads over 8 ranks: 1.33x on the busiest; 4 x ring 2
        (16, [(32, 8)], 8, 1, ("hybrid", 2)),  # Ulysses stays inside a node
        (8, [(4, 2)], 8, 1, ("hybrid", 2)),  # fewer heads than ranks
        (4, [(5, 1)], 4, 1, ("ring", None)),
        (4, [(8, 2)], 4, 2, ("hybrid", 2)),  # TP takes 2 of the 4 ranks of a node
        (2, [(4, 2), (6, 6)], 2, 1, ("ulysses", None)),  # several attention kinds: every one counts
    ],
)
def test_auto_choice(sp, heads, per_node, tp, want):
    c = choose(sp, heads, per_node, tp)
    assert (c.mode, c.ring_size) == want, c.reason
    assert f"sp={sp}" in c.reason and "ranks per node" in c.reason


def test_auto_layout_sizes_and_refusals():
    assert validate_sizes(8, 4, "auto").dp_size == 2
    with pytest.raises(ValueError, match="mode='auto' chooses the ring size itself"):
        validate_sizes(4, 4, "auto", 2)
    layout = ParallelLayout(sp_size=1, mode="auto")  # nothing to choose without SP
    assert layout.mode == "ulysses" and not layout.enabled
    with pytest.raises(ValueError, match=r"^head_chunks=0 \(--sp_head_chunks\): use 'auto' or a positive integer"):
        ParallelLayout(sp_size=1, head_chunks=0)


def test_sp_head_chunks_argument(tmp_path):
    from seqpar_hf import SequenceParallelArguments

    args = SequenceParallelArguments(output_dir=str(tmp_path), sp_head_chunks="2", use_cpu=True, report_to=[])
    assert args.head_chunks() == 2
    assert SequenceParallelArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]).head_chunks() == "auto"
    for bad, shown in (("0", "0"), ("two", "'two'")):  # one check, one message: the layout's
        with pytest.raises(ValueError, match=rf"^head_chunks={shown} \(--sp_head_chunks\): use 'auto' or a positive"):
            SequenceParallelArguments(output_dir=str(tmp_path), sp_head_chunks=bad, use_cpu=True, report_to=[])
