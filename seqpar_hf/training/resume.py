"""Resuming from a checkpoint, at the layout it was written at or at another one.

A checkpoint records the layout it was written at (`seqpar_layout.json`: sp, tp, dp, mode, FSDP) and the
names of the parameters in each group of its optimizer. Before `train(resume_from_checkpoint=...)` loads
anything, every rank checks the checkpoint (`check`, agreed over the ranks before the resume's first
collective):
- a truncated or corrupt file (weights, trainer state, optimizer, scheduler, rng state) is an error naming
  the file and the fix, where safetensors, json and torch name neither;
- a missing optimizer.pt or scheduler.pt is a warning: the Trainer would start both fresh without a word;
- optimizer state that cannot be matched to this run's parameters is an error naming both layouts and the fix.

Optimizer state moves between layouts by parameter name, exactly: a model without DTensor parameters saves
torch's `Optimizer.state_dict()` (parameters numbered across the groups), a tensor-parallel or FSDP2 model
the full state by name (`checkpoint.full_optimizer_state_dict`), and the Trainer splits its groups per
device mesh. `converted` renames and regroups the same tensors for torch's `set_optimizer_state_dict`;
the scheduler's per-group values follow their groups.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
import zipfile

import torch

from .. import _compat
from . import checkpoint, fsdp

logger = logging.getLogger(__name__)

RECORD_NAME = "seqpar_layout.json"
# per-group values in torch's schedulers' state (LambdaLR, MultiplicativeLR, CyclicLR, ReduceLROnPlateau, ...)
SCHEDULER_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs")


# ---- what a checkpoint records ------------------------------------------------------------------


def describe(layout, model, optimizer=None) -> dict:
    """The layout a checkpoint written now is written at, and how its optimizer state is keyed."""
    record = {
        "sp_size": layout.sp_size,
        "tp_size": layout.sizes.tp_size,
        "dp_size": layout.dp_size,
        "world_size": layout.world_size,
        "mode": layout.mode,
        "ring_size": layout.ring_size,
        "fsdp": fsdp.is_fully_sharded(model),
        "optimizer_keys": "names" if checkpoint.is_sharded(model) else "numbers",
    }
    if optimizer is not None:
        record["optimizer_groups"] = group_names(model, optimizer)
    return record


def group_names(model, optimizer) -> list[list[str]] | None:
    """The names of the parameters of each group (None: the optimizer holds tensors that are not the model's)."""
    names = {id(p): n for n, p in model.named_parameters()}
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        return None
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def write_record(folder: str, record: dict) -> None:
    with open(os.path.join(folder, RECORD_NAME), "w") as f:
        json.dump(record, f, indent=1)


def shown(record: dict | None) -> str:
    if record is None:
        return "a layout it does not record (no seqpar_layout.json)"
    return (
        f"sp_size={record['sp_size']}, tp_size={record['tp_size']}, dp_size={record['dp_size']}"
        f"{', FSDP' if record.get('fsdp') else ''}"
    )


# ---- before loading: every file readable --------------------------------------------------------


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _read_safetensors(path: str) -> None:
    from safetensors import safe_open

    with safe_open(path, "pt"):  # parses the header and checks that the file covers every tensor it lists
        pass


def _read_zip(path: str) -> None:
    zipfile.ZipFile(path).close()  # torch's format is a zip: its directory, at the end, is gone from a truncated file


def _read_torch(path: str):
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)  # mapped: the tensors are not read


def _files(folder: str):
    """(path, reader) of every file of the checkpoint that resuming reads and that is there."""
    readers = {
        "trainer_state.json": _read_json,
        RECORD_NAME: _read_json,
        "model.safetensors.index.json": _read_json,
        "model.safetensors": _read_safetensors,
        "adapter_model.safetensors": _read_safetensors,
        "pytorch_model.bin": _read_zip,
        "adapter_model.bin": _read_zip,
        "scaler.pt": _read_zip,
        _compat.OPTIMIZER_NAME: _read_torch,
        _compat.SCHEDULER_NAME: _read_torch,
    }
    for name in sorted(os.listdir(folder)):
        if name in readers:
            yield os.path.join(folder, name), readers[name]
        elif name.endswith(".safetensors"):  # the shards of a sharded checkpoint
            yield os.path.join(folder, name), _read_safetensors
        elif name.startswith("rng_state") and name.endswith(".pth"):
            yield os.path.join(folder, name), _read_zip


def check(folder: str, current: dict) -> None:
    """Raise ValueError naming the file and the fix for anything that would fail the resume; warn when the
    optimizer and scheduler would start fresh. `current`: `describe` of this run (no optimizer yet)."""
    if not os.path.isdir(folder):
        return  # the Trainer says "Can't find a valid checkpoint"
    read = {}
    for path, reader in _files(folder):
        try:
            read[os.path.basename(path)] = reader(path)
        except Exception as exc:
            raise ValueError(
                f"{path} cannot be read ({type(exc).__name__}: {exc}): the file is truncated or corrupt (a save that "
                f"was interrupted, a full disk). Resume from an earlier checkpoint, or delete {folder} "
                "(resume_from_checkpoint=True then takes the one before it)"
            ) from exc
    missing = [n for n in (_compat.OPTIMIZER_NAME, _compat.SCHEDULER_NAME) if n not in read]
    if missing:
        step = (read.get("trainer_state.json") or {}).get("global_step", "?")
        warnings.warn(
            f"{folder} has no {' or '.join(missing)}: the optimizer and the learning-rate scheduler start "
            f"fresh (no optimizer moments, the schedule from its first step) while training resumes at step "
            f"{step}. Resume from a checkpoint that has both to continue the same run.",
            stacklevel=3,
        )
        return
    record = read.get(RECORD_NAME)
    if (
        _keys(read[_compat.OPTIMIZER_NAME]) == "numbers"
        and current["optimizer_keys"] == "names"
        and not (record or {}).get("optimizer_groups")
    ):
        raise ValueError(
            _refusal(
                os.path.join(folder, _compat.OPTIMIZER_NAME),
                record,
                current,
                "numbers the parameters (torch's Optimizer.state_dict, saved for a model without DTensor parameters) "
                "without recording their names, so its state cannot be matched to this tensor-parallel or FSDP "
                "model's parameters",
                "a checkpoint saved there records the names and resumes at any layout",
                written="tp_size=1 without FSDP",
            )
        )


def _keys(state: dict) -> str:
    return "numbers" if all(isinstance(k, int) for k in state.get("state", {})) else "names"


def _refusal(path: str, record: dict | None, current: dict, why: str, then: str = "", written: str = "") -> str:
    """`written`: the layout it was written at, as far as the state itself tells, when the checkpoint records none."""
    written = shown(record) if record is not None else written
    return (
        f"{path} was written at {shown(record) if record is not None else 'another layout'} and this run is at "
        f"{shown(current)}: it {why}. Resume at the layout it was written at{f' ({written})' if written else ''} "
        f"or from a checkpoint written at this one{'; ' + then if then else ''}"
    )


# ---- loading: the optimizer state by name, regrouped -------------------------------------------


def has_optimizer_state(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, n)) for n in (_compat.OPTIMIZER_NAME, _compat.SCHEDULER_NAME))


def converted(folder: str, model, optimizer, current: dict) -> tuple[dict, dict] | None:
    """(optimizer state by name, scheduler state) to load into `optimizer` when the checkpoint keys or groups its
    state otherwise than this run does; None: it loads as saved (the Trainer's own path)."""
    path = os.path.join(folder, _compat.OPTIMIZER_NAME)
    groups = group_names(model, optimizer)
    if groups is None:
        return None
    saved, record = _read_torch(path), _record(folder)
    if _keys(saved) == "numbers":
        names = (record or {}).get("optimizer_groups")
        if names is None:
            return None  # not recorded: loads as saved into a model like the one that wrote it (checked before)
        if names == groups and current["optimizer_keys"] == "numbers":
            return None
        saved = _by_name(saved, names, path)
    elif [list(g["params"]) for g in saved["param_groups"]] == groups and current["optimizer_keys"] == "names":
        return None
    sources = group_sources(saved, groups, path, record, current)
    scheduler = torch.load(os.path.join(folder, _compat.SCHEDULER_NAME), map_location="cpu", weights_only=True)
    scheduler = regroup_scheduler(scheduler, sources, len(saved["param_groups"]), path, record, current)
    # this run's groups, each with the settings of the group its parameters were saved in: torch's loader would
    # give the settings of a saved group to one of the groups it was split into only
    regrouped = [{**saved["param_groups"][s], "params": group} for s, group in zip(sources, groups)]
    logger.info(
        "%s was written at %s; this run is at %s: its state is loaded by parameter name into %d groups",
        path,
        shown(record),
        shown(current),
        len(groups),
    )
    return {"state": saved["state"], "param_groups": regrouped}, scheduler


def _record(folder: str) -> dict | None:
    path = os.path.join(folder, RECORD_NAME)
    return _read_json(path) if os.path.isfile(path) else None


def _by_name(state: dict, names: list[list[str]], path: str) -> dict:
    """torch numbers the parameters across the groups in order; the record names them in the same order."""
    if [len(g["params"]) for g in state["param_groups"]] != [len(g) for g in names]:
        raise ValueError(
            f"{path} and the names recorded beside it ({RECORD_NAME}) list different parameter groups: "
            "the checkpoint is corrupt; resume from an earlier one"
        )
    name = {i: n for g, ns in zip(state["param_groups"], names) for i, n in zip(g["params"], ns)}
    return {
        "state": {name[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def group_sources(saved: dict, groups: list[list[str]], path: str, record: dict | None, current: dict) -> list[int]:
    """For each group of this run's optimizer, the saved group its settings (lr, weight decay, ...) come from."""
    where = {n: i for i, g in enumerate(saved["param_groups"]) for n in g["params"]}
    absent = [n for g in groups for n in g if n not in where]
    if absent:
        raise ValueError(
            _refusal(
                path,
                record,
                current,
                f"has no state for {len(absent)} parameter(s) of this model "
                f"({absent[:3]}): it was written for another model",
            )
        )
    sources = []
    for group in groups:
        found = sorted({where[n] for n in group})
        settings = [{k: v for k, v in saved["param_groups"][i].items() if k != "params"} for i in found]
        if any(s != settings[0] for s in settings):
            why = f"holds parameter groups {found} with different settings ({settings}) that this run puts in one group"
            raise ValueError(_refusal(path, record, current, why))
        sources.append(found[0])
    return sources


def regroup_scheduler(state: dict, sources: list[int], saved_groups: int, path: str, record, current) -> dict:
    """The scheduler's per-group values moved as the optimizer's groups are (`group_sources`)."""
    if sources == list(range(saved_groups)):
        return state
    out = dict(state)
    for key in SCHEDULER_PER_GROUP:
        if key in out:
            if len(out[key]) != saved_groups:
                raise ValueError(
                    _refusal(
                        path,
                        record,
                        current,
                        f"comes with a scheduler whose {key} has {len(out[key])} entries for {saved_groups} groups",
                    )
                )
            out[key] = [out[key][s] for s in sources]
    if "_schedulers" in out:  # SequentialLR, ChainedScheduler: each inner scheduler's state
        out["_schedulers"] = [
            regroup_scheduler(s, sources, saved_groups, path, record, current) for s in out["_schedulers"]
        ]
    return out
