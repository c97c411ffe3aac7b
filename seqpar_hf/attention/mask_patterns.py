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


def _at(fn, b: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor | None:
    """`fn` at broadcast (row, query, key) indices, or None if it cannot be evaluated there."""
    try:
        out = fn(b, torch.tensor(0), q, kv)
        return torch.as_tensor(out).bool().expand(torch.broadcast_shapes(b.shape, q.shape, kv.shape))
    except Exception:  # noqa: BLE001 - a function that cannot be evaluated on indices is not readable
        return None


def with_blocks(causal_window, blocks: torch.Tensor, b, q, kv, docs: torch.Tensor | None = None):
    """The pattern (causal, window) where tokens of one block (`blocks` [rows, S] >= 0) also see each other both
    ways, inside the window (as transformers composes them: and(window, or(causal, blocks))), and inside their
    document (`docs` [rows, S]: packed rows; None: one per row)."""
    _, window = causal_window
    q_block = blocks[b, q]
    seen = (kv <= q) | ((q_block == blocks[b, kv]) & (q_block >= 0))
    if docs is not None:
        seen = seen & (docs[b, q] == docs[b, kv])
    return seen if window is None else seen & (q - kv < window)


def read_blocks(mask_function, batch_size: int, length: int):
    """((True, window), blocks [batch_size, length] int64: -1 outside blocks, documents [batch_size, length] or
    None) when `mask_function` is causal attention (windowed or not, within the documents of packed rows) in
    which the tokens of contiguous blocks also see each other both ways (Gemma 3's images: `blockwise_overlay`),
    read on one forward's rows; None when it is not. Blocks are the runs where a query sees the next key;
    documents start where a query does not see the key before it. Checked against the function at every block's
    and document's edges, every block's last query over all keys, each query's two keys before and after and
    its window's edge, a 24 x 24 grid from the start and 4,096 random pairs per row."""
    if length < 2:
        return None
    rows = torch.arange(batch_size)[:, None]
    idx = torch.arange(length)
    band = _at(mask_function, rows, idx[None, :-1], idx[None, 1:])  # [b, S-1]: query i sees key i + 1
    behind = _at(mask_function, rows, idx[None, 1:], idx[None, :-1])  # [b, S-1]: query i + 1 sees key i
    if band is None or behind is None:
        return None
    inside = torch.zeros(batch_size, length, dtype=torch.bool)
    inside[:, :-1] |= band
    inside[:, 1:] |= band
    start = torch.ones(batch_size, length, dtype=torch.bool)
    start[:, 1:] = ~band
    blocks = torch.where(inside, start.long().cumsum(-1) - 1, -1)
    new_doc = torch.ones(batch_size, length, dtype=torch.bool)
    new_doc[:, 1:] = ~behind
    docs = new_doc.long().cumsum(-1) - 1 if bool(new_doc[:, 1:].any()) else None
    # the window, off the query outside any block farthest into its document (its keys' blocks do not apply)
    window = None
    first = torch.where(new_doc[0], idx, 0).cummax(-1).values  # each token's document start, row 0
    depth = torch.where(~inside[0], idx - first, -1)
    if bool((depth >= 0).any()):
        q0 = int(depth.argmax())
        seen = _at(mask_function, torch.tensor(0), torch.tensor(q0), idx[int(first[q0]) : q0 + 1])
        if seen is None:
            return None
        unseen = (~seen).nonzero().flatten()
        window = None if not unseen.numel() else q0 - int(first[q0]) - int(unseen[-1])
    pattern: Pattern = (True, window)
    checks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for row in range(batch_size):
        r = torch.tensor(row)
        ids = blocks[row]
        edges = [0] + ((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist() + [length]
        for a, e in zip(edges[:-1], edges[1:]):
            if int(ids[a]) < 0:
                continue
            near = torch.arange(max(a - 2, 0), min(e + 2, length))
            checks.append((r, near[:, None], near[None, :]))
            checks.append((r, torch.tensor([e - 1])[:, None], idx[None, :]))
        for a in new_doc[row].nonzero().flatten().tolist():
            near = torch.arange(max(a - 3, 0), min(a + 3, length))
            checks.append((r, near[:, None], near[None, :]))
        around = torch.cat([idx[:, None] + d for d in (-2, -1, 1, 2)], 1).clamp(0, length - 1)
        checks.append((r, idx[:, None], around))
        if window is not None:
            edge = torch.cat([idx[:, None] - window, idx[:, None] - window + 1], 1).clamp(min=0)
            checks.append((r, idx[:, None], edge))
        grid = idx[: min(length, _GRID)]
        checks.append((r, grid[:, None], grid[None, :]))
        g = torch.Generator().manual_seed(row)
        checks.append(
            (r, torch.randint(0, length, (4096,), generator=g), torch.randint(0, length, (4096,), generator=g))
        )
    for r, q, kv in checks:
        got = _at(mask_function, r, q, kv)
        if got is None or not torch.equal(got, with_blocks(pattern, blocks, r, q, kv, docs)):
            return None
    return pattern, blocks, docs


def _pattern_key(fn):
    """A hashable identity for a mask function: its code and the simple values it closes over
    (transformers builds a new closure per mask, e.g. one per sliding window size)."""
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value):
            value = _pattern_key(value)
        elif not isinstance(value, (int, float, bool, str, type(None))):
            return None
        cells.append(value)
    code = getattr(fn, "__code__", None)
    return None if code is None else (code, tuple(cells))


_CHECKED: set = set()  # mask functions (by _pattern_key) already found acceptable; a pure function of the key


def check_mask_pattern(mask_function, attention_mask=None, batch_size: int = 1) -> None:
    """Refuse mask patterns other than causal, bidirectional, sliding-window (causal or bidirectional) and
    causal chunks counted from each row's first real token: read off the function exactly
    (attention/mask_patterns.py), once per kind of mask function."""
    key = _pattern_key(mask_function)
    if key is not None and key in _CHECKED:
        return
    pattern = read_function(mask_function)
    if pattern is not None and isinstance(pattern[1], Chunks):
        if not chunks_follow_padding(mask_function, pattern[1].size, attention_mask, batch_size):
            pattern = None
    if pattern is not None:
        if key is not None:
            _CHECKED.add(key)
        return
    name = getattr(mask_function, "__name__", type(mask_function).__name__)
    raise NotImplementedError(
        f"seqpar_hf shards causal, bidirectional, sliding-window and chunked attention; this model "
        f"asked for another mask pattern ({name!r}: prefix or custom masks, or chunks not counted from each "
        "row's first real token, are not supported)"
    )
