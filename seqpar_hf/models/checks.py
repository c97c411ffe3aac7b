"""Cheap group-wide check that every rank of an SP group got the same batch.

Ranks of an SP group must pass the same, full batch. If they do not (a sampler that shards by
world rank, a collator with randomness, ...), each rank would shard a different sequence: a silent
wrong result, or a hang when ranks disagree on lengths or masks. Before any other collective, the
patched forward all-gathers a small fingerprint of its inputs (presence, dtype, shape and a
position-weighted checksum of every input tensor) and raises the same error on every rank if they
differ. `generate` under SP makes one such check of its inputs and settings (`check_same_generation`).
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from ..parallel.comm import all_gather_into, group_size

FIELDS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels", "shift_labels", "cu_seq_lens_q",
          "decoder_input_ids", "decoder_inputs_embeds", "decoder_attention_mask", "decoder_position_ids")
_SLOTS = 6  # present, dtype, ndim, dim 0, dim 1, checksum
_DTYPES = {dt: i for i, dt in enumerate((torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                         torch.float16, torch.bfloat16, torch.float32, torch.float64))}
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(x: torch.Tensor) -> torch.Tensor:
    """Exact, order-sensitive integer checksum (floats by their bits)."""
    flat = x.detach().contiguous().reshape(-1)
    if flat.dtype.is_floating_point:
        flat = flat.view(_INT_VIEW[flat.element_size()])
    weights = torch.arange(flat.numel(), device=flat.device) % 65521 + 1
    return (flat.long() * weights).sum()


def fingerprint(inputs: dict, training: bool, device) -> torch.Tensor:
    rows = [torch.tensor([int(training), 0, 0, 0, 0, 0], device=device)]
    for name in FIELDS:
        x = inputs.get(name)
        if not isinstance(x, torch.Tensor):
            rows.append(torch.zeros(_SLOTS, dtype=torch.long, device=device))
            continue
        shape = list(x.shape) + [-1, -1]
        meta = torch.tensor([1, _DTYPES.get(x.dtype, 99), x.dim(), shape[0], shape[1]], device=device)
        rows.append(torch.cat([meta, _checksum(x).to(device).reshape(1)]))
    return torch.stack(rows)  # [1 + len(FIELDS), _SLOTS]


def _gather(mine: torch.Tensor, group) -> list:
    everyone = mine.new_empty((group_size(group), *mine.shape))
    all_gather_into(everyone, mine.unsqueeze(0), group=group)  # [n, rows, slots]
    return everyone.tolist()


def _field_problems(everyone: list) -> list[str]:
    problems = []
    if len({rows[0][0] for rows in everyone}) > 1:
        problems.append(f"model.training differs: {[rows[0][0] for rows in everyone]}")
    for i, name in enumerate(FIELDS, start=1):
        per_rank = [rows[i] for rows in everyone]
        if all(r == per_rank[0] for r in per_rank):
            continue
        if len({r[0] for r in per_rank}) > 1:
            problems.append(f"{name} given on ranks {[k for k, r in enumerate(per_rank) if r[0]]} only")
        elif len({tuple(r[1:5]) for r in per_rank}) > 1:
            problems.append(f"{name} shapes differ: {[tuple(d for d in r[3:5] if d >= 0) for r in per_rank]}")
        else:
            problems.append(f"{name} values differ")
    return problems


def check_same_batch(inputs: dict, training: bool, group, device) -> None:
    """Raise ValueError on every rank of `group` if their batches differ (one tiny all-gather)."""
    if group_size(group) == 1:
        return
    everyone = _gather(fingerprint(inputs, training, device), group)
    if all(rows == everyone[0] for rows in everyone):
        return
    problems = "; ".join(_field_problems(everyone))
    raise ValueError("ranks of one sequence-parallel group got different batches (" + problems + "). Every rank of "
                     "an SP group must pass the same, full batch: shard data over layout.dp_size / layout.dp_rank, not "
                     "over the world (SequenceParallelTrainer does this).")


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _settings_text(settings: dict) -> str:
    # objects (logits processors, callables) by type: their reprs hold addresses that differ per process
    return json.dumps(settings, sort_keys=True, default=lambda o: type(o).__qualname__)


def check_same_generation(inputs: dict, settings: dict, rng_state: torch.Tensor | None, refusal: str | None,
                          training: bool, group, device) -> None:
    """One all-gather before generation under SP: the tensors of the `generate` call (FIELDS, and every other
    tensor argument by name), its settings (`settings`: the merged generation config and the other
    arguments), the sampling generator's state (`rng_state`, None when not sampling) and whether this rank
    refuses the call. Raises ValueError on every rank of `group` if they differ, before any other collective,
    so no rank is left waiting in one."""
    others = sorted((k, v) for k, v in inputs.items() if isinstance(v, torch.Tensor) and k not in FIELDS)
    extra = [_hash(_settings_text(settings)),
             _hash(repr([(k, str(v.dtype), tuple(v.shape), int(_checksum(v))) for k, v in others])),
             0 if rng_state is None else int(_checksum(rng_state)), int(refusal is not None), 0, 0]
    mine = torch.cat([fingerprint(inputs, training, device), torch.tensor([extra], device=device)])
    everyone = _gather(mine, group)
    if all(rows == everyone[0] for rows in everyone):
        return
    problems = _field_problems([rows[:-1] for rows in everyone])
    last = [rows[-1] for rows in everyone]
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
