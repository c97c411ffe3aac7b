"""Which tokens of a full sequence each rank of an SP group holds.

Lengths not divisible by the group are padded at the end (the padding is masked and carries no
label). Two orders exist:
- contiguous: rank i holds tokens [i*s_loc, (i+1)*s_loc), used by Ulysses and bidirectional attention;
- zigzag (ring modes, causal sequences): the sequence is cut into 2*ring_size chunks and ring rank i
  holds chunks i and 2*ring_size-1-i, so every rank gets the same amount of causal work.
Inside a ring rank's tokens, the `ulysses_size` ranks of its Ulysses group hold consecutive pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardPlan:
    """The token positions one rank holds for a sequence of `length` tokens (padded to `padded`)."""

    length: int  # real tokens of the full sequence
    padded: int  # full length after padding; divisible by the SP group size
    sp_size: int
    sp_rank: int
    ring_size: int = 1
    zigzag: bool = False

    @classmethod
    def build(
        cls, length: int, sp_size: int, sp_rank: int, ring_size: int = 1, zigzag: bool = False, tp_size: int = 1
    ) -> ShardPlan:
        """`tp_size`: each shard must also split evenly over the TP group (its norm regions)."""
        zigzag = zigzag and ring_size > 1
        multiple = (2 * sp_size if zigzag else sp_size) * tp_size
        padded = max(-(-length // multiple), 1) * multiple
        return cls(length, padded, sp_size, sp_rank, ring_size, zigzag)

    @property
    def local_length(self) -> int:
        return self.padded // self.sp_size

    @property
    def ulysses_size(self) -> int:
        return self.sp_size // self.ring_size

    def global_index(self, sp_rank: int | None = None, device=None) -> torch.Tensor:
        """[s_loc] global positions held by `sp_rank` (default: this rank), in local order."""
        r = self.sp_rank if sp_rank is None else sp_rank
        ring_rank, uly_rank = divmod(r, self.ulysses_size)
        if self.zigzag:
            c = self.padded // (2 * self.ring_size)
            ring_local = torch.cat(
                [
                    torch.arange(ring_rank * c, (ring_rank + 1) * c, device=device),
                    torch.arange(
                        (2 * self.ring_size - 1 - ring_rank) * c, (2 * self.ring_size - ring_rank) * c, device=device
                    ),
                ]
            )
        else:
            c = self.padded // self.ring_size
            ring_local = torch.arange(ring_rank * c, (ring_rank + 1) * c, device=device)
        piece = ring_local.numel() // self.ulysses_size
        return ring_local[uly_rank * piece : (uly_rank + 1) * piece]

    def ring_index(self, ring_rank: int, device=None) -> torch.Tensor:
        """Global positions held by a whole Ulysses group (ring rank `ring_rank`), in the order an
        all-to-all inside that group lays them out."""
        u = self.ulysses_size
        return torch.cat([self.global_index(ring_rank * u + j, device=device) for j in range(u)])

    def positions(self, device=None) -> torch.Tensor:
        """[s_loc] position ids of the local tokens; padding gets position 0 (it is masked anyway
        and must not index past a model's position table)."""
        idx = self.global_index(device=device)
        return torch.where(idx < self.length, idx, torch.zeros_like(idx))

    def pad(self, x: torch.Tensor, value, dim: int = 1) -> torch.Tensor:
        """Pad `x` along `dim` from `length` to `padded` with `value`."""
        extra = self.padded - x.shape[dim]
        if extra == 0:
            return x
        shape = list(x.shape)
        shape[dim] = extra
        return torch.cat([x, x.new_full(shape, value)], dim=dim)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Take this rank's tokens of an already padded full tensor along `dim`."""
        if not self.zigzag:  # contiguous: SP rank i holds block i
            start = self.sp_rank * self.local_length
            return x.narrow(dim, start, self.local_length)
        return x.index_select(dim, self.global_index(device=x.device))

    def pad_and_shard(self, x: torch.Tensor, value, dim: int = 1) -> torch.Tensor:
        return self.shard(self.pad(x, value, dim), dim)

    def unshard(self, gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Inverse of shard for the concatenation (in SP-rank order) of every rank's shard:
        restores sequence order and drops the padding."""
        if self.zigzag:
            order = torch.cat([self.global_index(r, device=gathered.device) for r in range(self.sp_size)])
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(order.numel(), device=order.device)
            gathered = gathered.index_select(dim, inverse)
        return gathered.narrow(dim, 0, self.length)
