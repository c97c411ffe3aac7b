"""The backbone's full inputs -> this rank's shard, and the forward's context.

Every rank of an SP group gets the same full batch and keeps its tokens (`ShardPlan`). Lengths are
padded to a multiple of the group; the padding is never a key and carries no label. Positions stay
those of the full sequence (global, or restarting per document in packed rows).

Packed rows (several documents per row, no attention across them):
- decoder-only, transformers' conventions: `position_ids` restarting at 0 for each document and no
  `attention_mask` (what `DataCollatorWithFlattening` gives; its `cu_seq_lens_*` / `max_length_*`
  are checked against the positions and consumed here). As in transformers, a row is packed when its
  positions do not simply count up; with an `attention_mask`, positions are only positions. A model whose
  own forward lets the documents of such rows attend to each other (OPT, BioGPT, the BERT-family LM
  heads: seen at patch time, models/proof/packed_probe.py) has them refused, before sharding.
- encoder-decoder (seqpar_hf's convention): `position_ids` (source) and `decoder_position_ids`
  (target) restarting at 0 for each (source, target) pair; the k-th target document attends, in
  cross-attention, to the k-th source document only. Padding at the end of a row is masked as usual.
  `seqpar_hf.training.packing.Seq2SeqPackingCollator` builds such rows.
"""

from __future__ import annotations

import torch

from ...attention.masks import SeqMeta
from ...parallel.layout import ParallelLayout
from ...parallel.sharding import ShardPlan
from .context import ForwardContext
from .default_positions import compute as default_positions_of

FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _size(ids, embeds, what: str) -> tuple[int, int, torch.device]:
    x = ids if ids is not None else embeds
    if x is None:
        raise ValueError(f"the patched forward needs {what}")
    return x.shape[0], x.shape[1], x.device


def _mask(mask, what: str) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dim() != 2:
        raise ValueError(
            f"seqpar_hf takes 2D padding masks [batch, seq] ({what}); got a {mask.dim()}D mask of shape "
            f"{tuple(mask.shape)}. Packed rows: pass restarting position_ids instead of a 4D mask"
        )
    return mask.bool()


def shard_plan(layout: ParallelLayout, length: int, causal: bool) -> ShardPlan:
    """Which tokens of a `length`-token sequence this rank holds: the one place plans are made, so a
    language-model forward shards its labels exactly as the backbone below it shards the tokens.
    Causal sequences are balanced across a ring by zigzag order (ShardPlan ignores it without a ring)."""
    ring = layout.sizes.ring_size
    assert ring is not None  # a built layout (an auto layout shards nothing itself)
    return ShardPlan.build(length, layout.sp_size, layout.sp_rank, ring, zigzag=causal, tp_size=layout.sizes.tp_size)


def documents_from_positions(
    position_ids: torch.Tensor, what: str = "position_ids", always: bool = False
) -> torch.Tensor | None:
    """[b, s] document index (from 0) of each token: a new document starts wherever positions do not
    count up by one (transformers' rule). None when every row is one document (and not `always`).
    In packed rows every document must start at position 0; the error names the row."""
    step = torch.diff(position_ids, dim=-1)
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = step != 1
    if not always and not bool(starts[:, 1:].any()):
        return None
    bad = starts & (position_ids != 0)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"packed row {row}: a document starts at token {col} with {what} {int(position_ids[row, col])};"
            f" packed rows must restart {what} at 0 for every document (got "
            f"{position_ids[row, max(0, col - 3) : col + 3].tolist()} around it)"
        )
    return starts.long().cumsum(-1) - 1


def _check_cu_seq_lens(cu: torch.Tensor, doc: torch.Tensor | None, b: int, s: int, masked: bool) -> torch.Tensor:
    """Documents from flash-attention's cu_seq_lens (one packed row), checked against the positions:
    transformers' implementations disagree on which of the two decides (flash attention reads cu_seq_lens,
    SDPA and eager only the positions, and neither with an attention_mask), so both must say the same."""
    cu = cu.to(torch.long).flatten()
    if b != 1 or cu[0] != 0 or cu[-1] != s or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(
            f"cu_seq_lens_q {cu.tolist()} does not describe one packed row of {s} tokens "
            f"(batch {b}): it must start at 0, increase, and end at {s}"
        )
    if cu.numel() > 2 and doc is None:
        given = (
            "an attention_mask (positions are then only positions)"
            if masked
            else "position_ids that do not restart (or none)"
        )
        raise ValueError(
            f"cu_seq_lens_q describes {cu.numel() - 1} documents in packed row 0, but comes with {given}: "
            "flash attention would separate the documents and SDPA / eager would not. Pass the "
            "restarting position_ids that go with them (as DataCollatorWithFlattening does) and no "
            "attention_mask, or leave out cu_seq_lens_q"
        )
    from_cu = torch.zeros(1, s, dtype=torch.long, device=cu.device)
    from_cu[0, cu[1:-1]] = 1
    from_cu = from_cu.cumsum(-1)  # [1, s] document index from 0
    if doc is not None and not torch.equal(from_cu.to(doc.device), doc):
        raise ValueError(
            "cu_seq_lens_q and position_ids describe different documents in packed row 0; pass either "
            "or make them agree"
        )
    return from_cu


WITH_CACHE = "packed rows with use_cache on"


def packed_kind(rows: int, flash_kwargs: bool) -> str:
    """The kind of a packed batch, as the patch-time probe tells them apart (models/proof/packed_probe.py)."""
    return (
        "several packed rows"
        if rows > 1
        else ("one packed row with flash-attention kwargs" if flash_kwargs else "one packed row")
    )


def _check_packed(refused: dict, doc: torch.Tensor, flash_kwargs: bool, use_cache: bool) -> None:
    """Refuse packed rows of a kind the unpatched model does not keep apart (models/proof/packed_probe.py). With
    its cache on, transformers' mask functions skip the packed-row detection: the caller's use_cache (its
    keyword, else the config's) decides which behaviour the unpatched model has."""
    why = refused.get(packed_kind(doc.shape[0], flash_kwargs)) or (refused.get(WITH_CACHE) if use_cache else None)
    if why is None:
        return
    if use_cache and why == refused.get(WITH_CACHE):
        row, col = (int(i) for i in (torch.diff(doc, dim=-1) != 0).nonzero()[0])
        raise ValueError(
            f"seqpar_hf: {why}; here row {row} starts a new document at token {col + 1} (its "
            "position_ids restart, and no attention_mask is given) and use_cache is on (the "
            "model's config.use_cache, or the keyword). Sequence parallelism keeps documents apart, "
            "as the unpatched model does only without a cache: pass use_cache=False (the Trainer and "
            "TRL do), or set model.config.use_cache = False for training"
        )
    row, col = (int(i) for i in (torch.diff(doc, dim=-1) != 0).nonzero()[0])
    raise ValueError(
        f"seqpar_hf: {why}; here row {row} starts a new document at token {col + 1} (its position_ids "
        "restart, and no attention_mask is given). Sequence parallelism keeps documents apart, so it "
        "cannot reproduce that. Pass one document per row (padded, with an attention_mask), or pass "
        "attention_mask=torch.ones_like(input_ids) to train as the unpatched model does, across "
        "documents (the position_ids then stay positions)"
    )


def _meta(
    plan: ShardPlan, valid: torch.Tensor | None, doc: torch.Tensor | None, b: int, device, blocks=None
) -> SeqMeta:
    """Pad the per-token tensors to the plan's length: padding is invalid and belongs to no document or block."""
    if valid is not None and bool(valid.all()):
        valid = None  # one host sync per sequence and forward, so attention can skip the mask
    if plan.padded > plan.length:
        base = valid if valid is not None else torch.ones(b, plan.length, dtype=torch.bool, device=device)
        valid = plan.pad(base, False)
    if doc is not None:
        doc = plan.pad(doc, -1)
    if blocks is not None:
        blocks = plan.pad(blocks.to(device), -1)
    return SeqMeta(plan, valid, doc, blocks)


def _positions(plan: ShardPlan, position_ids: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(full [b or 1, S_pad], local [b or 1, s_loc]) position ids; padding gets position 0 (it is
    masked anyway, and must not index past a position table). Multi-axis positions ([axes, b, S]: a
    multimodal text model's M-RoPE ids, computed from the full batch before its backbone) along their last."""
    if position_ids is None:
        position_ids = torch.arange(plan.length, device=device).unsqueeze(0)
    full = plan.pad(position_ids, 0, dim=-1)
    return full, plan.shard(full, dim=-1)


def _text_positions(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The [b or 1, S] positions that say where documents start: multi-axis ids [axes, b, S] say so only where
    their first axis is the text's (4 axes, transformers' convention: the text position, then M-RoPE's
    three); with three axes a row is one document, as transformers then builds its mask."""
    if position_ids is None or position_ids.dim() < 3:
        return position_ids
    return position_ids[0] if position_ids.shape[0] == 4 else None


def _visual_rows(plan: ShardPlan, kw: dict) -> None:
    """Per-token visual features a multimodal model adds inside its text model (Qwen3-VL's deepstack:
    `deepstack_visual_embeds`, one [n_visual, d] per layer, added at the `visual_pos_masks` [b, S] tokens in
    row-major order): this rank's tokens of the mask, and the rows of the features they take."""
    masks = kw.get("visual_pos_masks")
    if masks is None:
        return
    order = (masks.reshape(-1).long().cumsum(0) - 1).view(masks.shape)  # each visual token's row in the features
    local = plan.pad_and_shard(masks, False)
    rows = plan.pad_and_shard(order, 0)[local]
    kw["visual_pos_masks"] = local
    if kw.get("deepstack_visual_embeds") is not None:
        kw["deepstack_visual_embeds"] = [e.index_select(0, rows.to(e.device)) for e in kw["deepstack_visual_embeds"]]


def _tokens(plan: ShardPlan, kw: dict, ids_key: str, embeds_key: str, pad_id: int) -> None:
    if kw.get(ids_key) is not None:
        kw[ids_key] = plan.pad_and_shard(kw[ids_key], pad_id)
    elif kw.get(embeds_key) is not None:
        kw[embeds_key] = plan.pad_and_shard(kw[embeds_key], 0.0)


def shard_causal(
    layout: ParallelLayout,
    kw: dict,
    pad_id: int,
    local_outputs: bool,
    keep_ids: bool = False,
    default_positions: str = "arange",
    packed: dict | None = None,
    use_cache: bool = False,
    blocks: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    front: bool = False,
) -> ForwardContext:
    """Shard a decoder-only backbone's inputs in place; return the forward's context.
    `blocks` [b, S]: tokens that see each other both ways inside causal attention (Gemma 3's images, read off
    the masks its front prepared: `front_masks.py`); -1 outside any block. `documents` [b, S]: the packed rows'
    documents those masks keep apart (None: none); with `front` (the masks were prepared) they must be the ones the
    positions say, none included: the unpatched model attends by those masks.
    `default_positions`: the rule the backbone makes its own positions by when given none
    (models/forward/default_positions.py), applied here to the full batch. `packed`: the kinds of packed rows
    refused for this model, and why (`ModelFamily.packed_rows`); checked on the full batch, so every
    rank raises the same error before sharding; `use_cache`: whether the caller asked for the model's cache
    (which decides how the unpatched model treats packed rows)."""
    b, s, device = _size(kw.get("input_ids"), kw.get("inputs_embeds"), "input_ids or inputs_embeds")
    if layout.sizes.tp_size > 1 and kw.get("inputs_embeds") is not None:
        raise NotImplementedError(
            "inputs_embeds with tensor parallelism: the vocabulary-parallel embedding is what "
            "splits the sequence over the TP group; pass input_ids (or use tp_size=1)"
        )
    mask = _mask(kw.get("attention_mask"), "attention_mask")
    position_ids = kw.get("position_ids")
    own = (
        None
        if position_ids is not None
        else default_positions_of(default_positions, kw.get("input_ids"), mask, b, s, pad_id, device)
    )
    flash_kwargs = any(kw.get(name) is not None for name in FLASH_KWARGS[:4])
    cu = kw.pop("cu_seq_lens_q", None)
    for name in FLASH_KWARGS[1:]:
        kw.pop(name, None)
    doc = None
    text = _text_positions(position_ids)
    if text is not None and mask is None:  # None: one document per row, plain causal attention
        doc = documents_from_positions(text.expand(b, -1))
    if cu is not None:
        doc = _check_cu_seq_lens(cu, doc, b, s, mask is not None)
    if front and not (
        (doc is None and documents is None)
        or (doc is not None and documents is not None and torch.equal(doc.expand(b, -1), documents.to(doc.device)))
    ):
        raise NotImplementedError(
            "seqpar_hf: the masks the text model was handed keep apart other documents than its positions say "
            f"({'none' if documents is None else 'some'} in the masks, "
            f"{'none' if doc is None else 'some'} by the positions): the unpatched model attends by the masks, "
            "which sequence parallelism cannot reproduce here; pass one document per row with an attention_mask"
        )
    if doc is not None and packed:
        _check_packed(packed, doc, flash_kwargs, use_cache)
    if doc is not None and blocks is not None and bool((doc != doc[:, :1]).any()):
        raise NotImplementedError(
            "seqpar_hf: packed rows (documents restarting inside a row) with blocks of tokens that see each other "
            "both ways (images): not supported under sequence parallelism; pass one document per row"
        )
    plan = shard_plan(layout, s, causal=True)
    full_pos, local_pos = _positions(plan, position_ids if own is None else own, device)
    ids = {"decoder": plan.pad(kw["input_ids"], pad_id)} if keep_ids and kw.get("input_ids") is not None else {}
    _tokens(plan, kw, "input_ids", "inputs_embeds", pad_id)
    meta = _meta(plan, mask, doc, b, device, blocks)
    # a 2D mask keeps transformers from re-detecting packing on the local positions; our attention
    # takes its masks from the context
    kw["attention_mask"] = (
        plan.shard(meta.valid)
        if meta.valid is not None
        else torch.ones(b, plan.local_length, dtype=torch.bool, device=device)
    )
    kw["position_ids"] = local_pos
    _visual_rows(plan, kw)
    return ForwardContext(layout, {"decoder": meta}, {"decoder": local_pos}, {"decoder": full_pos}, local_outputs, ids)


def _pair_documents(src_pos, tgt_pos, src_valid, tgt_valid):
    """Documents of packed seq2seq rows from restarting positions on both sides; pads belong to none."""
    src_doc = documents_from_positions(src_pos, "position_ids", always=True)
    tgt_doc = documents_from_positions(tgt_pos, "decoder_position_ids", always=True)
    count = lambda doc, valid: (doc.masked_fill(~valid, -1).max(-1).values + 1) if valid is not None else doc[:, -1] + 1
    n_src, n_tgt = count(src_doc, src_valid), count(tgt_doc, tgt_valid)
    if not torch.equal(n_src, n_tgt):
        row = int((n_src != n_tgt).nonzero()[0])
        raise ValueError(
            f"packed row {row}: {int(n_src[row])} source documents but {int(n_tgt[row])} target "
            "documents; the k-th target document translates the k-th source document"
        )
    return src_doc, tgt_doc


def shard_seq2seq(
    layout: ParallelLayout,
    kw: dict,
    pad_id: int,
    local_outputs: bool,
    keep_ids: bool = False,
    default_positions: str = "arange",
    packed: dict | None = None,
    use_cache: bool = False,
) -> ForwardContext:
    """Shard an encoder-decoder backbone's inputs in place; return the forward's context (its position
    modules get their positions from hooks, models/forward/positions.py: `default_positions` does not apply;
    nor does `packed`: packed seq2seq rows follow seqpar_hf's own convention, above)."""
    b, s_src, device = _size(kw.get("input_ids"), kw.get("inputs_embeds"), "input_ids or inputs_embeds")
    _, s_tgt, _ = _size(
        kw.get("decoder_input_ids"),
        kw.get("decoder_inputs_embeds"),
        "labels, decoder_input_ids or decoder_inputs_embeds",
    )
    src_mask = _mask(kw.get("attention_mask"), "attention_mask")
    tgt_mask = _mask(kw.get("decoder_attention_mask"), "decoder_attention_mask")
    src_pos, tgt_pos = kw.pop("position_ids", None), kw.pop("decoder_position_ids", None)
    src_doc = tgt_doc = None
    if (src_pos is None) != (tgt_pos is None):
        raise ValueError(
            "packed encoder-decoder rows need both position_ids (source) and decoder_position_ids "
            "(target), restarting at 0 for every pair"
        )
    if src_pos is not None:
        src_doc, tgt_doc = _pair_documents(src_pos.expand(b, -1), tgt_pos.expand(b, -1), src_mask, tgt_mask)
    src, tgt = shard_plan(layout, s_src, causal=False), shard_plan(layout, s_tgt, causal=True)
    src_full, src_local = _positions(src, src_pos, device)
    tgt_full, tgt_local = _positions(tgt, tgt_pos, device)
    ids = {}
    if keep_ids:
        ids = {
            side: plan.pad(kw[key], pad_id)
            for side, plan, key in (("encoder", src, "input_ids"), ("decoder", tgt, "decoder_input_ids"))
            if kw.get(key) is not None
        }
    _tokens(src, kw, "input_ids", "inputs_embeds", pad_id)
    _tokens(tgt, kw, "decoder_input_ids", "decoder_inputs_embeds", pad_id)
    src_meta, tgt_meta = _meta(src, src_mask, src_doc, b, device), _meta(tgt, tgt_mask, tgt_doc, b, device)
    for key, plan, meta in (("attention_mask", src, src_meta), ("decoder_attention_mask", tgt, tgt_meta)):
        kw[key] = plan.shard(meta.valid) if meta.valid is not None else None
    return ForwardContext(
        layout,
        {"encoder": src_meta, "decoder": tgt_meta},
        {"encoder": src_local, "decoder": tgt_local},
        {"encoder": src_full, "decoder": tgt_full},
        local_outputs,
        ids,
    )


def shard_source(layout: ParallelLayout, kw: dict, pad_id: int, keep_ids: bool = False) -> ForwardContext:
    """Shard an encoder's own inputs in place (generation under SP runs the encoder alone, and keeps its
    outputs sharded); the context has the encoder side only."""
    b, s_src, device = _size(kw.get("input_ids"), kw.get("inputs_embeds"), "input_ids or inputs_embeds")
    mask = _mask(kw.get("attention_mask"), "attention_mask")
    plan = shard_plan(layout, s_src, causal=False)
    full, local = _positions(plan, None, device)
    ids = {"encoder": plan.pad(kw["input_ids"], pad_id)} if keep_ids and kw.get("input_ids") is not None else {}
    _tokens(plan, kw, "input_ids", "inputs_embeds", pad_id)
    meta = _meta(plan, mask, None, b, device)
    kw["attention_mask"] = plan.shard(meta.valid) if meta.valid is not None else None
    return ForwardContext(layout, {"encoder": meta}, {"encoder": local}, {"encoder": full}, True, ids)
