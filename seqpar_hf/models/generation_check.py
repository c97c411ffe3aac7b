"""The one check before `generate` under SP: every rank of the SP group passes the same inputs and the
same generation settings (and, when sampling, the same generator state), or all raise, naming what
differs, before any other collective. It reuses the forward's fingerprint (`checks`: input tensors, the
layout, the attention implementation) and adds one row: the settings' hash, the other tensor arguments,
the generator state, and whether this rank refuses the call (so one rank's refusal raises everywhere).
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from ..parallel.agree import explain_timeout
from ..parallel.comm import all_gather_into, group_size
from .checks import FIELDS, _checksum, _problems, fingerprint, forward_settings


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _settings_text(settings: dict) -> str:
    # objects (logits processors, callables) by type: their reprs hold addresses that differ per process
    return json.dumps(settings, sort_keys=True, default=lambda o: type(o).__qualname__)


def check_same_generation(state, inputs: dict, settings: dict, rng_state: torch.Tensor | None, refusal: str | None,
                          training: bool, group, device) -> None:
    """Raise ValueError on every rank of `group` if their `generate` calls differ (one all-gather)."""
    others = sorted((k, v) for k, v in inputs.items() if isinstance(v, torch.Tensor) and k not in FIELDS)
    extra = [_hash(_settings_text(settings)),
             _hash(repr([(k, str(v.dtype), tuple(v.shape), int(_checksum(v))) for k, v in others])),
             0 if rng_state is None else int(_checksum(rng_state)), int(refusal is not None)]
    rows = fingerprint(inputs, forward_settings(state, training, {}), device)
    extra_row = torch.tensor([extra + [0] * (rows.shape[1] - len(extra))], dtype=torch.long, device=device)
    mine = torch.cat([rows, extra_row])  # [len(FIELDS) + 4, slots]
    everyone = mine.new_empty((group_size(group), *mine.shape))
    with explain_timeout("in the input check at the start of generate"):
        all_gather_into(everyone, mine.unsqueeze(0), group=group)
    everyone = everyone.tolist()
    if all(r == everyone[0] for r in everyone):
        return
    problems = _problems([r[:-1] for r in everyone])
    last = [r[-1] for r in everyone]
    if len({r[1] for r in last}) > 1:
        problems.append("other tensor arguments differ")
    if len({r[3] for r in last}) > 1:
        problems.append(f"refused on ranks {[k for k, r in enumerate(last) if r[3]]} only ({refusal or 'not here'})")
    elif len({r[0] for r in last}) > 1:  # every rank is here: name the settings that differ
        every = [None] * group_size(group)
        dist.all_gather_object(every, json.loads(_settings_text(settings)), group=group)
        keys = sorted(k for k in set().union(*every) if len({json.dumps(e.get(k), sort_keys=True) for e in every}) > 1)
        problems.append("generation settings differ: " + ", ".join(
            f"{k} {[e.get(k) for e in every]}" for k in keys[:8]))
    if len({r[2] for r in last}) > 1:
        problems.append("the random generators' states differ (sampling draws the same tokens on every rank only "
                        "from the same state: torch.manual_seed(same seed) on every rank before generate)")
    raise ValueError("ranks of one sequence-parallel group called generate with different inputs or settings ("
                     + "; ".join(problems) + "). Every rank of an SP group must pass the same, full batch and the "
                     "same generation arguments; each returns the whole batch's tokens.")
