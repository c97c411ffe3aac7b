"""Cheap group-wide check that every rank of an SP group got the same batch.

Ranks of an SP group must pass the same, full batch. If they do not (a sampler that shards by
world rank, a collator with randomness, ...), each rank would shard a different sequence: a silent
wrong result, or a hang when ranks disagree on lengths or masks. Before any other collective, the
patched forward all-gathers a small fingerprint of its inputs (presence, dtype, shape and a
position-weighted checksum of every input tensor) and raises the same error on every rank if they
differ.
"""

from __future__ import annotations

import torch

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


def check_same_batch(inputs: dict, training: bool, group, device) -> None:
    """Raise ValueError on every rank of `group` if their batches differ (one tiny all-gather)."""
    n = group_size(group)
    if n == 1:
        return
    mine = fingerprint(inputs, training, device)
    everyone = mine.new_empty((n, *mine.shape))
    all_gather_into(everyone, mine.unsqueeze(0), group=group)  # [n, fields, slots]
    everyone = everyone.tolist()
    if all(rows == everyone[0] for rows in everyone):
        return
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
    raise ValueError("ranks of one sequence-parallel group got different batches (" + "; ".join(problems) + "). "
                     "Every rank of an SP group must pass the same, full batch: shard data over "
                     "layout.dp_size / layout.dp_rank, not over the world (SequenceParallelTrainer does this).")
