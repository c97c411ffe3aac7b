"""FSDP2 over every rank that holds the same weights: data parallel x sequence parallel.

The ranks of an SP group hold identical weights, like data-parallel replicas, so parameters,
gradients and optimizer states shard over dp x sp (the layout's "dp_sp" mesh dim) with torch's
`fully_shard`: each rank keeps 1/(dp x sp) of the model state. Under tensor parallelism the
parameters are already TP DTensors and FSDP shards them over dp_sp as well (2D). FSDP2 reduce-
scatters gradients with an average over dp_sp, what DDP does, so the sequence-parallel loss stays
exact. Works on CPU (gloo) as well as CUDA; accelerate's FSDP plugin asks for it
(`distributed_type: FSDP`, `fsdp_version: 2`), which on CPU the Trainer would otherwise ignore.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
from torch import nn

from ..models.families import unwrap
from ..models.patch import family_of

logger = logging.getLogger(__name__)


def fsdp_requested(args) -> bool:
    """FSDP asked for by the training arguments (`--fsdp full_shard`) or by accelerate's config."""
    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def is_fully_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard_model(model: nn.Module, layout, reshard_after_forward: bool = True) -> dict:
    """`fully_shard` every layer, then the whole model, over `layout.submesh("dp_sp")`. Returns (and logs)
    what was sharded over which ranks. The model must be patched (and tensor-parallel) first."""
    from torch.distributed.fsdp import fully_shard

    family = family_of(model)  # raises if the model is not patched yet
    ranks = layout.world_size // layout.sizes.tp_size
    summary = {
        "ranks": ranks,
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    if ranks == 1:
        summary["sharded"] = False
        return summary
    mesh = layout.submesh("dp_sp")
    units = 0
    for stack in family.layer_stacks:
        for layer in getattr(stack, "layers", []):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
            units += 1
    fully_shard(unwrap(model), mesh=mesh, reshard_after_forward=reshard_after_forward)
    group_ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    summary.update(
        sharded=True,
        units=units + 1,
        group=group_ranks,
        local_bytes=sum(_local(p).numel() * p.element_size() for p in model.parameters()),
    )
    logger.info(
        "FSDP2: %.1fM parameters (%.1f MiB) sharded over ranks %s (dp %d x sp %d), %d units; this rank holds %.1f MiB",
        summary["parameters"] / 1e6,
        summary["bytes"] / 2**20,
        group_ranks,
        layout.dp_size,
        layout.sp_size,
        units + 1,
        summary["local_bytes"] / 2**20,
    )
    return summary


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


@contextlib.contextmanager
def full_parameters(model: nn.Module):
    """Hold every FSDP unit's full parameters for the block, with no collectives inside it.

    Generation calls submodules (the encoder, one decoder step at a time) rather than the root, and
    each SP rank generates its own rows for its own number of steps: per-layer all-gathers would
    meet an unsharded root and ranks that stopped early. Gathered once here, it runs locally."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield model
        return
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)
