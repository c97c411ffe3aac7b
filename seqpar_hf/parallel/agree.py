"""Ranks that are about to take collectives together first check that they agree, so that a disagreement
is an error on every rank that names what differs, never a hang in mismatched collectives.

- `same_on_every_rank`: one small all-gather of the `repr` of a few values (e.g. the sizes of a layout
  before its mesh is built); raises the same ValueError on every rank when they differ.
- `explain_timeout`: a collective that still times out (a rank that stopped, raised, or runs other
  code) is re-raised with what the waiting rank was doing and what usually causes it.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from .comm import all_gather_into, group_size

_WIDTH = 48  # bytes of each value's repr compared (longer reprs are cut: values that differ only later agree)


def _encode(values: dict, device) -> torch.Tensor:
    rows = []
    for value in values.values():
        raw = repr(value).encode("utf-8", "replace")[:_WIDTH]
        rows.append(list(raw) + [0] * (_WIDTH - len(raw)))
    return torch.tensor(rows, dtype=torch.uint8, device=device)  # [fields, _WIDTH]


def _decode(row: list[int]) -> str:
    return bytes(b for b in row if b).decode("utf-8", "replace")


def agreement_device(device_type: str | None) -> torch.device:
    """Where an agreement runs before a mesh exists. On CUDA, the device the mesh will pick (torch's rule:
    LOCAL_RANK, else rank modulo the devices), unless the process already chose one."""
    if device_type != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_initialized():
        local = os.environ.get("LOCAL_RANK")
        torch.cuda.set_device(int(local) if local is not None else dist.get_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def same_on_every_rank(values: dict, group, device, what: str, fix: str) -> None:
    """Raise ValueError on every rank of `group` unless every rank passes the same `values` (compared by
    repr). One all-gather of len(values) x 48 bytes per rank."""
    n = group_size(group)
    if n == 1:
        return
    mine = _encode(values, device)
    everyone = mine.new_empty((n, *mine.shape))
    with explain_timeout(f"comparing {what} across ranks"):
        all_gather_into(everyone, mine.unsqueeze(0), group=group)  # [n, fields, _WIDTH]
    rows = everyone.tolist()
    problems = []
    for i, name in enumerate(values):
        per_rank = [_decode(rank_rows[i]) for rank_rows in rows]
        if len(set(per_rank)) > 1:
            problems.append(f"{name}: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(per_rank)))
    if problems:
        raise ValueError(f"ranks disagree on {what} ({'; '.join(problems)}). {fix}")


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


@contextlib.contextmanager
def explain_timeout(doing: str):
    """Re-raise a collective's timeout with what this rank was doing and why ranks usually get there."""
    try:
        yield
    except RuntimeError as exc:
        if not is_timeout(exc):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise RuntimeError(
            f"seqpar_hf: rank {rank} timed out {doing}: the other ranks of its group never joined this "
            "collective, so the ranks of a sequence-parallel layout disagreed on what to run (one raised or stopped, "
            "skipped a forward, or runs other code or another layout). Look for the first error in the other ranks' "
            f"logs. ({type(exc).__name__}: {exc})"
        ) from exc
