"""Whole-model checkpoints of models whose parameters are DTensors (tensor parallelism, FSDP2).

torch's distributed state-dict API gathers the shards into full tensors (every rank takes part; rank
0 keeps them) and scatters full tensors back into any layout, so a checkpoint is a plain transformers
checkpoint that `from_pretrained` loads without seqpar_hf, and the optimizer state is the one a
single process would save: a run can resume on another layout.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _options(**kwargs) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state_dict(model: torch.nn.Module) -> dict:
    """Every parameter and buffer as a full CPU tensor on rank 0 (other ranks: {}). Collective."""
    return get_model_state_dict(model, options=_options(cpu_offload=True))


def load_full_model_state_dict(model: torch.nn.Module, state_dict: dict) -> None:
    """Full tensors (read on every rank) into the model's layout."""
    set_model_state_dict(model, state_dict, options=_options(strict=False))


def full_optimizer_state_dict(model: torch.nn.Module, optimizer) -> dict:
    """The optimizer state one process would hold, on rank 0 (other ranks: {}). Collective."""
    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_full_optimizer_state_dict(model: torch.nn.Module, optimizer, state_dict: dict) -> None:
    set_optimizer_state_dict(model, optimizer, state_dict, options=_options())
