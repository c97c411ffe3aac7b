"""Labels as the unpatched model uses them, computed once, on the FULL sequence, before any sharding.

Causal LMs predict token t+1 at position t: the shift happens on the whole sequence, so the token after
a shard boundary keeps its label. Encoder-decoder models take their labels as they are and build their
decoder inputs from them (shifted right behind the start token). Every caller (the patched forward,
the trainer's token counts) goes through these functions.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def targets(kind: str, labels: torch.Tensor, shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """[b, s] targets aligned with the positions: targets[:, t] is what position t must predict."""
    if kind == "seq2seq":
        return labels
    if shift_labels is not None:
        return shift_labels
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def count(kind: str, labels: torch.Tensor) -> torch.Tensor:
    """Labelled tokens of a batch (causal: after the shift, so the first token's label never counts)."""
    return (targets(kind, labels) != IGNORE_INDEX).sum()


def decoder_inputs(
    model, labels: torch.Tensor, decoder_position_ids=None, start_pad: tuple | None = None
) -> torch.Tensor:
    """Decoder inputs from the FULL labels, as the model builds them (shifted right, -100 -> pad, the
    start token first). Packed rows (`decoder_position_ids` restarting at 0 for every pair): the model's
    own builder applied to each pair alone, so each pair starts as the model starts it (mBART: with the
    pair's language code, its last label); without a builder, with `decoder_start_token_id`. `start_pad`: the ids
    (start, pad) the model's forward was seen to use at patch time (proof/decoder_inputs.py), not the config's."""
    config = model.config
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None) if start_pad is None else None
    start = _setting(config, "decoder_start_token_id") if start_pad is None else start_pad[0]
    if decoder_position_ids is None and prepare is not None:
        return prepare(labels=labels)
    if prepare is not None:
        return _per_pair(prepare, labels, decoder_position_ids.expand_as(labels))
    if start is None:
        raise ValueError(
            f"{type(model).__name__} has no decoder_start_token_id: pass decoder_input_ids with packed "
            "rows (each pair's target starting with its start token)"
        )
    pad = _setting(config, "pad_token_id") if start_pad is None else start_pad[1]
    pad = pad if pad is not None else 0
    ids = labels.new_full(labels.shape, start)
    ids[:, 1:] = labels[:, :-1]
    ids = ids.masked_fill(ids == IGNORE_INDEX, pad)
    if decoder_position_ids is not None:
        ids = torch.where(decoder_position_ids.expand_as(ids) == 0, torch.full_like(ids, start), ids)
    return ids


def _setting(config, name: str):
    """A token id of the config, else of its text config (composite configs such as Florence-2's keep them
    there; transformers 5 configs raise AttributeError for a name they do not define)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
    for c in (config, text):
        value = getattr(c, name, None) if c is not None else None
        if value is not None:
            return value
    return None


def _per_pair(prepare, labels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`prepare` (the model's decoder-input builder) on every pair of packed rows as a row of its own:
    labels [b, s] -> pairs [n, longest] (-100 after each pair) -> decoder inputs, scattered back."""
    b, s = labels.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    pair = (starts.long().cumsum(-1) - 1) + torch.arange(b, device=labels.device)[:, None] * s  # [b, s] global id
    _, row = torch.unique(pair.flatten(), return_inverse=True)  # [b * s] pair index
    col = positions.flatten()  # position within the pair
    n, longest = int(row.max()) + 1, int(col.max()) + 1
    pairs = labels.new_full((n, longest), IGNORE_INDEX)
    pairs[row, col] = labels.flatten()
    real = (pairs != IGNORE_INDEX).any(-1)  # pairs of padding only: a builder may not take them (mBART)
    out = pairs.new_zeros((n, longest))
    if bool(real.any()):
        out[real] = prepare(labels=pairs[real])
    return out[row, col].view(b, s)
