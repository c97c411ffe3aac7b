"""DeepSpeed-Ulysses attention (Jacobs et al. 2023, arXiv 2309.14509), with q, k and v in one exchange
and the exchanges overlapped with the kernel over chunks of heads (as HCMS does for inference, arXiv
2607.01817; here in the backward too).

Around the attention kernel, an all-to-all turns q/k/v from [all heads, 1/n of the sequence] into
[1/n of the heads, the full sequence], and one turns the output back. Head counts need not divide n
(ranks get h//n or h//n+1 heads, as in DeepSpeed's DistributedAttention), and grouped-query models
with fewer kv heads than ranks get the kv heads their query heads need (`heads.split_heads`).

`ulysses_attention` packs q, k and v by destination rank into one all-to-all (2 per layer forward,
2 backward, where exchanging them one by one takes 4 and 4; the same bytes). With `chunks` > 1 each
rank's heads go in that many parts: the exchange of part c+1 and the output exchange of part c-1
run while the kernel computes part c, forward and backward (`attention/pipeline.py`).
`ulysses_attention_separate` is the one-by-one exchange, kept as the reference the benchmarks race.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..parallel.comm import group_size, heads_to_seq, seq_to_heads
from .heads import HeadSplit, chunk_plan, max_chunks, split_heads
from .pipeline import Exchange, Land, OutLand, OutSend, Pack, Send

__all__ = ["HeadSplit", "split_heads", "ulysses_attention", "ulysses_attention_separate", "auto_chunks"]

# Smallest all-to-all (bytes one rank sends, per chunk) worth an extra exchange, per device type; none
# listed: one chunk. CPU (gloo) has none: gloo's asynchronous exchange does run on its own threads (the
# call returns in ~1% of the exchange's time), but those copy memory on the cores the kernel uses
# (benchmarks/overlap.py on 2 cores: (a) at most ~0.3-0.7 of an exchange hidden, often less than none;
# (b) 2 or 4 chunks no consistent gain over one, 3-11% slower at 1K tokens). CUDA: an NCCL exchange
# runs on the links while the SMs compute; 8 MiB per chunk keeps each chunk's all-to-all well above its
# launch latency (untested: overlap needs >= 2 GPUs; benchmarks/gpu_chunks.py measures the kernel side).
MIN_CHUNK_BYTES = {"cuda": 8 << 20}
MAX_AUTO_CHUNKS = 4


def auto_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> int:
    """Chunks for this exchange by its size: 1 unless every chunk still sends MIN_CHUNK_BYTES."""
    floor = MIN_CHUNK_BYTES.get(q.device.type)
    if floor is None:
        return 1
    sent = (q.numel() + k.numel() + v.numel()) * q.element_size() * (n - 1) // n  # what leaves this rank
    return max(1, min(MAX_AUTO_CHUNKS, max_chunks(q.shape[1], n), sent // floor))


def _kv_for_chunk(parts: list[torch.Tensor], plan, rank: int, c: int) -> torch.Tensor:
    """k (or v) heads chunk c's kernel uses, from the chunks that carried them: [b, use, s, d]."""
    use = plan.pieces[c][rank].kv_use
    pieces = []
    for i in range(c + 1):
        new = plan.pieces[i][rank].kv_new
        lo, hi = max(use[0], new[0]), min(use[1], new[1])
        if lo < hi:
            pieces.append(parts[i][:, lo - new[0] : hi - new[0]])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    rank: int,
    inner: Callable[..., torch.Tensor],
    chunks: int = 1,
) -> torch.Tensor:
    """query [b, h, s_q/n, d], key [b, h_kv, s_k/n, d], value [b, h_kv, s_k/n, d_v] -> [b, h, s_q/n, d_v].

    `inner(q, k, v, kv_for_q, heads)` computes attention over the full sequence for some of this rank's
    heads (the local kernel, or a ring across Ulysses groups in hybrid mode); `kv_for_q` is a tuple
    giving each query head's kv head, or None for one to one; `heads` the global query heads [lo, hi)
    (for per-head parameters such as sinks). It is called once per chunk.
    """
    n = group_size(group)
    if n == 1:
        rep = query.shape[1] // key.shape[1]
        kv_for_q = None if rep == 1 else tuple(i // rep for i in range(query.shape[1]))
        return inner(query, key, value, kv_for_q, (0, query.shape[1]))
    plan = chunk_plan(query.shape[1], key.shape[1], n, chunks)
    b, _, s_q, d = query.shape
    s_k, d_v = key.shape[2], value.shape[3]  # v's width may differ from q/k's (multi-head latent attention)
    per_q, per_kv = b * s_q * d, b * s_k * (d + d_v)  # elements of one q head's rows, of one k and v head's
    sends = Pack.apply(query, key, value, plan)  # per chunk: flat, grouped by destination
    tokens_in = [Exchange() for _ in range(plan.chunks)]
    tokens_out = [Exchange() for _ in range(plan.chunks)]

    def rows(c):  # (elements to each rank, elements from each rank) of chunk c
        mine = plan.pieces[c][rank]
        return (
            [p.heads * per_q + p.kv_heads * per_kv for p in plan.pieces[c]],
            [mine.heads * per_q + mine.kv_heads * per_kv] * n,
        )

    pending = Send.apply(sends[0], *rows(0), group, tokens_in[0])
    ks, vs, outs = [], [], []
    for c in range(plan.chunks):
        mine = plan.pieces[c][rank]
        dims = (n, mine.heads, mine.kv_heads, b, s_q, s_k, d, d_v)
        q, k, v = Land.apply(pending, tokens_in[c], dims, *rows(c), group)  # [b, m, s_q, d], [b, m_kv, s_k, d / d_v]
        if c + 1 < plan.chunks:  # in flight while this chunk's kernel runs
            pending = Send.apply(sends[c + 1], *rows(c + 1), group, tokens_in[c + 1])
        ks.append(k)
        vs.append(v)
        out = inner(q, _kv_for_chunk(ks, plan, rank, c), _kv_for_chunk(vs, plan, rank, c), mine.kv_for_q, mine.q)
        outs.append(OutSend.apply(out, n, [mine.heads] * n, [p.heads for p in plan.pieces[c]], group, tokens_out[c]))
    return OutLand.apply(plan, rank, group, tokens_out, *outs)  # [b, h, s_q/n, d_v]


def ulysses_attention_separate(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group, rank: int, inner: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """The same result with q, k, v and the output exchanged one by one (4 all-to-alls forward, 4
    backward): the path before the fused one, kept for the benchmarks."""
    split = split_heads(query.shape[1], key.shape[1], group_size(group))
    q = seq_to_heads(query, list(split.q_sizes), group)  # [b, h, s_q, d] -> [b, h_r, n s_q, d]
    if split.kv_send is not None:  # GQA: pick (and replicate) the kv heads each rank needs
        send = torch.tensor(split.kv_send, device=key.device)
        key, value = key.index_select(1, send), value.index_select(1, send)  # [b, sum(kv_sizes), s_k, d]
    k = seq_to_heads(key, list(split.kv_sizes), group)  # -> [b, kv_r, n s_k, d]
    v = seq_to_heads(value, list(split.kv_sizes), group)
    start = sum(split.q_sizes[:rank])
    out = inner(q, k, v, split.kv_for_q[rank], (start, start + split.q_sizes[rank]))  # [b, h_r, n s_q, d]
    return heads_to_seq(out, list(split.q_sizes), group)  # -> [b, h, s_q, d]
