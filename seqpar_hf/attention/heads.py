"""Which heads go where in a Ulysses exchange: pure arithmetic, no process group.

`split_heads`: how q and kv heads are spread over the n ranks of a Ulysses group (uneven head
counts allowed; grouped-query kv heads replicated only where a rank's query heads need them).
`chunk_plan`: each rank's heads cut into `chunks` parts, exchanged one part at a time so that the
all-to-all of part c+1 runs while the kernel computes part c (`attention/ulysses.py`). A part carries
the query heads of every rank's chunk c and the kv heads those need that no earlier part carried, so
the chunks together move exactly the bytes of one exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch


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
        raise ValueError(
            f"Ulysses over {n} ranks needs at least {n} attention heads, the model has {num_heads}; "
            f"use mode='hybrid' with ring_size so that sp_size // ring_size <= {num_heads}, or mode='ring'"
        )
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
    return HeadSplit(
        q_sizes, tuple(len(x) for x in kv_ranges), None if send == tuple(range(num_kv_heads)) else send, tuple(kv_for_q)
    )


@dataclass(frozen=True)
class Piece:
    """What one chunk carries for one destination rank j (the same from every source rank)."""

    q: tuple[int, int]  # query heads [lo, hi), global
    kv: tuple[int, int]  # kv heads first needed in this chunk, [lo, hi) in `HeadSplit.kv_send` order
    q_local: tuple[int, int]  # the same query heads in j's local numbering
    kv_new: tuple[int, int]  # the same kv heads in j's local numbering
    kv_use: tuple[int, int]  # j's local kv heads its kernel uses on this chunk
    kv_for_q: tuple[int, ...] | None  # per query head of the chunk: index into kv_use; None: one to one

    @property
    def heads(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def kv_heads(self) -> int:
        return self.kv[1] - self.kv[0]


@dataclass(frozen=True)
class Run:
    """A run of consecutive heads of q (kind 0), k (1) or v (2) in a chunk's send buffer."""

    kind: int
    lo: int  # source heads [lo, hi): global q heads, or global kv heads
    hi: int
    before: tuple[int, int, int]  # head rows of q, k and v before it in the buffer (each kind its own row size)


@dataclass(frozen=True)
class ChunkPlan:
    split: HeadSplit
    pieces: tuple[tuple[Piece, ...], ...]  # [chunk][destination rank]
    kv_rows: int  # sum(split.kv_sizes): kv heads sent, replicas counted
    runs: tuple[tuple[Run, ...], ...] = ()  # [chunk]: the send buffer, run by run (destination j's q, k, v, ...)
    order: tuple[tuple[tuple[int, int], ...], ...] = ()  # [kind]: (chunk, run) in q head / kv send-row order
    _index: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def chunks(self) -> int:
        return len(self.pieces)

    def kv_send_index(self, device) -> torch.Tensor:
        """`split.kv_send` as a tensor on `device`, made once (not one host-to-device copy per layer)."""
        if device not in self._index:
            self._index[device] = torch.tensor(self.split.kv_send, device=device)
        return self._index[device]


def max_chunks(num_heads: int, n: int) -> int:
    """Every rank needs at least one query head per chunk."""
    return max(num_heads // n, 1)


@lru_cache(maxsize=256)
def chunk_plan(num_heads: int, num_kv_heads: int, n: int, chunks: int = 1) -> ChunkPlan:
    split = split_heads(num_heads, num_kv_heads, n)
    if not 1 <= chunks <= max_chunks(num_heads, n):
        raise ValueError(
            f"head_chunks={chunks}: each of the {n} Ulysses ranks holds at least "
            f"{min(split.q_sizes)} of the {num_heads} heads; use 1..{max_chunks(num_heads, n)}"
        )
    rep = num_heads // num_kv_heads
    pieces: list[list[Any]] = [[None] * n for _ in range(chunks)]  # [chunk][rank]: every slot is filled below
    q_start = kv_row = 0
    for j in range(n):
        hq, first = split.q_sizes[j], q_start // rep
        kv_of = [(q_start + i) // rep - first for i in range(hq)]  # local kv head of each local q head
        lo = done = 0  # `done`: local kv heads carried by earlier chunks
        for c in range(chunks):
            hi = lo + hq // chunks + (c < hq % chunks)
            use = (kv_of[lo], kv_of[hi - 1] + 1)
            rel = tuple(x - use[0] for x in kv_of[lo:hi])
            new = (done, use[1])
            pieces[c][j] = Piece(
                (q_start + lo, q_start + hi),
                (kv_row + new[0], kv_row + new[1]),
                (lo, hi),
                new,
                use,
                None if rel == tuple(range(hi - lo)) else rel,
            )
            lo, done = hi, use[1]
        q_start += hq
        kv_row += split.kv_sizes[j]
    runs: list[list[Run]] = []
    keys: tuple[list, list, list] = ([], [], [])
    for c, chunk in enumerate(pieces):
        runs.append([])
        before = [0, 0, 0]
        for p in chunk:
            g0 = p.kv[0] if split.kv_send is None or not p.kv_heads else split.kv_send[p.kv[0]]  # global kv head
            for kind, (lo, hi), dest in (
                (0, p.q, p.q[0]),
                (1, (g0, g0 + p.kv_heads), p.kv[0]),
                (2, (g0, g0 + p.kv_heads), p.kv[0]),
            ):
                if hi > lo:
                    keys[kind].append((dest, c, len(runs[c])))
                    runs[c].append(Run(kind, lo, hi, (before[0], before[1], before[2])))
                    before[kind] += hi - lo
    order = tuple(tuple((c, i) for _, c, i in sorted(k)) for k in keys)
    return ChunkPlan(split, tuple(tuple(p) for p in pieces), kv_row, tuple(tuple(r) for r in runs), order)
