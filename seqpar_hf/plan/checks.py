"""Checks on the planner's inputs, shared by the library functions and the command line.

Each raises ValueError "<name> <value>: <what is allowed>", where the name is the argument's (`seq_len`) in
the library and the flag (`--seq-len`) or the config key on the command line, so both say the same words.
"""

from __future__ import annotations

import math

GIB = 2**30
MAX_GPU_MEMORY_GIB = 4096  # far above any accelerator: a larger number is bytes or MiB, not GiB

# What each size means, by its library name (flags spell the same names with dashes).
MEANING = {
    "seq_len": "tokens per sequence",
    "batch": "sequences per SP group and step",
    "gpus": "ranks in all, dp x sp x tp",
    "hidden": "hidden size",
    "layers": "decoder layers",
    "heads": "query attention heads",
    "kv_heads": "key/value attention heads",
    "head_dim": "channels per attention head",
    "ffn": "MLP intermediate size",
    "vocab": "vocabulary size",
    "sp": "ranks per sequence",
    "tp": "tensor-parallel ranks",
    "gpu_memory": "GiB per rank",
    "budget": "bytes per rank",
}
SIZES = ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab")  # a Model's integer fields


def _meaning(name: str) -> str:
    return MEANING.get(name.lstrip("-").replace("-", "_"), "")


def positive_int(name: str, value, meaning: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} {value!r}: must be a positive integer ({meaning or _meaning(name)})")


def positive_number(name: str, value, meaning: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} {value!r}: must be a positive number ({meaning or _meaning(name)})")


def model_sizes(sizes: dict, name_of=lambda field: field) -> None:
    """A Model's fields: positive sizes, and kv heads that divide the query heads (grouped-query attention).
    `name_of(field)` is how the caller calls that field (an argument, a flag, a config key)."""
    for field in SIZES:
        positive_int(name_of(field), sizes[field], MEANING[field])
    heads, kv_heads = sizes["heads"], sizes["kv_heads"]
    if kv_heads > heads or heads % kv_heads:
        raise ValueError(
            f"{name_of('kv_heads')} {kv_heads}: must divide {name_of('heads')} = {heads} "
            "(grouped-query attention: each key/value head serves the same number of query heads)"
        )
    if not isinstance(sizes.get("tied", False), bool):
        raise ValueError(f"{name_of('tied')} {sizes['tied']!r}: must be true or false (embeddings tied to the head)")


def budget_bytes(gpu_memory: float, reserve: float, names=("gpu_memory", "reserve")) -> float:
    """Bytes per rank the plan may use: `gpu_memory` GiB less the fraction `reserve` kept free."""
    positive_number(names[0], gpu_memory)
    if gpu_memory > MAX_GPU_MEMORY_GIB:
        raise ValueError(
            f"{names[0]} {gpu_memory:g}: GiB per rank, at most {MAX_GPU_MEMORY_GIB} (is it in MiB or "
            f"bytes? 80 GiB is {names[0]} 80)"
        )
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0 <= reserve < 1:
        hint = ""
        if isinstance(reserve, (int, float)) and 1 <= reserve < gpu_memory:
            hint = f"; to keep {reserve:g} GiB of {gpu_memory:g} free, pass {names[1]} {reserve / gpu_memory:.3g}"
        raise ValueError(
            f"{names[1]} {reserve!r}: must be a fraction of each rank's memory in [0, 1), kept free "
            f"for fragmentation and kernels' workspace (0.1: 10%){hint}"
        )
    return gpu_memory * GIB * (1 - reserve)
