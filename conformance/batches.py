"""The batches of the sweep's variants: padded (odd lengths, padding on both sides, source length !=
target length), packed (documents or (source, target) pairs one after another in a row, positions
restarting) and the prompts / sources of generation. Every one fits a position table of tiny.POSITIONS."""

from __future__ import annotations

import torch

from .tiny import SPECIAL_IDS, VOCAB

LOW, HIGH = 3, VOCAB - SPECIAL_IDS  # token ids drawn from [LOW, HIGH): no special or modality token
DOC_LENGTHS = (5, 9, 3, 7, 1)  # one packed row of 25 tokens: documents cross the shard boundaries at sp 2 and 4
PAIR_LENGTHS = ((4, 6), (7, 3), (2, 5), (6, 6), (1, 2), (5, 4))  # (source, target): 3 rows of <= 12 tokens a side
PAIR_ROW = 12
PROMPT_LENGTHS = (11, 7, 4)  # left-padded prompts (as generate wants them), none a multiple of 2 or 4
SOURCE_LENGTHS = (13, 2, 9)  # right-padded sources


def causal_batch(pad_id: int, seed: int = 100, batch: int = 3, length: int = 13, left_pad: bool = True) -> dict:
    """Row 1 left-padded (3 tokens; with `left_pad=False` it is right-padded instead), row 2 right-padded (4)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(LOW, HIGH, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if left_pad:
        mask[1, :3] = 0
    else:
        mask[1, length - 3 :] = 0
    mask[2, length - 4 :] = 0
    input_ids[mask == 0] = pad_id
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def seq2seq_batch(pad_id: int, seed: int = 100, batch: int = 3, src_len: int = 13, tgt_len: int = 9) -> dict:
    """Right-padded source and target; row 1's source is mostly padding (2 real tokens)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(LOW, HIGH, (batch, src_len), generator=g)
    labels = torch.randint(LOW, HIGH, (batch, tgt_len), generator=g)
    mask = torch.ones(batch, src_len, dtype=torch.long)
    mask[1, 2:] = 0
    mask[2, src_len - 3 :] = 0
    labels[0, tgt_len - 2 :] = -100
    input_ids[mask == 0] = pad_id
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def decoder_inputs(model, labels: torch.Tensor) -> torch.Tensor:
    """The decoder inputs the model builds from labels (shifted right behind the start token)."""
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if prepare is not None:
        try:
            return prepare(labels=labels)
        except Exception:  # noqa: BLE001 - fall back to the generic shift
            pass
    config = model.config
    text = config.get_text_config(decoder=True)
    start = next(
        (c.decoder_start_token_id for c in (config, text) if getattr(c, "decoder_start_token_id", None) is not None), 0
    )
    pad = next((c.pad_token_id for c in (config, text) if getattr(c, "pad_token_id", None) is not None), 0)
    ids = labels.new_full(labels.shape, start)
    ids[:, 1:] = labels[:, :-1]
    return ids.masked_fill(ids == -100, pad)


def pad_id(model) -> int:
    config = model.config
    for c in (config, config.get_text_config(decoder=True)):
        if getattr(c, "pad_token_id", None) is not None:
            return int(c.pad_token_id)
    return 0


def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(LOW, HIGH, (n,), generator=g).tolist()


def causal_packed_batch(seed: int = 101) -> dict:
    """One row of documents as transformers' DataCollatorWithFlattening gives it: input_ids and labels
    [1, 25] (-100 at each document's first token), position_ids restarting per document, no attention mask."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    docs = [_tokens(g, n) for n in DOC_LENGTHS]
    return dict(DataCollatorWithFlattening()([{"input_ids": d, "labels": d} for d in docs]))


def seq2seq_pairs(seed: int = 101) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [(_tokens(g, a), _tokens(g, b)) for a, b in PAIR_LENGTHS]


def generate_inputs(pad_id: int, seq2seq: bool, seed: int = 102) -> dict:
    """Three rows of different lengths: prompts left-padded, sources right-padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = SOURCE_LENGTHS if seq2seq else PROMPT_LENGTHS
    width = max(lengths)
    ids = torch.randint(LOW, HIGH, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if seq2seq:
            mask[row, :n] = 1
        else:
            mask[row, width - n :] = 1
    return {"input_ids": ids.masked_fill(mask == 0, pad_id), "attention_mask": mask}
