"""Tensor + sequence parallelism at Megatron's activation memory: a block input gathered over the TP
group is saved for the backward as this rank's sequence slice and gathered again when the backward
needs it (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2: sbh(34/t) bytes per layer instead
of keeping the gathered [b, s, h] input of every attention and MLP block).

`BlockScope` is entered by the block's forward pre-hook right after it gathers the input, and left by
its forward hook. While it is active, autograd hands it every tensor a node saves (saved-tensors
hooks): one that views the gathered input's storage (the q/k/v or gate/up projections' input) is
replaced by a `_Regathered` record holding the slice; anything else goes on to the hooks that were
active before (activation checkpointing's, a profiler's), or is kept as it is. The first unpack of
a record gathers the slice again (the same all-gather, so the same values: exact) and the other
records of the block share it until the last is unpacked. Every TP rank runs the same backward
graph, so the gathers happen in the same order on every rank.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ... import _compat


def gather(x: torch.Tensor, mesh) -> DTensor:
    """This rank's slice [b, s/t, ...] -> the whole sequence, replicated over the TP group (all-gather;
    backward: reduce-scatter)."""
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])


def _local(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


class _Gathered:
    """One gathered input of the block: its slice (packed by the outer hooks), and the full tensor
    while records of it wait to be unpacked."""

    def __init__(self, shard, full: torch.Tensor, mesh, outer):
        self.mesh, self.outer = mesh, outer
        self.storage = full.untyped_storage().data_ptr()
        self.shard = outer[0](shard) if outer else shard
        self.full: torch.Tensor | None = None
        self.pending = 0

    def materialize(self) -> torch.Tensor:
        if self.full is None:
            shard = self.outer[1](self.shard) if self.outer else self.shard
            with torch.no_grad():
                self.full = gather(shard, self.mesh).to_local()  # [b, s, ...], contiguous: the forward's layout
        full = self.full
        self.pending -= 1
        if self.pending == 0:
            self.full = None  # every record of it is unpacked: free the gathered copy
        return full


class _Regathered:
    """A saved view of a gathered input: how to rebuild it from the full local tensor."""

    def __init__(self, source: _Gathered, t: torch.Tensor, local: torch.Tensor):
        self.source = source
        self.view = (local.shape, local.stride(), local.storage_offset())
        self.dtensor = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None

    def unpack(self) -> torch.Tensor:
        local = self.source.materialize().as_strided(*self.view)
        if self.dtensor is None:
            return local
        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


class BlockScope:
    """Saved-tensors hooks of one block forward (see the module docstring)."""

    def __init__(self) -> None:
        self.outer = _compat.outer_saved_tensors_hooks()
        self.sources: list[_Gathered] = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def add(self, shard: torch.Tensor, gathered: DTensor) -> None:
        full = _local(gathered)
        if full.is_contiguous() and full.storage_offset() == 0:  # the layout `materialize` rebuilds
            self.sources.append(_Gathered(shard, full, gathered.device_mesh, self.outer))

    def pack(self, t):
        if self.sources and isinstance(t, torch.Tensor):
            local = _local(t)
            ptr = local.untyped_storage().data_ptr()
            for source in self.sources:
                if ptr == source.storage:
                    source.pending += 1
                    return _Regathered(source, t, local)
        return self.outer[0](t) if self.outer else t

    def unpack(self, packed):
        if isinstance(packed, _Regathered):
            return packed.unpack()
        return self.outer[1](packed) if self.outer else packed

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
