"""Relative position biases (the T5 family: T5, mT5, UMT5, Switch, ...) proven at patch time.

A module that owns a bias table (`relative_attention_bias`) and computes the bias with
`compute_bias(query_length, key_length, device, past_seen_tokens)` is an owner when its bias is a function
of the query-key distance alone: its own `compute_bias(L, L)` must equal what the by-distance values
(`compute_bias(1, 2L - 1, past_seen_tokens=L - 1)`) give at each distance. The sharded attention then
gathers each block's bias from those values at the block's global positions (`attention/scores.py`).

Each attention call's `position_bias=` is classified from the dry run: "zero" (an all-zero tensor the
module makes itself, as T5's layers without a table and its cross-attention do), or "relative" (equal to an
owner's `compute_bias` at the call's lengths; the owner named). Any other bias is refused by name.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ...attention.scores import distance_index
from .probe_checks import Refusal

_LENGTH = 7  # the proof's length: distances -6..6


def computes_bias(module: nn.Module) -> bool:
    fn = getattr(module, "compute_bias", None)
    if not callable(fn) or not isinstance(getattr(module, "relative_attention_bias", None), nn.Module):
        return False
    params = inspect.signature(fn).parameters
    return all(name in params for name in ("query_length", "key_length", "device", "past_seen_tokens"))


def by_distance(compute_bias, length: int, device) -> torch.Tensor:
    """[h, 2 length - 1] bias values by distance (entry length - 1 + key - query), from the owner's own code."""
    return compute_bias(1, 2 * length - 1, device=device, past_seen_tokens=length - 1)[0, :, 0]


def owners(pretrained: nn.Module) -> dict[str, nn.Module]:
    """Path -> module of every owner whose bias is a function of the distance alone (refused otherwise)."""
    found = {}
    for path, module in pretrained.named_modules():
        if not computes_bias(module):
            continue
        device = module.relative_attention_bias.weight.device
        with torch.no_grad():
            full = module.compute_bias(_LENGTH, _LENGTH, device=device)  # [1, h, L, L]
            values = by_distance(module.compute_bias, _LENGTH, device)
            index = distance_index(
                _LENGTH - 1, torch.arange(_LENGTH, device=device), torch.arange(_LENGTH, device=device)
            )
        if full.dim() != 4 or not torch.equal(full[0], values[:, index]):
            raise Refusal(
                path,
                "computes a relative position bias that is not a function of the query-key distance alone",
                "Train it without sequence parallelism",
            )
        found[path] = module
    return found


def classify(pretrained: nn.Module, calls: list[dict]) -> dict[str, tuple]:
    """Module path -> ("zero",) or ("relative", owner path, owner side) for every attention module whose calls
    pass a `position_bias=` tensor along the sequence; Refusal for any other bias."""
    proven = owners(pretrained)
    out: dict[str, tuple] = {}
    for call in calls:
        bias = call["kwargs"].get("position_bias")
        if call["q_side"] is None or not isinstance(bias, torch.Tensor):
            continue
        kind: tuple | None = None
        with torch.no_grad():
            if not bool(bias.any()):
                kind = ("zero",)
            else:
                for path, owner in proven.items():
                    mine = owner.compute_bias(call["q"][2], call["k"][2], device=bias.device)  # type: ignore[operator]
                    if mine.shape == bias.shape and torch.equal(mine, bias):
                        kind = ("relative", path, call["q_side"])
                        break
        if kind is not None and kind[0] == "relative" and call["q_side"] != call["kv_side"]:
            kind = None  # by distance between two sequences: not a bias this gathers
        if kind is None or out.get(call["module"], kind) != kind:
            raise Refusal(
                call["module"],
                "passes position_bias= (an additive bias over the whole query-key matrix) that is neither zero nor "
                "a proven relative position bias (a table by query-key distance) to the attention function",
                "Train it without sequence parallelism",
            )
        out[call["module"]] = kind
    return out
