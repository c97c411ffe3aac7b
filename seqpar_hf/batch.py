"""Shard a full batch along the sequence for one rank of an SP group.

Every rank gets the same full batch and keeps its tokens (`ShardPlan`). Done on the full batch,
before slicing: decoder inputs are built from the full labels, causal-LM labels are shifted, and
lengths are padded to a multiple of the group. The model keeps the FULL (padded) 2D masks: the
mask function hands them to attention as key-padding masks, identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layout import ParallelLayout
from .loss import IGNORE_INDEX
from .sharding import ShardPlan


@dataclass
class ShardedBatch:
    inputs: dict  # keyword arguments for the model's original forward
    labels: torch.Tensor | None  # this rank's labels, aligned with its logits (already shifted)
    plans: dict[str, ShardPlan]  # "encoder" / "decoder" -> plan
    positions: dict[str, torch.Tensor] = field(default_factory=dict)  # side -> [s_loc] global positions


def _full_mask(mask, batch: int, length: int, device) -> torch.Tensor:
    if mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if mask.dim() != 2:
        raise ValueError(f"seqpar_hf takes 2D padding masks [batch, seq]; got a {mask.dim()}D mask of shape "
                         f"{tuple(mask.shape)}")
    return mask.bool()


def _shard_tokens(plan: ShardPlan, ids, embeds, pad_id: int):
    """Pad and shard ids [b, s] or embeddings [b, s, d] along the sequence."""
    if ids is not None:
        return plan.pad_and_shard(ids, pad_id), None
    return None, plan.pad_and_shard(embeds, 0.0)


def _size(ids, embeds, what: str) -> tuple[int, int, torch.device]:
    x = ids if ids is not None else embeds
    if x is None:
        raise ValueError(f"the patched forward needs {what}")
    return x.shape[0], x.shape[1], x.device


def _plan(layout: ParallelLayout, length: int, causal: bool) -> ShardPlan:
    # causal sequences are balanced across a ring by zigzag order (ShardPlan ignores it without a ring)
    return ShardPlan.build(length, layout.sp_size, layout.sp_rank, layout.sizes.ring_size, zigzag=causal)


def shard_seq2seq(model, layout: ParallelLayout, kw: dict) -> ShardedBatch:
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    labels = kw.pop("labels", None)
    if labels is not None and kw.get("decoder_input_ids") is None and kw.get("decoder_inputs_embeds") is None:
        kw["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels)  # from the FULL labels
    b, s_src, device = _size(kw.get("input_ids"), kw.get("inputs_embeds"), "input_ids or inputs_embeds")
    _, s_tgt, _ = _size(kw.get("decoder_input_ids"), kw.get("decoder_inputs_embeds"),
                        "labels, decoder_input_ids or decoder_inputs_embeds")
    src, tgt = _plan(layout, s_src, causal=False), _plan(layout, s_tgt, causal=True)
    kw["input_ids"], kw["inputs_embeds"] = _shard_tokens(src, kw.get("input_ids"), kw.get("inputs_embeds"), pad)
    kw["decoder_input_ids"], kw["decoder_inputs_embeds"] = _shard_tokens(
        tgt, kw.get("decoder_input_ids"), kw.get("decoder_inputs_embeds"), pad)
    kw["attention_mask"] = src.pad(_full_mask(kw.get("attention_mask"), b, s_src, device), False)
    kw["decoder_attention_mask"] = tgt.pad(_full_mask(kw.get("decoder_attention_mask"), b, s_tgt, device), False)
    return ShardedBatch(kw, None if labels is None else tgt.pad_and_shard(labels, IGNORE_INDEX),
                        {"encoder": src, "decoder": tgt},
                        {"encoder": src.positions(device), "decoder": tgt.positions(device)})


def shard_causal(model, layout: ParallelLayout, kw: dict) -> ShardedBatch:
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    labels, shift_labels = kw.pop("labels", None), kw.pop("shift_labels", None)
    if shift_labels is None and labels is not None:
        # shift on the FULL sequence, so the token after a shard boundary keeps its label
        shift_labels = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
    b, s, device = _size(kw.get("input_ids"), kw.get("inputs_embeds"), "input_ids or inputs_embeds")
    plan = _plan(layout, s, causal=True)
    kw["input_ids"], kw["inputs_embeds"] = _shard_tokens(plan, kw.get("input_ids"), kw.get("inputs_embeds"), pad)
    kw["attention_mask"] = plan.pad(_full_mask(kw.get("attention_mask"), b, s, device), False)
    if kw.get("position_ids") is None:
        kw["position_ids"] = plan.positions(device).unsqueeze(0)  # [1, s_loc] global positions
    else:
        kw["position_ids"] = plan.pad_and_shard(kw["position_ids"], 0)
    return ShardedBatch(kw, None if shift_labels is None else plan.pad_and_shard(shift_labels, IGNORE_INDEX),
                        {"decoder": plan})
