"""The full batch, checked before it is sharded, against what the unpatched model accepts.

Sharded, a bad input fails on the rank that holds the bad token only (an id past the vocabulary in the
second half, a position past the table), while the others wait in the next collective; a bad shape gives
a loss where the unpatched model raises. Every rank of a replica holds the same full batch (the
fingerprint, `checks`, compared it first), so checking it here raises the same error on every rank,
before any other collective. The error class is the one the unpatched model raises (ValueError for
labels that do not match the logits, as cross-entropy; RuntimeError for positions and empty sequences;
IndexError for ids and positions out of a table), the message names the tensor and the sizes.
Stricter than the unpatched model in one place: a padding mask shorter than its sequence (transformers
pads it with zeros, masking the last tokens) is refused.

Values are read in one go: `extremes` computes, on the device, the smallest and largest token id, label
and position, and the forward reads them back with the fingerprint (one host sync for both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .labels import IGNORE_INDEX

_RANGED = ("input_ids", "decoder_input_ids", "targets", "position_ids", "decoder_position_ids")
_BIG = torch.iinfo(torch.int64).max


@dataclass
class Limits:
    """What the model's modules accept: rows of its token embeddings and LM head, and per side the
    positions its absolute position tables hold (read once per patched model)."""

    vocab: dict = field(default_factory=dict)  # side -> (rows, what)
    labels: tuple | None = None  # (rows, what) of the LM head
    positions: dict = field(default_factory=dict)  # side -> (positions held, what)


def _rows(module) -> int | None:
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None  # DTensor: global shape


def limits(family) -> Limits:
    cached = family.__dict__.get("_limits")
    if cached is not None:
        return cached
    pretrained, backbone = family.pretrained, family.backbone
    encoder = backbone.get_encoder() if family.kind == "seq2seq" else None
    out = Limits()
    tokens = {"encoder" if encoder is not None else "decoder": pretrained.get_input_embeddings()}
    if encoder is not None:
        decoder = backbone.get_decoder()
        tokens["decoder"] = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else None
    for side, module in tokens.items():
        if _rows(module):
            where = f"the {side}'s" if encoder is not None else "the"
            out.vocab[side] = (_rows(module), f"{where} token embedding has {_rows(module)} rows")
    head = pretrained.get_output_embeddings() if family.has_lm_head else None
    if _rows(head):
        out.labels = (_rows(head), f"the LM head has {_rows(head)} outputs")
    # absolute position tables: the position modules looked up by id, and any other embedding of
    # max_position_embeddings rows (+ its offset) that is not a token embedding (GPT-2's wpe)
    known = {id(p.module): p for p in family.positions}
    table_rows = getattr(pretrained.config, "max_position_embeddings", None)
    token_ids = {id(m) for m in tokens.values()}
    for path, module in backbone.named_modules():
        if not isinstance(module, nn.Embedding) or id(module) in token_ids:
            continue
        offset = int(getattr(module, "offset", 0) or 0)
        position = known.get(id(module))
        if (position is None or position.kind != "ids") and module.num_embeddings != (table_rows or -1) + offset:
            continue
        side = "encoder" if encoder is not None and any(m is module for m in encoder.modules()) else "decoder"
        held = module.num_embeddings - offset
        if side not in out.positions or held < out.positions[side][0]:
            out.positions[side] = (held, f"{path} ({type(module).__name__}) holds positions 0..{held - 1}")
    family.__dict__["_limits"] = out
    return out


def _targets(kind: str, labels, shift_labels):
    if kind == "causal" and shift_labels is None and labels is not None and labels.dim() == 2:
        return labels[:, 1:]  # the causal shift: the first token's label is never used
    return shift_labels if kind == "causal" and shift_labels is not None else labels


def extremes(kind: str, kw: dict, labels, shift_labels, device) -> torch.Tensor:
    """[len(_RANGED) * 2] int64 on `device`: (min, max) of each ranged tensor; (BIG, -BIG) when absent or
    empty; labels without the ignored value -100."""
    values = {**kw, "targets": _targets(kind, labels, shift_labels)}
    absent = torch.full((2,), _BIG, dtype=torch.long, device=device)  # filled on the device: no copy
    absent[1] = -_BIG
    pairs = []
    for name in _RANGED:
        x = values.get(name)
        if not isinstance(x, torch.Tensor) or x.numel() == 0 or x.dtype.is_floating_point or x.dtype == torch.bool:
            pairs.append(absent)
            continue
        x = x.detach().long()
        if name == "targets":
            ignored = x == IGNORE_INDEX
            low, high = x.masked_fill(ignored, _BIG).min(), x.masked_fill(ignored, -_BIG).max()
        else:
            low, high = torch.aminmax(x)
        pairs.append(torch.stack([low, high]).to(device))
    return torch.cat(pairs)


def _shape(x) -> tuple:
    return tuple(x.shape)


def _check_ids(name: str, x, what: str) -> None:
    if x is None:
        return
    if x.dim() != 2:
        raise RuntimeError(f"{name} must be 2D [batch, {what}], got shape {_shape(x)}")
    if x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
        raise RuntimeError(f"{name} must hold integer ids (torch.long or torch.int), got {x.dtype}")


def _check_sequence(
    kind: str, side: str, kw: dict, ids_key: str, embeds_key: str, axes: bool = False
) -> tuple[int, int] | None:
    ids: Any = kw.get(ids_key)  # a tensor, or anything a caller passed: checked below
    embeds: Any = kw.get(embeds_key)
    if ids is None and embeds is None:
        return None
    _check_ids(ids_key, ids, "length")
    if ids is None and embeds.dim() != 3:
        raise RuntimeError(f"{embeds_key} must be 3D [batch, length, hidden], got shape {_shape(embeds)}")
    x, name = (ids, ids_key) if ids is not None else (embeds, embeds_key)
    b, s = x.shape[0], x.shape[1]
    if b == 0 or s == 0:
        raise RuntimeError(
            f"{name} of shape {_shape(x)} holds no token: every row needs at least one (an empty "
            f"{'source' if side == 'encoder' else 'sequence'} has nothing to attend to); drop empty "
            "batches and rows"
        )
    _check_companions(kind, side, kw, name, _shape(x)[:2], axes)
    return b, s


def _check_companions(kind: str, side: str, kw: dict, name: str, shape: tuple, axes: bool = False) -> None:
    """The padding mask and the positions of a sequence of `shape` [b, s] (named `name`). `axes`: multi-axis
    positions [axes, b or 1, s] are sharded (the text model of a multimodal model: forward/inputs.py)."""
    b, s = shape
    first = "attention_mask" if side == ("encoder" if kind == "seq2seq" else "decoder") else "decoder_attention_mask"
    mask = kw.get(first)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and _shape(mask) != shape:
        raise ValueError(
            f"{first} of shape {_shape(mask)} does not match {name} of shape {shape}: a padding mask "
            "holds one value per token (transformers would pad a shorter mask with zeros, masking the "
            "last tokens; seqpar_hf asks for the full mask)"
        )
    pos_key = "position_ids" if first == "attention_mask" else "decoder_position_ids"
    pos = kw.get(pos_key)
    if isinstance(pos, torch.Tensor):
        if pos.dim() == 3 and pos.shape[1:] in ((b, s), (1, s)) and axes:
            if pos.dtype.is_floating_point:
                raise RuntimeError(f"{pos_key} must hold integer positions, got {pos.dtype}")
            return
        if pos.dim() == 3 and pos.shape[1:] in ((b, s), (1, s)):
            raise NotImplementedError(
                f"{pos_key} of shape {_shape(pos)}: multi-axis positions (M-RoPE, one row of positions per axis, as "
                "vision-language models' generate passes them) are not sharded under sequence parallelism yet; "
                "run it without SP (`with seqpar_hf.sp_disabled(model):`)"
            )
        rows = pos.unsqueeze(0) if pos.dim() == 1 else pos
        if rows.dim() != 2 or rows.shape[1] != s or rows.shape[0] not in (1, b):
            raise RuntimeError(
                f"{pos_key} of shape {_shape(pos)} does not match {name} of shape {shape}: "
                f"positions must be [batch or 1, {s}] (one per token)"
            )
        if pos.dtype.is_floating_point:
            raise RuntimeError(f"{pos_key} must hold integer positions, got {pos.dtype}")


# the tensors a patched forward shards, or reads whole on every rank (cache_position: a decoding index); any
# other tensor would reach the layers unsharded (images, audio, token types): refused by `check_unsharded`
SHARDED_INPUTS = frozenset(
    (
        "input_ids",
        "inputs_embeds",
        "attention_mask",
        "position_ids",
        "decoder_input_ids",
        "decoder_inputs_embeds",
        "decoder_attention_mask",
        "decoder_position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
        "cache_position",
        "logits_to_keep",
        "visual_pos_masks",  # inside a multimodal model's text model (forward/inputs.py `_visual_rows`)
        "deepstack_visual_embeds",
    )
)


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [x for x in value if isinstance(x, torch.Tensor)]
    return []


def check_unsharded(family, kw: dict, outer: bool = False) -> None:
    """Refuse tensors the patched forward would pass to the backbone unsharded: the dry run at patch time
    saw text batches only, so an image, a video, audio features or per-token extras (pixel_values,
    image_grid_thw, token_type_ids, ...) have no proven path through the sequence split (a vision tower's
    positions would be cut as the text's). `outer`: the kwargs of the language model's own forward, where a
    model whose backbone is its text model (`family.front`: a vision tower runs before it, on the full batch,
    on every rank) takes its images; what reaches the backbone is checked there."""
    if outer and family.front:
        return
    extra = {k: _tensors(v) for k, v in kw.items() if k not in SHARDED_INPUTS and _tensors(v)}
    if extra and family.front:
        what = ", ".join(sorted(extra))
        raise NotImplementedError(
            f"seqpar_hf: {type(family.pretrained).__name__} hands its text model {what}, which sequence "
            "parallelism does not shard (its images and text are merged before it: only inputs_embeds, "
            "attention_mask, position_ids and per-token visual masks are split). Run such batches without it "
            "(`with seqpar_hf.sp_disabled(model):`)"
        )
    if extra:
        what = ", ".join(f"{k}= ({' + '.join(str(tuple(t.shape)) for t in ts)})" for k, ts in sorted(extra.items()))
        raise NotImplementedError(
            f"seqpar_hf: {type(family.pretrained).__name__}'s forward was given {what}, which sequence parallelism "
            "does not shard: only text inputs (input_ids or inputs_embeds, attention_mask, position_ids, labels; "
            "decoder_* for encoder-decoder models) are split"
            + (
                f"; images are merged into the text before its text model, but {family.no_front}"
                * bool(family.no_front)
            )
            + ". Run such batches without SP (`with seqpar_hf.sp_disabled(model):`)"
        )


def check(family, kw: dict, labels, shift_labels, values: list[int], outer: bool = False) -> None:
    """Raise what the unpatched model raises for this batch (or refuse it), before any sharding.
    `values`: `extremes` of the same batch, read back; `outer`: `kw` is the language model's (`check_unsharded`)."""
    kind = family.kind
    check_unsharded(family, kw, outer)
    src = _check_sequence(
        kind, "encoder" if kind == "seq2seq" else "decoder", kw, "input_ids", "inputs_embeds", bool(family.front)
    )
    if src is None:
        raise ValueError("the patched forward needs input_ids or inputs_embeds")
    dec = (
        _check_sequence(kind, "decoder", kw, "decoder_input_ids", "decoder_inputs_embeds") if kind == "seq2seq" else src
    )
    for name, x in (("labels", labels), ("shift_labels", shift_labels)):
        if x is None:
            continue
        _check_ids(name, x, "length")
        if x.shape[1] == 0 and kind == "seq2seq" and dec is None:
            raise IndexError(
                f"labels of shape {_shape(x)} hold no token: the decoder inputs built from them would be empty"
            )
        if kind == "seq2seq" and dec is None:
            if x.shape[0] != src[0]:
                raise RuntimeError(
                    f"labels of shape {_shape(x)} and input_ids of shape {src}: the decoder inputs "
                    "built from the labels must have the source's batch size"
                )
            _check_companions(kind, "decoder", kw, name, _shape(x))  # the decoder inputs will have its shape
            continue
        if _shape(x) != dec:
            what = "input_ids" if kind == "causal" else "decoder_input_ids"
            raise ValueError(
                f"{name} of shape {_shape(x)} do not match {what} of shape {dec}: the loss takes one "
                f"label per token{' (the model shifts labels itself)' if name == 'labels' else ''}"
            )
    if kind == "seq2seq" and dec is not None and dec[0] != src[0]:
        raise RuntimeError(f"decoder inputs of batch {dec[0]} for a source of batch {src[0]}: one target per source")
    _check_values(family, kw, labels, values, src, dec)


def _name(kw: dict, ids: str, embeds: str) -> str:
    return ids if kw.get(ids) is not None else embeds


def _check_values(family, kw, labels, values, src, dec) -> None:
    found = {name: (values[2 * i], values[2 * i + 1]) for i, name in enumerate(_RANGED)}
    lim = limits(family)
    seq2seq = family.kind == "seq2seq"
    for name, side in (("input_ids", "encoder" if seq2seq else "decoder"), ("decoder_input_ids", "decoder")):
        low, high = found[name]
        if low != _BIG and side in lim.vocab and (low < 0 or high >= lim.vocab[side][0]):
            raise IndexError(
                f"{name} holds ids from {low} to {high}, but {lim.vocab[side][1]}: every id must be in "
                f"[0, {lim.vocab[side][0]})"
            )
    low, high = found["targets"]
    if low != _BIG and lim.labels is not None and (low < 0 or high >= lim.labels[0]):
        shifted = " (after the causal shift)" if not seq2seq else ""
        raise IndexError(
            f"labels{shifted} hold values from {low} to {high}, but {lim.labels[1]}: every label must be "
            f"-100 (ignored) or in [0, {lim.labels[0]})"
        )
    if (
        seq2seq
        and found["decoder_input_ids"][0] == _BIG
        and kw.get("decoder_inputs_embeds") is None
        and labels is not None
        and low != _BIG
        and "decoder" in lim.vocab
        and high >= lim.vocab["decoder"][0]
    ):
        raise IndexError(
            f"labels hold values up to {high}, but {lim.vocab['decoder'][1]} (the decoder inputs are "
            "built from the labels)"
        )
    sides = [("encoder" if seq2seq else "decoder", "position_ids", src[1], _name(kw, "input_ids", "inputs_embeds"))]
    if seq2seq:  # decoder inputs given, or built from the labels
        sides.append(
            (
                "decoder",
                "decoder_position_ids",
                dec[1] if dec else labels.shape[1] if labels is not None else None,
                _name(kw, "decoder_input_ids", "decoder_inputs_embeds") if dec else "labels",
            )
        )
    for side, key, length, tensor in sides:
        if side not in lim.positions or length is None:
            continue
        low, high = found[key]
        if low == _BIG:
            low, high, what = 0, length - 1, f"{tensor} has {length} tokens (positions 0..{length - 1})"
        else:
            what = f"{key} hold positions {low}..{high}"
        held, table = lim.positions[side]
        if low < 0 or high >= held:
            raise IndexError(
                f"{what}, but {table}: the sequence is longer than the model's position table "
                "(max_position_embeddings); shorten or truncate it"
            )
