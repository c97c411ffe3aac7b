"""The one check before `generate` under SP: every rank of the SP group passes the same inputs and the
same generation settings (and, when sampling, the same generator state), or all raise, naming what
differs, before any other collective. It sends the forward's fingerprint (`checks`: input tensors, the
layout, the attention implementation, the weights), with generate's own row filled: the settings' hash, the
other tensor arguments, the generator state, and whether this rank refuses the call (so one rank's refusal
raises everywhere). The same structure as a forward's: a rank in generate while another is in a forward
raises on both, saying so.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ...parallel.comm import group_size
from ..forward.checks import (
    EXTRA_ROWS,
    FIELDS,
    GENERATE,
    GENERATE_ROW,
    agree,
    batch_problems,
    call_values,
    checksum,
    exchange,
    fingerprint,
    forward_settings,
    weights_problems,
)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _canonical(value):
    """`value` as plain JSON data, the same in every process for the same argument. Mappings with keys other
    than strings (`sequence_bias={(11,): 5.0}`) become [key, value] pairs sorted by the key's text; tensors
    (dtype, shape, checksum); objects by type and callables by name: logits processors, stopping criteria
    and functions are not compared by state (reprs hold addresses, and a MaxTimeCriteria its start time)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {"tensor": [str(value.dtype), list(value.shape), int(checksum(value))]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value):
            return {k: _canonical(v) for k, v in value.items()}  # json sorts them
        pairs = [[_canonical(k), _canonical(v)] for k, v in value.items()]
        return {"pairs": sorted(pairs, key=lambda kv: json.dumps(kv[0], sort_keys=True))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_canonical(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (torch.dtype, torch.device, enum.Enum)):
        return str(value)
    kind = value if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__") else type(value)
    return f"<{getattr(kind, '__module__', '')}.{getattr(kind, '__qualname__', type(kind).__name__)}>"


def settings_text(settings: dict) -> str:
    return json.dumps(_canonical(settings), sort_keys=True)


def check_same_generation(
    state,
    inputs: dict,
    settings: dict,
    rng_state: torch.Tensor | None,
    refusal: str | None,
    training: bool,
    group,
    device,
) -> None:
    """Raise on every rank of `group` if their `generate` calls (or weights) differ, or if a rank is in a forward
    instead (one all-gather)."""
    others = sorted((k, v) for k, v in inputs.items() if isinstance(v, torch.Tensor) and k not in FIELDS)
    extra = [
        _hash(settings_text(settings)),
        _hash(repr([(k, str(v.dtype), tuple(v.shape), int(checksum(v))) for k, v in others])),
        0 if rng_state is None else int(checksum(rng_state)),
        int(refusal is not None),
    ]
    call = call_values(GENERATE, state.family.pretrained, device, extra)
    rows = fingerprint(inputs, forward_settings(state, training, {}), device, call)  # what a forward sends
    mine = torch.cat([rows, rows.new_zeros(EXTRA_ROWS, rows.shape[1])])  # [COMPARED + EXTRA_ROWS, slots]
    everyone = exchange(mine, group, "in the input check at the start of generate")  # raises if in another call
    if agree(everyone):
        return
    problems = batch_problems(everyone)
    last = [r[GENERATE_ROW] for r in everyone]
    if len({r[1] for r in last}) > 1:
        problems.append("other tensor arguments differ")
    if len({r[3] for r in last}) > 1:
        problems.append(f"refused on ranks {[k for k, r in enumerate(last) if r[3]]} only ({refusal or 'not here'})")
    elif len({r[0] for r in last}) > 1:  # every rank is here: name the settings that differ
        every: list[Any] = [None] * group_size(group)
        dist.all_gather_object(every, json.loads(settings_text(settings)), group=group)
        keys = sorted(k for k in set().union(*every) if len({json.dumps(e.get(k), sort_keys=True) for e in every}) > 1)
        problems.append(
            "generation settings differ: " + ", ".join(f"{k} {[e.get(k) for e in every]}" for k in keys[:8])
        )
    if len({r[2] for r in last}) > 1:
        problems.append(
            "the random generators' states differ (sampling draws the same tokens on every rank only "
            "from the same state: torch.manual_seed(same seed) on every rank before generate)"
        )
    weights = weights_problems(everyone)
    batch = (
        (
            "ranks of one sequence-parallel group called generate with different inputs or settings ("
            + "; ".join(problems)
            + "). Every rank of an SP group must pass the same, full batch and the same "
            "generation arguments; each returns the whole batch's tokens."
        )
        if problems
        else ""
    )
    raise (ValueError if problems else RuntimeError)(" ".join(m for m in (batch, weights) if m))
