"""The positions a causal backbone makes for itself when it is given none, computed on the full batch so
that every shard gets them (patch time picks the rule the model follows, models/proof/probe.py):

- "arange": 0..S-1 (most models; what the patch passes when the model says nothing else);
- "mask_cumsum": from the attention mask, cumsum(mask) * mask - 1 (OPT: a left-padded row starts at 0);
- "padding_aware": from the ids, padding_idx + the count of real tokens so far, padding at padding_idx
  (RoBERTa's create_position_ids_from_input_ids; with embeddings instead of ids, padding_idx + 1 + t).
"""

from __future__ import annotations

import torch

RULES = ("arange", "mask_cumsum", "padding_aware")


def compute(
    rule: str, ids: torch.Tensor | None, mask: torch.Tensor | None, batch: int, length: int, pad_id: int, device
) -> torch.Tensor | None:
    """[b or 1, length] position ids of the full sequence under `rule`; None for "arange" (the default)."""
    if rule == "arange":
        return None
    if rule == "mask_cumsum":
        if mask is None:
            return None
        mask = mask.long()
        return torch.cumsum(mask, dim=1) * mask - 1
    if rule == "padding_aware":
        if ids is None:
            return torch.arange(pad_id + 1, pad_id + 1 + length, device=device).unsqueeze(0)
        real = ids.ne(pad_id).long()
        return torch.cumsum(real, dim=1) * real + pad_id
    raise ValueError(f"unknown default-position rule {rule!r}")
