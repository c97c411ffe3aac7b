"""Whole-model checkpoints of models whose parameters are DTensors (tensor parallelism, FSDP2).

torch's distributed state-dict API gathers the shards into full tensors (every rank takes part; rank
0 keeps them) and scatters full tensors back into any layout, so a checkpoint is a plain transformers
checkpoint that `from_pretrained` loads without seqpar_hf, and the optimizer state is the one a
single process would save: a run can resume on another layout.

On resume, a checkpoint that misses a weight of the model, or holds one the model does not have, is an
error on every rank (every rank reads the file), on every path: transformers only logs a warning for
plain models and torch's `strict=False` says nothing, and the run would go on from the missing weights'
fresh values. Tied weights saved once (`lm_head.weight` = the embedding) and the model's
`_keys_to_ignore_on_save` (Marian's sinusoidal tables) are not missing.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _options(**kwargs) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state_dict(model: torch.nn.Module) -> dict:
    """Every parameter and buffer as a full CPU tensor on rank 0 (other ranks: {}). Collective."""
    return get_model_state_dict(model, options=_options(cpu_offload=True))


def load_full_model_state_dict(model: torch.nn.Module, state_dict: dict, source: str = "the checkpoint") -> None:
    """Full tensors (read on every rank) into the model's layout; raises (on every rank, before any
    collective) when `state_dict` misses a weight of the model or holds another."""
    keys = set(model.state_dict().keys())
    check_keys(model, sorted(keys - set(state_dict)), sorted(set(state_dict) - keys), source)
    set_model_state_dict(model, state_dict, options=_options(strict=False))


def unexplained_missing(model: torch.nn.Module, missing: list[str]) -> list[str]:
    """The missing keys that are neither tied to a key that was loaded nor left out of checkpoints on purpose."""
    missing_set = set(missing)
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # tied key -> the key it is saved under
    aliases: dict[int, list[str]] = {}  # one tensor, all its names (weights tied by identity)
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        aliases.setdefault(id(tensor), []).append(name)
    names = {name: group for group in aliases.values() for name in group}
    return [
        key
        for key in missing
        if key not in ignored
        and (tied.get(key) is None or tied[key] in missing_set)
        and all(alias in missing_set for alias in names.get(key, [key]))
    ]


def check_keys(model: torch.nn.Module, missing: list[str], unexpected: list[str], source: str) -> None:
    """RuntimeError (torch's class for a strict load) naming the keys, unless every missing one is explained."""
    missing = unexplained_missing(model, missing)
    if not missing and not unexpected:
        return
    parts = ([f"misses {len(missing)} weight(s) of the model: {missing[:8]}"] if missing else []) + (
        [f"holds {len(unexpected)} the model does not have: {list(unexpected)[:8]}"] if unexpected else []
    )
    raise RuntimeError(
        f"{source} " + " and ".join(parts) + f" ({type(model).__name__}); a resumed run would go on "
        "from fresh values for the missing ones. Resume from a checkpoint of this model and config."
    )


def full_optimizer_state_dict(model: torch.nn.Module, optimizer) -> dict:
    """The optimizer state one process would hold, on rank 0 (other ranks: {}). Collective."""
    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_full_optimizer_state_dict(model: torch.nn.Module, optimizer, state_dict: dict) -> None:
    set_optimizer_state_dict(model, optimizer, state_dict, options=_options())
