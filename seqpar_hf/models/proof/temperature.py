"""Queries scaled by their index in the call (attention temperature tuning: Llama 4's NoPE layers scale a query at
index i by log1p(floor((i + 1) / floor_scale)) * attn_scale + 1). The module counts i from 0 in each call, so
every rank would count its shard from 0: silently wrong past floor_scale tokens (8192 in the released models).

The sharded attention rescales each query from the index its rank gave it to its index in the whole sequence
(`rescale`). The scale is re-derived here, so it is proven at `patch_model` against the module's own forward: its
query, captured with the tuning on, must equal (bit for bit) the query with the tuning off times `scale`, at a
floor_scale small enough that the scale changes within the probe. A module it does not match is refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

_CAPTURE = "seqpar_hf_capture_query"
_PROBE_FLOOR = 2  # the scale changes every 2 tokens of the probe
_PROBE_TOKENS = 9


def tuned(module: nn.Module) -> bool:
    """Whether `module` scales its queries by their index (the flag transformers reads, on a layer without rotary)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def scale(module: Any, index: torch.Tensor, floor_scale: int | None = None) -> torch.Tensor:
    """[n] float32: the module's query scale at sequence indices `index` (as its forward computes it)."""
    floor_scale = module.floor_scale if floor_scale is None else floor_scale
    return torch.log1p(torch.floor((index.float() + 1.0) / floor_scale)) * module.attn_scale + 1.0


def rescale(module: Any, query: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """query [b, h, s_loc, d], scaled by the module for indices 0..s_loc-1 -> scaled for `index` [s_loc] (the
    tokens' indices in the whole sequence). Exact up to one rounding of the ratio."""
    local = torch.arange(query.shape[2], device=query.device)
    ratio = scale(module, index.to(query.device)) / scale(module, local)
    return (query * ratio[None, None, :, None]).to(query.dtype)


def on_shard(module: nn.Module, query: torch.Tensor, plan) -> torch.Tensor:
    """The query [b, h, s, d] of a sharded forward's attention call, its scale at its index in the whole sequence
    (`plan`: the sequence's ShardPlan); as it is where the module holds the whole sequence or is not tuned."""
    if not tuned(module) or query.shape[2] == plan.padded:
        return query
    return rescale(module, query, plan.global_index(device=query.device))


def _capture(store: dict):
    def attend(module, query, key, value, attention_mask, **kwargs):
        store["query"] = query.detach().clone()
        b, h, s, d = query.shape
        return query.new_zeros(b, s, h, value.shape[-1]), None

    return attend


def prove(module: Any, hidden_size: int) -> str | None:
    """None if the module's own tuning is `scale` at every index of a probe; else why not."""
    store: dict = {}
    AttentionInterface.register(_CAPTURE, _capture(store))
    config = module.config
    saved = (config._attn_implementation, module.floor_scale, module.attn_temperature_tuning, module.training)
    param = next(module.parameters())
    x = torch.randn(1, _PROBE_TOKENS, hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(param.device, param.dtype)
    try:
        config._attn_implementation = _CAPTURE
        module.floor_scale = _PROBE_FLOOR
        module.eval()
        queries = []
        for on in (True, False):
            module.attn_temperature_tuning = on
            with torch.no_grad():
                module(hidden_states=x, position_embeddings=None, attention_mask=None)
            queries.append(store.pop("query"))
    except Exception as exc:  # noqa: BLE001 - a module that cannot be run alone cannot be proven
        return f"its forward could not be run alone to prove the scale ({type(exc).__name__}: {exc})"
    finally:
        config._attn_implementation, module.floor_scale, module.attn_temperature_tuning = saved[:3]
        module.train(saved[3])
    on, off = queries
    index = torch.arange(_PROBE_TOKENS, device=x.device)
    if not torch.equal(on, (off * scale(module, index, _PROBE_FLOOR)[None, None, :, None]).to(off.dtype)):
        return "its query scale is not log1p(floor((i + 1) / floor_scale)) * attn_scale + 1 of the index i"
    return None
