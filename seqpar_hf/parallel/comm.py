"""Collectives as autograd functions. Math lives elsewhere; each backward is the mirror collective.

Every function takes its process group explicitly. A `None` group or a group of one rank makes
every function here the identity, so an sp_size=1 layout does no communication at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renamed all_gather_into_tensor (same semantics); 2.11 only has the old name.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_to_all_rows(send: torch.Tensor, send_rows: list[int], recv_rows: list[int], group) -> torch.Tensor:
    """all_to_all_single on dim 0: `send_rows[j]` rows go to rank j, `recv_rows[j]` come from it."""
    recv = send.new_empty((sum(recv_rows), *send.shape[1:]))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_rows, input_split_sizes=send_rows, group=group)
    return recv


def start_all_to_all(send: torch.Tensor, send_rows: list[int], recv_rows: list[int], group):
    """Start all_to_all_single on dim 0 and return (recv, work) at once: `recv` is filled only after
    `work.wait()`. On NCCL the wait only orders the current stream after the exchange; on gloo the
    exchange runs on gloo's own threads while this one computes (benchmarks/overlap.py measures it)."""
    recv = send.new_empty((sum(recv_rows), *send.shape[1:]))
    work = dist.all_to_all_single(
        recv, send, output_split_sizes=recv_rows, input_split_sizes=send_rows, group=group, async_op=True
    )
    return recv, work


def _seq_to_heads(x: torch.Tensor, head_sizes: list[int], group) -> torch.Tensor:
    """[b, h, s_loc, d] (head j..: sizes head_sizes) -> [b, h_r, s_loc * n, d], contiguous."""
    n, r = len(head_sizes), dist.get_rank(group)
    b, _, s_loc, d = x.shape
    send = x.permute(1, 0, 2, 3).contiguous()  # [b, h, s_loc, d] -> [h, b, s_loc, d]
    recv = _all_to_all_rows(send, head_sizes, [head_sizes[r]] * n, group)  # [n * h_r, b, s_loc, d]
    h_r = head_sizes[r]
    # [n, h_r, b, s_loc, d] -> [b, h_r, n, s_loc, d] -> [b, h_r, n * s_loc, d]; rank order = sequence order
    return recv.view(n, h_r, b, s_loc, d).permute(2, 1, 0, 3, 4).reshape(b, h_r, n * s_loc, d)


def _heads_to_seq(y: torch.Tensor, head_sizes: list[int], group) -> torch.Tensor:
    """[b, h_r, s, d] -> [b, h, s / n, d] (a transposed view of a contiguous [b, s / n, h, d])."""
    n = len(head_sizes)
    b, h_r, s, d = y.shape
    s_loc = s // n
    # [b, h_r, n, s_loc, d] -> [n, h_r, b, s_loc, d] -> [n * h_r, b, s_loc, d]: chunk j goes to rank j
    send = y.reshape(b, h_r, n, s_loc, d).permute(2, 1, 0, 3, 4).contiguous().view(n * h_r, b, s_loc, d)
    recv = _all_to_all_rows(send, [h_r] * n, head_sizes, group)  # [h, b, s_loc, d]
    # [h, b, s_loc, d] -> [b, s_loc, h, d] (contiguous, what HF attention returns) -> [b, h, s_loc, d] view
    return recv.permute(1, 2, 0, 3).contiguous().transpose(1, 2)


class SeqToHeads(torch.autograd.Function):
    """Ulysses all-to-all: sequence-sharded, all heads -> full sequence, this rank's heads."""

    @staticmethod
    def forward(ctx, x, head_sizes, group):
        ctx.head_sizes, ctx.group = head_sizes, group
        return _seq_to_heads(x, head_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.head_sizes, ctx.group), None, None


class HeadsToSeq(torch.autograd.Function):
    """The inverse all-to-all: full sequence, this rank's heads -> sequence-sharded, all heads."""

    @staticmethod
    def forward(ctx, y, head_sizes, group):
        ctx.head_sizes, ctx.group = head_sizes, group
        return _heads_to_seq(y, head_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.head_sizes, ctx.group), None, None


def seq_to_heads(x: torch.Tensor, head_sizes: list[int], group) -> torch.Tensor:
    """[b, h, s/n, d] -> [b, head_sizes[rank], s, d] over `group` (n ranks); uneven head splits allowed."""
    if group_size(group) == 1:
        return x
    return SeqToHeads.apply(x, head_sizes, group)


def heads_to_seq(y: torch.Tensor, head_sizes: list[int], group) -> torch.Tensor:
    """[b, head_sizes[rank], s, d] -> [b, h, s/n, d] over `group`; the inverse of `seq_to_heads`."""
    if group_size(group) == 1:
        return y
    return HeadsToSeq.apply(y, head_sizes, group)


class GroupSum(torch.autograd.Function):
    """Sum a per-rank partial over the group; backward scales the gradient by `grad_scale` (the loss
    passes sp: why, in the scaling note of `seqpar_hf.models.forward.loss`)."""

    @staticmethod
    def forward(ctx, x, group, grad_scale):
        ctx.grad_scale = grad_scale
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.grad_scale, None, None


def group_sum(x: torch.Tensor, group, grad_scale: float = 1.0) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return GroupSum.apply(x, group, grad_scale)


def _gather_cat(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x.contiguous(), group=group)  # [n * x0, ...]: rank blocks along dim 0
    return torch.cat(out.chunk(n, dim=0), dim=dim)  # rank blocks along `dim`, in group order


@torch.no_grad()
def all_gather_cat(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate equal-shaped shards of all ranks along `dim` (no gradient: for eval outputs)."""
    return _gather_cat(x, group, dim)


class GatherSequence(torch.autograd.Function):
    """This rank's shard of a sequence -> the full sequence (sequence order, padding dropped), on every
    rank of the group. Backward: this rank's slice of the incoming gradient, times `grad_scale`.

    Used where code after the sharded part runs identically on every rank of the group (a foreign
    loss on full hidden states): each rank then holds the group's full gradient there, and scaling the
    slice by sp makes world-averaging wrappers (DDP, FSDP) sum the shards, as `GroupSum` does (see the
    scaling note of `seqpar_hf.models.forward.loss`).
    """

    @staticmethod
    def forward(ctx, x, plan, group, grad_scale, dim):
        ctx.plan, ctx.grad_scale, ctx.dim = plan, grad_scale, dim
        return plan.unshard(_gather_cat(x, group, dim), dim)  # [.., s/sp, ..] -> [.., s, ..]

    @staticmethod
    def backward(ctx, grad):
        local = ctx.plan.pad_and_shard(grad, 0.0, ctx.dim)  # [.., s, ..] -> [.., s/sp, ..]
        return local * ctx.grad_scale, None, None, None, None


def gather_sequence(x: torch.Tensor, plan, group, grad_scale: float, dim: int = 1) -> torch.Tensor:
    """Differentiable `GatherSequence`; the identity's unpadding for a group of one."""
    if group_size(group) == 1:
        return plan.unshard(x, dim)
    return GatherSequence.apply(x, plan, group, grad_scale, dim)


def _gather_unshard(x: torch.Tensor, plan, group, dim: int) -> torch.Tensor:
    return plan.unshard(_gather_cat(x, group, dim), dim)


def _reduce_scatter_shards(full: torch.Tensor, plan, group, dim: int) -> torch.Tensor:
    """[.., S, ..] on every rank -> the sum over the group's ranks of their tensors, at this rank's tokens."""
    n = group_size(group)
    padded = plan.pad(full, 0.0, dim)
    order = torch.cat([plan.global_index(r, device=full.device) for r in range(n)])
    blocks = padded.index_select(dim, order).movedim(dim, 0)  # [n * s_loc, ...], rank blocks in group order
    local = plan.local_length
    send = blocks.contiguous()
    out = send.new_empty((local, *send.shape[1:]))
    dist.reduce_scatter_tensor(out, send, group=group)
    return out.movedim(0, dim).contiguous()  # [b, s_loc, ...] as the layers expect it (views of it)


class GatherForReplica(torch.autograd.Function):
    """This rank's shard of a sequence -> the full sequence (sequence order, padding dropped) for a module
    that every rank of the group then runs on all of it (models/mixers/). Unlike `GatherSequence`, each
    rank's copy feeds a different output (the rank's own tokens, or its heads), so the backward sums the
    ranks' gradients: a reduce-scatter of each rank's full-sequence gradient to its shard."""

    @staticmethod
    def forward(ctx, x, plan, group, dim):
        ctx.plan, ctx.group, ctx.dim = plan, group, dim
        return _gather_unshard(x, plan, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_shards(grad, ctx.plan, ctx.group, ctx.dim), None, None, None


class SumToShard(torch.autograd.Function):
    """Each rank's partial sum over the full sequence (its heads' share of an output projection) -> the
    group's sum at this rank's tokens (reduce-scatter); the backward all-gathers the shards' gradients."""

    @staticmethod
    def forward(ctx, x, plan, group, dim):
        ctx.plan, ctx.group, ctx.dim = plan, group, dim
        return _reduce_scatter_shards(x, plan, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_unshard(grad.contiguous(), ctx.plan, ctx.group, ctx.dim), None, None, None


def gather_for_replica(x: torch.Tensor, plan, group, dim: int = 1) -> torch.Tensor:
    """Differentiable `GatherForReplica`; for a group of one, the unpadding alone."""
    if group_size(group) == 1:
        return plan.unshard(x, dim)
    return GatherForReplica.apply(x, plan, group, dim)


def sum_to_shard(x: torch.Tensor, plan, group, dim: int = 1) -> torch.Tensor:
    """Differentiable `SumToShard`; for a group of one, the padding alone."""
    if group_size(group) == 1:
        return plan.pad(x, 0.0, dim)
    return SumToShard.apply(x, plan, group, dim)
