"""DeepSpeed-Ulysses attention (Jacobs et al. 2023, arXiv 2309.14509).

Around the attention kernel, one all-to-all turns q/k/v from [all heads, 1/n of the sequence] into
[1/n of the heads, the full sequence], and one turns the output back: 4 all-to-alls per layer
forward and 4 backward. Head counts need not divide n (ranks get h//n or h//n+1 heads, as in
DeepSpeed's DistributedAttention), and grouped-query models with fewer kv heads than ranks get the
kv heads their query heads need (replicated across ranks only when they must be).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from ..parallel.comm import group_size, heads_to_seq, seq_to_heads


@dataclass(frozen=True)
class HeadSplit:
    """How q and kv heads are spread over the n ranks of a Ulysses group."""

    q_sizes: tuple[int, ...]  # query heads per rank
    kv_sizes: tuple[int, ...]  # kv heads each rank receives
    kv_send: tuple[int, ...] | None  # kv heads to send, grouped by destination; None: arange (no copy)
    kv_for_q: tuple[tuple[int, ...] | None, ...]  # per rank: kv head (local index) of each local q head


@lru_cache(maxsize=64)
def split_heads(num_heads: int, num_kv_heads: int, n: int) -> HeadSplit:
    if num_heads < n:
        raise ValueError(f"Ulysses over {n} ranks needs at least {n} attention heads, the model has {num_heads}; "
                         f"use mode='hybrid' with ring_size so that sp_size // ring_size <= {num_heads}, or mode='ring'")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    rep = num_heads // num_kv_heads
    q_sizes = tuple(num_heads // n + (r < num_heads % n) for r in range(n))
    starts = [sum(q_sizes[:r]) for r in range(n)]
    kv_ranges, kv_for_q = [], []
    for r in range(n):
        first, last = starts[r] // rep, (starts[r] + q_sizes[r] - 1) // rep  # kv heads this rank's q heads use
        kv_ranges.append(range(first, last + 1))
        local = tuple((starts[r] + i) // rep - first for i in range(q_sizes[r]))
        kv_for_q.append(None if len(local) == last + 1 - first else local)
    send = tuple(h for rng in kv_ranges for h in rng)
    return HeadSplit(q_sizes, tuple(len(x) for x in kv_ranges),
                     None if send == tuple(range(num_kv_heads)) else send, tuple(kv_for_q))


def _index(values: tuple[int, ...] | None, device) -> torch.Tensor | None:
    return None if values is None else torch.tensor(values, device=device)


def ulysses_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group, rank: int,
                      inner: Callable[..., torch.Tensor]) -> torch.Tensor:
    """query [b, h, s_q/n, d], key/value [b, h_kv, s_k/n, d] -> [b, h, s_q/n, d].

    `inner(q, k, v, kv_for_q)` computes attention over the full sequence for this rank's heads
    (the local kernel, or a ring across Ulysses groups in hybrid mode); `kv_for_q` is a tuple giving
    each local query head's local kv head, or None for one to one.
    """
    split = split_heads(query.shape[1], key.shape[1], group_size(group))
    q = seq_to_heads(query, list(split.q_sizes), group)  # [b, h, s_q/n, d] -> [b, h_r, s_q, d]
    send = _index(split.kv_send, key.device)
    if send is not None:  # GQA: pick (and replicate) the kv heads each rank needs
        key, value = key.index_select(1, send), value.index_select(1, send)  # [b, sum(kv_sizes), s_k/n, d]
    k = seq_to_heads(key, list(split.kv_sizes), group)  # -> [b, kv_r, s_k, d]
    v = seq_to_heads(value, list(split.kv_sizes), group)
    out = inner(q, k, v, split.kv_for_q[rank])  # [b, h_r, s_q, d]
    return heads_to_seq(out, list(split.q_sizes), group)  # -> [b, h, s_q/n, d]

