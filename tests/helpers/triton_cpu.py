"""Triton kernels on a CPU, in Triton's interpreter (`TRITON_INTERPRET=1`: numpy, slow, exact to fp32): enough to run
flash-linear-attention's kernels on tiny shapes here (tests/test_fla_interpreter.py). Two gaps of the interpreter
filled: an autotuner with no GPU to time its configs takes the first, and a kernel's `range` loop index is a Triton
scalar (fla calls `.to()` on it)."""

from __future__ import annotations

import builtins
import importlib
import os
import pkgutil


def enable(package: str = "fla.ops") -> None:
    """Set up the interpreter (before `package` is imported) and fill its gaps in every module of `package`."""
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import triton.language as tl
    import triton.runtime.autotuner as autotuner

    def first_config(self, *args, config, **meta):  # no device to time on: the configs in their order
        return [float(self.configs.index(config)) if config in self.configs else 0.0] * 3

    autotuner.Autotuner._bench = first_config

    def as_int(x):
        handle = getattr(x, "handle", None)
        return int(np.asarray(handle.data).item()) if handle is not None and hasattr(handle, "data") else int(x)

    def triton_range(*args, **kwargs):
        for i in builtins.range(*(as_int(a) for a in args)):
            yield tl.full((), i, tl.int32)

    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a module needing what is not here (a GPU backend): not used
            continue
        module.range = triton_range  # type: ignore[attr-defined]
