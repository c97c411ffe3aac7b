"""Packed rows for encoder-decoder models: several (source, target) pairs per row, no attention across pairs.

transformers has no packed convention for seq2seq; seqpar_hf's (read by the patched model, see
`seqpar_hf.models.forward.inputs`):

    input_ids, attention_mask      [rows, S]  sources of the row's pairs, one after another, then padding
    position_ids                   [rows, S]  0, 1, ... restarting at 0 for every pair (padding: 0)
    labels                         [rows, T]  targets of the same pairs in the same order (padding: -100)
    decoder_position_ids           [rows, T]  restarting at 0 for every pair
    decoder_input_ids              [rows, T]  each pair's target shifted right behind its start token
                                              (left out with decoder_start_token_id=None: the patched
                                              model builds each pair's with its own builder)
    decoder_attention_mask         [rows, T]  1 on the targets, 0 on padding

The k-th target of a row attends (cross-attention) to the k-th source only; encoder and decoder
self-attention stay inside their pair; positions restart, so each pair is computed exactly as if it
were alone. Decoder-only models use transformers' own convention (`DataCollatorWithFlattening`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..models.forward.labels import IGNORE_INDEX


def pack_pairs(lengths: Sequence[tuple[int, int]], max_tokens: int) -> list[list[int]]:
    """Indices of the pairs of each row. As few rows as the longer side needs, filled evenly: pairs,
    longest first, each go to the least-filled row they fit in (a new row when none has room), so the
    rows end up about equally long and the padding to the longest row is small. Which pairs share a
    step is the caller's (the sampler's) decision; within a step the order does not matter."""
    for i, (src, tgt) in enumerate(lengths):
        if src > max_tokens or tgt > max_tokens:
            raise ValueError(
                f"pair {i} has {src} source and {tgt} target tokens, longer than a packed row of "
                f"{max_tokens} tokens per side; raise the row size or truncate the pair"
            )
    total_src, total_tgt = sum(s for s, _ in lengths), sum(t for _, t in lengths)
    n_rows = max(1, -(-total_src // max_tokens), -(-total_tgt // max_tokens))
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    loads = [[0, 0] for _ in range(n_rows)]
    for i in sorted(range(len(lengths)), key=lambda i: -max(lengths[i])):
        src, tgt = lengths[i]
        fits = [r for r in range(len(rows)) if loads[r][0] + src <= max_tokens and loads[r][1] + tgt <= max_tokens]
        if not fits:
            rows.append([])
            loads.append([0, 0])
            fits = [len(rows) - 1]
        r = min(fits, key=lambda r: max(loads[r]))
        rows[r].append(i)
        loads[r][0] += src
        loads[r][1] += tgt
    return [sorted(row) for row in rows if row]


class Seq2SeqPackingCollator:
    """Collate a list of (source, target) examples into packed rows of at most `max_tokens` per side.

    Features are dicts with `input_ids` and `labels` (lists of ints, as a tokenizer returns them).
    Every pair of the batch lands in exactly one row (see `pack_pairs`), so a step sees the same pairs
    as unpacked, with (almost) no padding. `pad_to_multiple_of` pads the row length (e.g. to the SP size).

    A feature's own `decoder_input_ids` (one per label) are used as given: pairs whose decoder inputs are not their
    labels shifted behind one start token (a document's sentence after the first, which starts at its marker).
    Otherwise `decoder_start_token_id=None` leaves `decoder_input_ids` out, and the patched model builds each pair's
    from its labels with the model's own builder: the choice for models whose targets do not start with
    one fixed token (mBART starts each with its language code, its last label).
    """

    def __init__(
        self,
        max_tokens: int,
        pad_token_id: int,
        decoder_start_token_id: int | None,
        pad_to_multiple_of: int | None = None,
    ):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.max_tokens, self.pad, self.start = max_tokens, pad_token_id, decoder_start_token_id
        self.multiple = pad_to_multiple_of or 1

    def _width(self, n: int) -> int:
        return -(-n // self.multiple) * self.multiple

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lengths = [(len(f["input_ids"]), len(f["labels"])) for f in features]
        rows = pack_pairs(lengths, self.max_tokens)
        src_w = self._width(max(sum(lengths[i][0] for i in row) for row in rows))
        tgt_w = self._width(max(sum(lengths[i][1] for i in row) for row in rows))
        n = len(rows)
        out = {
            "input_ids": torch.full((n, src_w), self.pad, dtype=torch.long),
            "attention_mask": torch.zeros(n, src_w, dtype=torch.long),
            "position_ids": torch.zeros(n, src_w, dtype=torch.long),
            "labels": torch.full((n, tgt_w), IGNORE_INDEX, dtype=torch.long),
            "decoder_attention_mask": torch.zeros(n, tgt_w, dtype=torch.long),
            "decoder_position_ids": torch.zeros(n, tgt_w, dtype=torch.long),
        }
        if self.start is not None or any("decoder_input_ids" in f for f in features):
            if not all("decoder_input_ids" in f for f in features) and self.start is None:
                raise ValueError("some pairs give decoder_input_ids and others none, with no decoder_start_token_id")
            out["decoder_input_ids"] = torch.full((n, tgt_w), self.pad, dtype=torch.long)
        for r, row in enumerate(rows):
            s = t = 0
            for i in row:
                src, tgt = list(features[i]["input_ids"]), list(features[i]["labels"])
                out["input_ids"][r, s : s + len(src)] = torch.tensor(src)
                out["attention_mask"][r, s : s + len(src)] = 1
                out["position_ids"][r, s : s + len(src)] = torch.arange(len(src))
                out["labels"][r, t : t + len(tgt)] = torch.tensor(tgt)
                if "decoder_input_ids" in features[i]:  # the pair's own, as the caller built them
                    shifted = list(features[i]["decoder_input_ids"])
                    if len(shifted) != len(tgt):
                        raise ValueError(
                            f"pair {i} has {len(shifted)} decoder_input_ids for {len(tgt)} labels; give one per label"
                        )
                    out["decoder_input_ids"][r, t : t + len(tgt)] = torch.tensor(shifted)
                elif self.start is not None:
                    shifted = [self.start] + [x if x != IGNORE_INDEX else self.pad for x in tgt[:-1]]
                    out["decoder_input_ids"][r, t : t + len(tgt)] = torch.tensor(shifted)
                out["decoder_attention_mask"][r, t : t + len(tgt)] = 1
                out["decoder_position_ids"][r, t : t + len(tgt)] = torch.arange(len(tgt))
                s, t = s + len(src), t + len(tgt)
        return out
