"""Count the collectives a block of code takes, and their bytes, on this rank.

Every public collective of `torch.distributed` is wrapped, also where a seqpar_hf module holds its own
reference to one (`comm.all_gather_into`). Bytes: what this rank sends (its input tensors)."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

NAMES = (
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather",
    "all_reduce",
    "all_to_all_single",
    "all_to_all",
    "reduce_scatter_tensor",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "all_gather_object",
)


def _bytes(args) -> int:
    total = 0
    for a in args:
        if isinstance(a, torch.Tensor):
            total += a.numel() * a.element_size()
        elif isinstance(a, (list, tuple)):
            total += _bytes(a)
    return total


@contextlib.contextmanager
def counting():
    """Yields a list that receives (name, bytes sent) per collective taken inside the block."""
    calls: list[tuple[str, int]] = []
    originals = {name: getattr(dist, name) for name in NAMES if hasattr(dist, name)}
    replaced = []  # (object, attribute, original)

    def wrap(name, fn):
        def counted(*args, **kwargs):
            inputs = (
                args[1:2]
                if name in ("all_gather_into_tensor", "all_gather_single", "all_to_all_single", "reduce_scatter_tensor")
                else args[:1]
            )
            calls.append((name, _bytes(inputs) if name != "all_gather" else _bytes(args[1:2])))
            return fn(*args, **kwargs)

        return counted

    wrappers = {id(fn): wrap(name, fn) for name, fn in originals.items()}
    for module in [dist] + [m for n, m in list(sys.modules.items()) if n.startswith("seqpar_hf") and m is not None]:
        for attr, value in list(vars(module).items()):
            if id(value) in wrappers and callable(value):
                replaced.append((module, attr, value))
                setattr(module, attr, wrappers[id(value)])
    try:
        yield calls
    finally:
        for module, attr, value in replaced:
            setattr(module, attr, value)
