"""What may attend to what, in full (padded) sequence coordinates, independent of who holds which token.

A query at sequence index i may see a key at index j when all of these hold:
- the key is a real token (`valid`: padding, including the padding added to reach a multiple of sp,
  is never a key);
- both are in the same document of their row (`doc`: packed rows; cross-attention pairs the k-th
  target document with the k-th source document);
- causal attention: j <= i, or both in one block (`blocks`: Gemma 3's images attend to each other in both
  directions inside causal attention); sliding window of w: i - j < w (causal), |i - j| < w (bidirectional).

Masks are built from these per forward, never per layer: `full_mask` for the whole sequence (Ulysses
holds it after its all-to-all), `block_mask` for a block of rows and columns (a ring step).
Packed rows never get a row-long mask: attention over whole sequences gathers each document into
a batch of its own (`DocumentBatch`, [documents, longest document] tokens) or, on CUDA for
self-attention, takes the varlen kernel (`segments`). Other masks are dense booleans over whole
sequences ([b, 1, s_q, s_k], 1 byte per query-key pair; SDPA's CPU kernel turns it into a float mask
of 4 more bytes per pair: 320 MiB for one 8K-token padded row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.sharding import ShardPlan


@dataclass
class SeqMeta:
    """One sequence of the batch (the encoder's or the decoder's), in full padded coordinates."""

    plan: ShardPlan
    valid: torch.Tensor | None  # [b, S_pad] bool, True = real token; None: every position is real
    doc: torch.Tensor | None  # [b, S_pad] int64 document index within its row; None: one per row
    # [b, S_pad] int64: tokens of one block (>= 0) see each other both ways inside causal attention; -1: none
    blocks: torch.Tensor | None = None


@dataclass(frozen=True)
class MaskSpec:
    """The attention pattern of one kind of attention layer in one forward."""

    q: SeqMeta
    k: SeqMeta
    causal: bool
    window: int | None = None  # sliding window: i - j < window (causal), |i - j| < window (bidirectional)

    @classmethod
    def of(cls, q: SeqMeta, k: SeqMeta, causal: bool, window, batch: int, device) -> MaskSpec:
        """The spec of a (causal, window) pattern; `Chunks` (self-attention only) become documents of their own."""
        if isinstance(window, Chunks):
            if q is not k:
                raise NotImplementedError("chunked cross-attention is not supported under sequence parallelism")
            q = k = chunked(q, window.size, batch, device)
            window = None
        return cls(q, k, causal, window)

    @property
    def trivial(self) -> bool:
        """Nothing beyond (maybe) plain causal: kernels take `is_causal` and no mask."""
        return self.k.valid is None and self.q.doc is None and self.window is None and self.blocks is None

    @property
    def blocks(self) -> torch.Tensor | None:
        """Bidirectional blocks inside causal self-attention (None: none, or not causal self-attention)."""
        return self.q.blocks if self.causal and self.q is self.k else None

    def block_mask(self, q_idx: torch.Tensor, k_idx: torch.Tensor, causal: bool | None = None):
        """[b or 1, 1, len(q_idx), len(k_idx)] bool for the queries / keys at these sequence indices,
        or None if every pair may attend. `causal=False` leaves causality to the caller's kernel."""
        causal = self.causal if causal is None else causal
        mask = None

        def both(m, extra):
            return extra if m is None else m & extra

        if self.k.valid is not None:
            mask = self.k.valid.index_select(1, k_idx)[:, None, None, :]  # [b, 1, 1, s_k]
        if self.q.doc is not None:
            assert self.k.doc is not None  # packed rows: both sides carry their documents
            same = (
                self.q.doc.index_select(1, q_idx)[:, None, :, None]
                == self.k.doc.index_select(1, k_idx)[:, None, None, :]
            )
            mask = both(mask, same)  # [b, 1, s_q, s_k]
        if causal:
            seen = q_idx[:, None] >= k_idx[None, :]
            if self.blocks is not None:  # or both in one block: [b, 1, s_q, s_k]
                q_block = self.blocks.index_select(1, q_idx)[:, None, :, None]
                seen = seen | ((q_block == self.blocks.index_select(1, k_idx)[:, None, None, :]) & (q_block >= 0))
            mask = both(mask, seen)
        if self.window is not None:
            distance = q_idx[:, None] - k_idx[None, :]
            mask = both(mask, (distance if self.causal else distance.abs()) < self.window)
        return mask

    def full_mask(self, device) -> tuple[torch.Tensor | None, bool]:
        """(mask, is_causal) over the whole padded sequences, for SDPA."""
        if self.trivial:
            return None, self.causal
        s_q, s_k = self.q.plan.padded, self.k.plan.padded
        only_padding = self.q.doc is None and self.window is None and self.blocks is None
        if only_padding and not self.causal:
            assert self.k.valid is not None  # not trivial, no documents, no window: padding it is
            return self.k.valid[:, None, None, :], False  # [b, 1, 1, s_k]: broadcast over queries
        q_idx = torch.arange(s_q, device=device)
        k_idx = torch.arange(s_k, device=device)
        return self.block_mask(q_idx, k_idx), False


@dataclass(frozen=True)
class Chunks:
    """Chunked attention (Llama 4): a query sees the keys of its own chunk of `size` tokens only, chunks counted
    from each document's first real token. Carried where a sliding window would be; every chunk becomes a
    document of its own (`chunked`), so packed-row kernels, ring blocks and masks need nothing new."""

    size: int


def chunked(meta: SeqMeta, size: int, batch: int, device) -> SeqMeta:
    """`meta` with each document (each row, without packing) cut into chunks of `size` tokens, each a document.
    As transformers counts them: from index 0 of each packed document (whose positions restart there), else
    from the row's first real token (past its left padding). Padding stays in no document."""
    idx = torch.arange(meta.plan.padded, device=device)
    if meta.doc is not None:
        doc = meta.doc
        first = torch.ones_like(doc, dtype=torch.bool)
        first[:, 1:] = doc[:, 1:] != doc[:, :-1]
        start: torch.Tensor | int = torch.where(first, idx, 0).cummax(-1).values
    else:
        doc = torch.zeros(batch, meta.plan.padded, dtype=torch.long, device=device)
        start = 0 if meta.valid is None else (meta.valid.long().cumsum(-1) == 0).sum(-1, keepdim=True)
    piece = torch.div(idx - start, size, rounding_mode="floor").expand_as(doc)
    new = torch.ones_like(doc, dtype=torch.bool)
    new[:, 1:] = (doc[:, 1:] != doc[:, :-1]) | (piece[:, 1:] != piece[:, :-1])
    return SeqMeta(meta.plan, meta.valid, torch.where(doc >= 0, new.long().cumsum(-1) - 1, -1), meta.blocks)


def check_window(window, causal: bool) -> int | Chunks | None:
    if window is None:
        return None
    if isinstance(window, Chunks):
        if not causal or window.size <= 0:
            raise ValueError(f"chunked attention is causal with a positive chunk size, got {window}, causal={causal}")
        return window
    if int(window) <= 0:
        raise ValueError(f"sliding window must be positive, got {window}")
    return int(window)


def segments(meta: SeqMeta) -> tuple[torch.Tensor, int] | None:
    """Varlen view of whole sequences for self-attention: (cu_seqlens [n+1] int32 over the flattened
    [b * S_pad] tokens, longest segment). Segments are the documents of each row, and each run of
    padding is a segment of its own (its queries see only padding keys; nobody reads their outputs).
    None when there is nothing to split, or padding sits inside a document (not expressible)."""
    ref = meta.valid if meta.valid is not None else meta.doc
    if ref is None:
        return None
    b, s = ref.shape
    doc = meta.doc if meta.doc is not None else torch.zeros(b, s, dtype=torch.long, device=ref.device)
    valid = meta.valid if meta.valid is not None else torch.ones(b, s, dtype=torch.bool, device=ref.device)
    key = torch.where(valid, doc, -1 - doc)  # a padding run differs from the document around it
    new = torch.ones_like(valid)
    new[:, 1:] = key[:, 1:] != key[:, :-1]  # a segment starts where the key changes, and at every row start
    starts_per_doc = torch.zeros_like(doc).scatter_add_(1, torch.where(valid, doc, 0), (new & valid).long())
    if bool((starts_per_doc > 1).any()):  # one document in two pieces: padding inside it
        return None
    starts = new.flatten().nonzero().flatten()
    cu = torch.cat([starts, starts.new_tensor([b * s])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


@dataclass
class DocumentBatch:
    """The documents of packed rows as a batch of their own, for attention over whole sequences:
    `q_index[n, i]` is the flat ([b * S_q]) index of document n's i-th query token (`q_valid` marks the
    real ones; the rest point at index 0), likewise for keys. Document n on the query side pairs with
    document n on the key side (the same document in self-attention, the same pair in cross-attention).
    Padding belongs to no document: its queries see no key and get zeros, as in the dense path."""

    q_index: torch.Tensor  # [n, Lq] int64
    q_valid: torch.Tensor  # [n, Lq] bool
    k_index: torch.Tensor  # [n, Lk]
    k_valid: torch.Tensor  # [n, Lk]

    @staticmethod
    def _side(meta: SeqMeta):
        doc = meta.doc
        assert doc is not None  # reached for packed rows only (kernels: `spec.q.doc is not None`)
        real = doc >= 0 if meta.valid is None else (doc >= 0) & meta.valid
        b, s = doc.shape
        group = torch.where(real, torch.arange(b, device=doc.device)[:, None] * (s + 1) + doc, -1).flatten()
        flat = real.flatten().nonzero().flatten()  # documents are contiguous runs in flat order
        groups, counts = torch.unique_consecutive(group[flat], return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        longest = int(counts.max()) if counts.numel() else 0
        offsets = torch.arange(longest, device=doc.device)
        valid = offsets[None, :] < counts[:, None]  # [n, L]
        index = torch.where(valid, flat[(starts[:, None] + offsets[None, :]).clamp(max=flat.numel() - 1)], 0)
        return groups, index, valid

    @classmethod
    def build(cls, q: SeqMeta, k: SeqMeta) -> DocumentBatch | None:
        """None when the two sides do not hold the same documents (e.g. a pair empty on one side)."""
        q_groups, q_index, q_valid = cls._side(q)
        if k is q:
            return cls(q_index, q_valid, q_index, q_valid)
        k_groups, k_index, k_valid = cls._side(k)
        if not torch.equal(q_groups, k_groups):
            return None
        return cls(q_index, q_valid, k_index, k_valid)
