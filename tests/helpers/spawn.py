"""Start N gloo processes from pytest and collect what each returns; never hang.

`spawn(fn, world_size, *args)` runs `fn(*args)` on every rank inside an initialised gloo process
group and returns the list of per-rank results. A rank that raises fails the test with its
traceback; a run that exceeds `timeout` is killed and fails the test.
"""

from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from queue import Empty

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    # the variables torchrun sets, so accelerate/Trainer see a multi-process CPU job
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        ACCELERATE_USE_CPU="1",
    )
    torch.set_num_threads(1)  # N processes share 2 cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        queue.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            (results.__setitem__(rank, value) if ok else errors.append(f"rank {rank}:\n{value}"))
            if errors:
                break
    except Empty as exc:  # some rank hangs
        errors.append(f"timed out after {timeout}s waiting for ranks ({type(exc).__name__})")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
