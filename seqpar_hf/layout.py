"""Where every rank sits: sequence-parallel (SP) groups, data-parallel (DP) groups, and the
Ulysses / ring sub-groups of an SP group. Built once, validated up front, passed down.

Vocabulary used across the package:
- *rank*: a process of the default process group; *world*: all of them.
- *SP group*: `sp_size` consecutive ranks that share one batch and split its sequences.
- *DP group*: the ranks with the same `sp_rank` in different SP groups (gradients average over them).
- Inside an SP group of size sp = ulysses_size * ring_size: *Ulysses groups* are blocks of
  `ulysses_size` consecutive ranks (all-to-all inside), *ring groups* are the ranks with the same
  Ulysses index (send/recv around them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

MODES = ("ulysses", "ring", "hybrid")


@dataclass(frozen=True)
class LayoutSizes:
    """The validated sizes of a layout; pure arithmetic, no process group needed."""

    world_size: int
    sp_size: int
    mode: str
    ring_size: int
    ulysses_size: int
    dp_size: int


def validate_sizes(world_size: int, sp_size: int, mode: str = "ulysses", ring_size: int | None = None) -> LayoutSizes:
    """Check the sizes before any collective; every error names the value and the fix."""
    if mode not in MODES:
        raise ValueError(f"unknown sequence-parallel mode {mode!r}; choose one of {', '.join(MODES)}")
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}")
    if world_size % sp_size:
        raise ValueError(
            f"world size {world_size} is not divisible by sp_size={sp_size}; launch a multiple of "
            f"{sp_size} processes or pick an sp_size that divides {world_size}"
        )
    if mode == "ulysses":
        if ring_size not in (None, 1):
            raise ValueError(f"mode='ulysses' takes no ring_size (got {ring_size}); use mode='hybrid' for ulysses x ring")
        ring_size = 1
    elif mode == "ring":
        if ring_size not in (None, sp_size):
            raise ValueError(
                f"mode='ring' uses ring_size=sp_size={sp_size} (got ring_size={ring_size}); "
                "use mode='hybrid' to mix Ulysses and ring"
            )
        ring_size = sp_size
    else:  # hybrid
        if ring_size is None:
            raise ValueError(f"mode='hybrid' needs ring_size, a divisor of sp_size={sp_size} (e.g. ring_size=2)")
        if not isinstance(ring_size, int) or ring_size < 1 or sp_size % ring_size:
            raise ValueError(
                f"ring_size={ring_size} does not divide sp_size={sp_size}; "
                f"pick one of {[d for d in range(1, sp_size + 1) if sp_size % d == 0]}"
            )
    return LayoutSizes(world_size, sp_size, mode, ring_size, sp_size // ring_size, world_size // sp_size)


@dataclass(eq=False)
class ParallelLayout:
    """SP x DP layout over the default process group (SP groups are blocks of consecutive ranks).

    >>> dist.init_process_group("gloo")                # or nccl
    >>> layout = ParallelLayout(sp_size=2, mode="ulysses")
    >>> layout.sp_rank, layout.dp_rank, layout.dp_size

    `sp_size=1` is valid: every model forward then runs as if unpatched. `mode="hybrid"` runs
    Ulysses inside groups of `sp_size // ring_size` ranks and a ring across them.
    Every rank must build the layout (creating groups is collective), in the same order.
    """

    sp_size: int
    mode: str = "ulysses"
    ring_size: int | None = None
    sizes: LayoutSizes = field(init=False, repr=False)

    def __post_init__(self):
        if not (dist.is_available() and dist.is_initialized()):
            if self.sp_size == 1:  # a no-op layout needs no process group
                self.sizes = validate_sizes(1, 1, self.mode, self.ring_size)
                self.rank = 0
                self.sp_group = self.dp_group = self.ulysses_group = self.ring_group = None
                self.sp_ranks = self.ulysses_ranks = self.ring_ranks = (0,)
                return
            raise RuntimeError(
                f"ParallelLayout(sp_size={self.sp_size}) needs a process group: call "
                "torch.distributed.init_process_group('gloo' or 'nccl') first (accelerate launch / torchrun do)"
            )
        self.sizes = validate_sizes(dist.get_world_size(), self.sp_size, self.mode, self.ring_size)
        self.ring_size = self.sizes.ring_size
        self.rank = dist.get_rank()
        sp, u, world = self.sizes.sp_size, self.sizes.ulysses_size, self.sizes.world_size
        # new_group is collective: every rank creates every group, in the same order.
        for start in range(0, world, sp):
            ranks = tuple(range(start, start + sp))
            group = dist.new_group(list(ranks))
            if self.rank in ranks:
                self.sp_group, self.sp_ranks = group, ranks
            for ring_start in range(start, start + sp, u):
                uranks = tuple(range(ring_start, ring_start + u))
                ugroup = dist.new_group(list(uranks)) if u not in (1, sp) else (group if u == sp else None)
                if self.rank in uranks:
                    self.ulysses_group, self.ulysses_ranks = ugroup, uranks
            for j in range(u):
                rranks = tuple(range(start + j, start + sp, u))
                rgroup = dist.new_group(list(rranks)) if self.sizes.ring_size not in (1, sp) else (
                    group if self.sizes.ring_size == sp else None)
                if self.rank in rranks:
                    self.ring_group, self.ring_ranks = rgroup, rranks
        for offset in range(sp):
            ranks = list(range(offset, world, sp))
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.dp_group = group

    # sizes and coordinates ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.sizes.world_size

    @property
    def dp_size(self) -> int:
        return self.sizes.dp_size

    @property
    def ulysses_size(self) -> int:
        return self.sizes.ulysses_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sizes.sp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sizes.sp_size

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.sizes.ulysses_size

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.sizes.ulysses_size

    @property
    def enabled(self) -> bool:
        """False for sp_size=1: the patched model then runs exactly the unpatched code."""
        return self.sizes.sp_size > 1

    def __repr__(self) -> str:
        s = self.sizes
        return (f"ParallelLayout(mode={s.mode!r}, sp_size={s.sp_size}, ring_size={s.ring_size}, "
                f"ulysses_size={s.ulysses_size}, dp_size={s.dp_size}, rank={self.rank}, "
                f"sp_rank={self.sp_rank}, dp_rank={self.dp_rank})")
