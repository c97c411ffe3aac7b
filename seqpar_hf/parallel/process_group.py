"""Starting the default process group with a timeout that fits sequence parallelism.

torch waits 30 minutes (gloo) or 10 (NCCL) in a collective before giving up, and the groups a
`DeviceMesh` creates get those defaults whatever timeout the default group was given. Under SP every
forward and backward takes collectives in its SP group, so a rank that stopped (raised, was killed, runs
other code) leaves the others waiting that long. seqpar_hf's checks make the usual disagreements an error
on every rank before any collective (layouts, batches, settings, bad inputs, failed saves); what is left
should fail in minutes. `ParallelLayout` gives every group it creates the default group's timeout, so
one number covers all of them: `init_process_group(timeout=...)` in a plain loop, `--ddp_timeout` in the
Trainer (both 10 minutes by default).

10 minutes: the longest a rank should wait for another's work between two collectives is a checkpoint
save (rank 0 gathers and writes while the others wait at the next collective) or data preparation on
rank 0; raise it when those take longer (very large models, a slow file system).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=10)


def init_process_group(backend: str | None = None, timeout: timedelta | float = DEFAULT_TIMEOUT, **kwargs) -> None:
    """`torch.distributed.init_process_group` with a timeout for SP (`timeout`: a timedelta or seconds).

    `backend` None: "nccl" when CUDA is available (and the device of `LOCAL_RANK` selected, as torchrun /
    accelerate launch set it), else "gloo". Other keyword arguments go to torch (rank, world_size,
    init_method, ...); without them torch reads the launcher's environment. A no-op when a group exists.
    """
    if dist.is_initialized():
        return
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "nccl" in backend and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=timeout, **kwargs)
