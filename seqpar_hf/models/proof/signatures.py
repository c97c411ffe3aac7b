"""Per-token fingerprints of the tensors a module takes and returns in a dry run, so that the full
sequence's run and a shard's run can be compared token by token (models/proof/probe.py).

A tensor's sequence dim is the first of dims 1, 2, 0, 3, ... whose size is a sequence length of the run
(or batch x length at dim 0: tokens flattened, as MoE routers do). Everything else at one token is
projected on a few fixed random directions: [b, L, k] float64 (b = 1 when the tensor has no batch
dim). Token t of the full run and the same token in a shard's run then have the same fingerprint
exactly when the module computed the same thing there (up to rounding).
"""

from __future__ import annotations

import torch

K = 3  # random directions per token
_DIMS = (1, 2, 0, 3, 4, 5)
_PROJECTIONS: dict = {}


def _projection(width: int, device) -> torch.Tensor:
    """[width, K] fixed pseudo-random directions (no RNG: the same in every run, on every rank, and not
    touched by a dry run's neutralised random draws)."""
    key = (width, str(device))
    if key not in _PROJECTIONS:
        i = torch.arange(1, width + 1, dtype=torch.float64)[:, None]
        j = torch.arange(1, K + 1, dtype=torch.float64)[None, :]
        _PROJECTIONS[key] = torch.sin(i * j * 12.9898 + j * 78.233).to(device)
    return _PROJECTIONS[key]


class Fingerprint:
    """[b, L, K] float64 per-token projection of a tensor along its sequence dim, with its side."""

    __slots__ = ("side", "values", "exact", "width")

    def __init__(self, side: str, values: torch.Tensor, exact: bool, width: int):
        self.side, self.values, self.exact, self.width = side, values, exact, width


def fingerprint(x, lengths: dict, batch: int) -> Fingerprint | None:
    """The fingerprint of `x`, or None when it is not a tensor with a sequence dim of this run.
    `lengths`: {sequence length: side} of the run; `batch`: its batch size."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.is_complex() or x.device.type == "meta":
        return None
    exact = not x.is_floating_point()
    for d in _DIMS:
        if d >= x.dim():
            continue
        n = x.shape[d]
        if n in lengths:
            side = lengths[n]
            y = x.movedim(d, 1) if (d != 0 and x.shape[0] == batch) else x.movedim(d, 0).unsqueeze(0)
            break
        if d == 0 and batch > 1 and n % batch == 0 and n // batch in lengths:  # [b * L, ...] flattened tokens
            side = lengths[n // batch]
            y = x.reshape(batch, n // batch, *x.shape[1:])
            break
    else:
        return None
    y = y.detach().reshape(y.shape[0], y.shape[1], -1).to(torch.float64)  # [b, L, rest]
    return Fingerprint(side, y @ _projection(y.shape[-1], y.device), exact, y.shape[-1])  # [b, L, K]


def collect(obj, lengths: dict, batch: int, path: str = "", out: dict | None = None, depth: int = 0) -> dict:
    """{path: Fingerprint} of every tensor in nested args / kwargs / outputs."""
    out = {} if out is None else out
    if depth > 4:
        return out
    if isinstance(obj, torch.Tensor):
        fp = fingerprint(obj, lengths, batch)
        if fp is not None:
            out[path] = fp
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            collect(x, lengths, batch, f"{path}.{i}", out, depth + 1)
    elif isinstance(obj, dict) or (hasattr(obj, "items") and hasattr(obj, "keys")):
        try:
            items = list(obj.items())
        except Exception:  # noqa: BLE001 - not a mapping after all
            return out
        for k, x in items:
            collect(x, lengths, batch, f"{path}.{k}", out, depth + 1)
    return out


def error(full: Fingerprint, full_keep: torch.Tensor, shard: Fingerprint, local_keep: torch.Tensor) -> float | None:
    """Relative difference of a shard's fingerprint at its tokens `local_keep` and the full run's at the
    same tokens `full_keep` (index tensors of equal length); None when the two cannot be compared."""
    if full.values.shape[0] != shard.values.shape[0] or full.width != shard.width:
        return None  # another shape per token (e.g. a [q, k] mask): not comparable
    a = full.values.index_select(1, full_keep.to(full.values.device))
    b = shard.values.index_select(1, local_keep.to(shard.values.device)).to(a.device)
    if not a.numel():
        return 0.0
    diff = (a - b).abs().max().item()
    if full.exact:
        return 0.0 if diff == 0 else float("inf")
    return diff / max(a.abs().max().item(), 1e-30)
