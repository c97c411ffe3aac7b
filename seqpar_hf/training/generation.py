"""Generation in the Trainer (`predict_with_generate`), two ways that return the whole batch's tokens on every
rank of an SP group (`--sp_generate`):
- under SP (`generate_under_sp`): every rank generates the whole batch, `model.generate` sharding the
  sources along the sequence (seqpar_hf.models.generation);
- in slices (`generate_in_slices`): each rank generates a slice of the batch's rows without SP, and the
  slices are gathered in order.
`auto` takes SP from `sp_generate_min_tokens` source tokens on (see training/arguments.py)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..models.patch import original_attn_implementation, sp_disabled
from ..parallel.layout import ParallelLayout
from . import fsdp


def use_sp(layout: ParallelLayout, setting: str, min_tokens: int, inputs: dict) -> bool:
    """Whether this batch generates under SP: the same answer on every rank of the group (same batch)."""
    if setting == "never" or not layout.enabled or layout.sizes.tp_size > 1:
        return False
    source = inputs.get("input_ids")
    return setting == "always" or (source is not None and source.shape[-1] >= min_tokens)


def generate_under_sp(model, inputs: dict, gen_kwargs: dict, kwargs_fn=None) -> torch.Tensor:
    """Tokens [rows, length] of the whole batch on every rank: `model.generate` under SP."""
    if kwargs_fn is not None:
        gen_kwargs = {**gen_kwargs, **kwargs_fn(inputs)}
    with fsdp.full_parameters(model):  # collective: every rank; generation then gathers no weights
        return model.generate(**inputs, **gen_kwargs)


def generate_in_slices(
    model, layout: ParallelLayout, inputs: dict, gen_kwargs: dict, kwargs_fn=None, device=None
) -> torch.Tensor | None:
    """Tokens [rows, length] of the whole batch on every rank of the SP group (None: no rows, SP group of
    one); `kwargs_fn(inputs)` adds per-slice `generate` arguments."""
    rows = next(iter(inputs.values())).shape[0]
    sp, rank = layout.sp_size, layout.sp_rank
    bounds = [rows * i // sp for i in range(sp + 1)]  # contiguous slices keep the order
    mine = {k: v[bounds[rank] : bounds[rank + 1]] for k, v in inputs.items()}
    if kwargs_fn is not None and bounds[rank + 1] > bounds[rank]:
        gen_kwargs = {**gen_kwargs, **kwargs_fn(mine)}
    if layout.sizes.tp_size > 1:
        # Under TP the norms are sharded along the sequence, which one decoding step (1 token) cannot
        # be: generate with a plain copy holding the full weights (collective: every rank, here)
        model = plain_copy(model)
    with fsdp.full_parameters(model), sp_disabled(model):  # full_parameters: collective, before generations diverge
        tokens = model.generate(**mine, **gen_kwargs) if bounds[rank + 1] > bounds[rank] else None
    if sp == 1:
        return tokens
    gathered: list[torch.Tensor | None] = [None] * sp
    dist.all_gather_object(gathered, None if tokens is None else tokens.cpu(), group=layout.sp_group)
    pieces = [p for p in gathered if p is not None]
    width = max(p.shape[-1] for p in pieces)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    padded = [torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=pad) for p in pieces]
    return torch.cat(padded).to(device)


def plain_copy(model):
    """An unpatched, non-parallel copy of a tensor-parallel model with its full weights (for generation)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # full on every rank
    plain = type(model)(copy.deepcopy(model.config))
    plain.set_attn_implementation(original_attn_implementation(model) or "sdpa")
    plain.load_state_dict(state, strict=False)
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.to(next(model.parameters()).device).eval()
