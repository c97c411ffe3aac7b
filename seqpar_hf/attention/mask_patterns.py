"""Which attention pattern a model asks for, read off what it hands transformers' mask interface (a mask
function) or, failing that, off a mask tensor, so that patterns are decided by what the code computes.

Patterns the sharded kernels reproduce (`MaskSpec`): bidirectional, causal, causal sliding window
(i - j < w), bidirectional sliding window (|i - j| < w) and causal chunks (a query sees its own chunk of C
tokens up to itself: `Chunks(C)` in the window's place). A pattern is (causal, window), window None for
none. Anything else (blockwise, prefix, masks that depend on the input) reads as None.
"""

from __future__ import annotations

import torch

from .masks import Chunks

Pattern = tuple  # (causal: bool, window: int | None)
_FAR = 1 << 40  # distances probed for a window: far beyond any sequence length
_GRID = 24  # the square grid every candidate pattern is checked on (plus the window's edges)


def canonical(causal: bool, window, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The pattern's allowed (query, key) pairs at these indices (broadcast)."""
    allowed = kv <= q if causal else torch.ones_like(q - kv, dtype=torch.bool)
    if window is not None:
        allowed = allowed & ((q - kv).abs() < window)
    return allowed


def _call(fn, q, kv) -> torch.Tensor | None:
    try:
        out = fn(torch.tensor(0), torch.tensor(0), q, kv)
        return torch.as_tensor(out).bool().expand(torch.broadcast_shapes(q.shape, kv.shape))
    except Exception:  # noqa: BLE001 - a function that cannot be evaluated on indices is not readable
        return None


def _reach(fn, sign: int) -> int | None:
    """The smallest distance d >= 1 such that the query does not see the key d tokens away (sign +1:
    in the past, -1: in the future); None if it sees keys as far as _FAR. Binary search on scalars."""

    def sees(d: int) -> bool | None:
        q, kv = (torch.tensor(d), torch.tensor(0)) if sign > 0 else (torch.tensor(0), torch.tensor(d))
        out = _call(fn, q, kv)
        return None if out is None or out.numel() != 1 else bool(out)

    far = sees(_FAR)
    if far is None:
        return -1
    if far:
        return None
    lo, hi = 0, _FAR  # sees(lo) is true (distance 0 is checked by the grid), sees(hi) false
    while hi - lo > 1:
        mid = (lo + hi) // 2
        seen = sees(mid)
        if seen is None:
            return -1
        lo, hi = (mid, hi) if seen else (lo, mid)
    return hi


def read_function(mask_function) -> Pattern | None:
    """(causal, window) of a mask function, or None when it is none of the supported patterns."""
    past, future = _reach(mask_function, 1), _reach(mask_function, -1)
    if past == -1 or future == -1:
        return None
    causal = future == 1
    if causal:
        window = past
    elif past != future:
        return None
    else:
        window = past
    idx = torch.arange(_GRID)
    edges = [] if window is None else [window - 1, window, window + 1]
    q = torch.cat([idx, torch.tensor([e + 3 for e in edges], dtype=torch.long)])[:, None]
    kv = torch.cat([idx, torch.tensor([3] * len(edges), dtype=torch.long)])[None, :]
    got = _call(mask_function, q, kv)
    if got is None or not torch.equal(got, canonical(causal, window, q, kv)):
        chunks = read_chunks(mask_function) if causal else None
        return None if chunks is None else (True, chunks)
    return causal, window


def _sees(fn, q: int, kv: int) -> bool | None:
    out = _call(fn, torch.tensor(q), torch.tensor(kv))
    return None if out is None or out.numel() != 1 else bool(out)


def _chunk_start(fn, x: int) -> int | None:
    """The first key query x sees (causal chunks: the keys it sees are one run ending at x), by bisection."""
    if not _sees(fn, x, x):
        return None
    lo, hi = -1, x  # the answer lies in (lo, hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        seen = _sees(fn, x, mid)
        if seen is None:
            return None
        lo, hi = (lo, mid) if seen else (mid, hi)
    return hi


def chunk_offset(fn, size: int, row: int = 0) -> int | None:
    """Where chunks of `size` start in batch row `row` (an index mod `size`), read far from index 0."""
    x = 1 << 30
    start = _chunk_start(lambda b, h, q, kv: fn(torch.tensor(row), h, q, kv), x)
    return None if start is None else start % size


def chunks_follow_padding(mask_function, size: int, attention_mask, batch_size: int) -> bool:
    """Whether every row's chunks start at its first real token (past the left padding of the 2D
    `attention_mask` the mask function was made for; None: none), as `masks.chunked` counts them."""
    for row in range(batch_size):
        lead = 0 if attention_mask is None else int((attention_mask[row].long().cumsum(-1) == 0).sum())
        if chunk_offset(mask_function, size, row) != lead % size:
            return False
    return True


def _chunk(index: torch.Tensor, size: int) -> torch.Tensor:
    return torch.div(index, size, rounding_mode="floor")


def read_chunks(mask_function) -> Chunks | None:
    """Chunks(C) if `mask_function` is causal attention within chunks of C tokens (at any offset: transformers
    counts them past the row's left padding), read far from index 0 and checked on a grid around three
    chunk boundaries; None otherwise."""
    x = 1 << 30
    second = _chunk_start(mask_function, x)
    if second is None or second == 0:
        return None
    first = _chunk_start(mask_function, second - 1)
    if first is None or first >= second:
        return None
    size = second - first
    offset = second % size
    near = [d for d in range(-2, 3)] + [size // 2]
    boundaries = {first + k * size + d for k in range(-1, 3) for d in near}
    idx = sorted(boundaries | {first + d for d in range(min(size, _GRID))})
    q = torch.tensor(idx, dtype=torch.long)[:, None]
    kv = torch.tensor(idx, dtype=torch.long)[None, :]
    got = _call(mask_function, q, kv)
    want = (kv <= q) & (_chunk(q - offset, size) == _chunk(kv - offset, size))
    return Chunks(size) if got is not None and torch.equal(got, want) else None


def read_tensor(mask: torch.Tensor, valid_k: torch.Tensor, rows: torch.Tensor) -> Pattern | None:
    """(causal, window) of a [b, 1 or h, s_q, s_k] mask tensor (bool: True = attend; float: additive 0 /
    large negative) given the real keys `valid_k` [b, s_k] and the query rows to read `rows` [b, s_q]
    (real tokens); None if it matches no supported pattern. A window as long as the sequence or longer
    is read as none (only a mask function can show it)."""
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    if not mask.dtype == torch.bool and bool((mask[allowed] != 0).any()):
        return None  # an additive bias (learned values where it attends), not a pattern
    if not bool((allowed == allowed[:, :1]).all()):
        return None  # heads attend to different keys
    allowed = allowed[:, 0]  # [b, s_q, s_k]
    s_q, s_k = allowed.shape[-2:]
    q, kv = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
    want_rows = rows[:, :, None]
    for causal in (True, False):
        for window in (None, *range(1, max(s_q, s_k))):
            expected = canonical(causal, window, q, kv)[None] & valid_k[:, None, :]
            if torch.equal(allowed & want_rows, expected & want_rows):
                return causal, window
    return None


def describe(pattern: Pattern | None) -> str:
    if pattern is None:
        return "a pattern other than causal, bidirectional, a sliding window or causal chunks"
    causal, window = pattern
    kind = "causal" if causal else "bidirectional"
    if isinstance(window, Chunks):
        return f"{kind} chunked ({window.size})"
    return kind if window is None else f"{kind} sliding-window ({window})"
