"""One simulated rank of an n-way layout: the process joins a single-process "fake" process group of world
size n (torch.testing._internal.distributed.fake_pg), so a `ParallelLayout` sees n ranks and every
collective returns at once without moving data. The library knows nothing of it; what the benchmarks
need is said here:

- `join(n, rank)`: the fake group (of one rank too), as its rank `rank` (0 unless told);
- `layout(...)`: a `ParallelLayout`; on the fake group, told its mesh's device type (the fake backend runs on
  any device: the GPU where there is one, as the benchmarks run there). Building a layout compares its
  arguments across the ranks (one all-gather); the fake all-gather hands back this rank's values for every
  rank, so they agree. The fake backend keeps no timeouts, so the layout sets none;
- `zero_received`: under `instruments.CollectiveTap`, zero what a collective would have written (a stand-in
  for the other ranks' data that keeps garbage out of the kernels). The input check of `patch_model` is off
  in these benchmarks: its all-gather would compare these zeros.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def join(world_size: int, rank: int = 0) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def layout(*args, **kwargs):
    """`seqpar_hf.ParallelLayout(*args, **kwargs)`; on the fake group, its mesh on the GPU where there is one."""
    import seqpar_hf

    if dist.is_initialized():
        kwargs["device_type"] = "cuda" if torch.cuda.is_available() else "cpu"
    return seqpar_hf.ParallelLayout(*args, **kwargs)


def zero_received(name: str, a: dict) -> None:
    """Before a fake collective: zero what it would have written."""
    if name == "all_to_all_single":
        a["output"].zero_()
    elif name == "batch_isend_irecv":
        for op in a["p2p_op_list"]:
            if op.op.__name__ == "irecv":
                op.tensor.zero_()
    elif name == "all_gather":
        for t in a["tensor_list"]:
            t.zero_()
    elif name in ("all_gather_into_tensor", "all_gather_single"):
        a["output_tensor"].zero_()
