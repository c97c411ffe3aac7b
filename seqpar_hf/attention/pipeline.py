"""The autograd steps of the fused, pipelined Ulysses exchange (`attention/ulysses.py` runs them).

A chunk's exchange is two nodes: `Send` starts the all-to-all, `Land` waits for it and unpacks.
Their backward is the mirror: `Land.backward` packs the gradients and starts the reverse exchange,
`Send.backward` waits for it. Between the two, autograd runs whatever it has ready with a later
creation order (the engine runs ready nodes newest first): in the forward the driver creates chunk
c+1's `Send` before chunk c's kernel, so the backward runs chunk c's kernel backward while chunk
c+1's gradients travel. The output side is the same with `OutSend` / `OutLand`. An `Exchange`
token carries the pending work from one node to its partner; nothing here reads a tensor's value.

Every step only copies: the arithmetic is the kernel's, so one chunk is bit-identical to exchanging
q, k, v and the output with four separate all-to-alls. The q/k/v buffers are flat (element counts),
so query and kv rows may differ in length (cross-attention: s_q != s_k) and v's head width may differ
from q/k's (multi-head latent attention: 128 vs 192), each run split off by its own size.
"""

from __future__ import annotations

import math

import torch

from ..parallel.comm import start_all_to_all
from .heads import ChunkPlan, Run


class Exchange:
    """The pending all-to-all between two nodes: forward (work, buffers kept alive until it completes)
    and backward (recv, work, buffers)."""

    __slots__ = ("work", "back")

    def __init__(self):
        self.work = self.back = None

    def start(self, send, send_rows, recv_rows, group, backward: bool = False) -> torch.Tensor:
        recv, work = start_all_to_all(send, send_rows, recv_rows, group)
        if backward:
            self.back = (recv, work, send)
        else:
            self.work = (work, send)
        return recv

    def wait(self):
        work, _ = self.work
        work.wait()
        self.work = None

    def wait_back(self) -> torch.Tensor:
        recv, work, _ = self.back
        work.wait()
        self.back = None
        return recv


def _offset(run: Run, per: tuple[int, int, int]) -> int:
    """Where `run` starts in its chunk's flat buffer: the q, k and v head rows before it, each of its own
    element count `per` (rows of s_q or s_k tokens; q/k and v of their own widths)."""
    return sum(rows * one for rows, one in zip(run.before, per))


class Pack(torch.autograd.Function):
    """q [b, h, s_q, d], k [b, g, s_k, d], v [b, g, s_k, d_v] -> one flat send buffer per chunk: for each
    destination rank, its query heads [m, b, s_q, d], then its new kv heads of k [m_kv, b, s_k, d], then
    of v [m_kv, b, s_k, d_v] (the runs of `ChunkPlan.runs`). Backward: each gradient run back in place,
    one concatenation per tensor (`ChunkPlan.order`)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: ChunkPlan):
        ctx.plan, ctx.shapes = plan, (q.shape, k.shape, v.shape)
        sources = [x.permute(1, 0, 2, 3) for x in (q, k, v)]  # [heads, b, s, d] views
        if q.shape[2:] == k.shape[2:] == v.shape[2:]:  # head rows of one size: one copy
            return tuple(torch.cat([sources[r.kind][r.lo : r.hi] for r in runs]).view(-1) for runs in plan.runs)
        per = tuple(x[:, :1].numel() for x in (q, k, v))  # elements of one head
        sends = []
        for runs in plan.runs:  # rows of different sizes: s_q != s_k (cross-attention), d != d_v (MLA)
            buf = q.new_empty(sum((r.hi - r.lo) * per[r.kind] for r in runs))
            for r in runs:
                off, x = _offset(r, per), sources[r.kind][r.lo : r.hi]
                buf[off : off + x.numel()].view(x.shape).copy_(x)
            sends.append(buf)
        return tuple(sends)

    @staticmethod
    def backward(ctx, *grads):
        plan, shapes = ctx.plan, ctx.shapes
        b, g = shapes[0][0], shapes[1][1]
        rows = tuple(shape[2:] for shape in shapes)  # (s, d) of a head of q, k, v
        per = tuple(b * s * d for s, d in rows)
        like = next(x for x in grads if x is not None)

        def run(c, i):  # [m, b, s, d] of run i of chunk c -> [b, s, m, d]
            r, grad = plan.runs[c][i], grads[c]
            m, (s, d) = r.hi - r.lo, rows[r.kind]
            if grad is None:
                return like.new_zeros(b, s, m, d)
            off = _offset(r, per)
            return grad[off : off + m * per[r.kind]].view(m, b, s, d).permute(1, 2, 0, 3)

        # [b, s, heads, d] in head (kv: send-row) order -> [b, heads, s, d]
        dq, dk, dv = (torch.cat([run(c, i) for c, i in order], dim=2).transpose(1, 2) for order in plan.order)
        if plan.split.kv_send is not None:  # replicated kv heads: sum their copies, as index_select's backward
            index = plan.kv_send_index(like.device)
            dk, dv = (like.new_zeros(b, g, *t.shape[2:]).index_add_(1, index, t) for t in (dk, dv))
        return dq, dk, dv, None


class Send(torch.autograd.Function):
    """Start one chunk's q/k/v exchange; backward: wait for the gradients `Land.backward` sent."""

    @staticmethod
    def forward(ctx, send, send_rows, recv_rows, group, token: Exchange):
        ctx.token = token
        return token.start(send, send_rows, recv_rows, group)

    @staticmethod
    def backward(ctx, _grad):
        return ctx.token.wait_back(), None, None, None, None


class Land(torch.autograd.Function):
    """Wait for one chunk's exchange: flat [n sources x (m q heads, m_kv k heads, m_kv v heads)] ->
    q [b, m, n s_q, d], k [b, m_kv, n s_k, d], v [b, m_kv, n s_k, d_v] (source order = sequence order).
    Backward: pack the gradients the same way and start the reverse exchange."""

    @staticmethod
    def forward(ctx, recv, token: Exchange, dims, send_rows, recv_rows, group):
        n, m, m_kv, b, s_q, s_k, d, d_v = dims
        ctx.token, ctx.dims, ctx.rows, ctx.group = token, dims, (send_rows, recv_rows), group
        token.wait()
        if s_q == s_k and d == d_v:  # one copy: [n, rows, b, s, d] -> [b, rows, n, s, d] -> [b, rows, n s, d]
            rows = recv.view(n, m + 2 * m_kv, b, s_q, d).permute(2, 1, 0, 3, 4).reshape(b, m + 2 * m_kv, n * s_q, d)
            return rows[:, :m], rows[:, m : m + m_kv], rows[:, m + m_kv :]
        parts = _parts(recv, dims)
        # each of q, k, v: [n, heads, b, s, d] -> [b, heads, n, s, d] -> [b, heads, n s, d]
        return tuple(x.permute(2, 1, 0, 3, 4).reshape(b, x.shape[1], n * x.shape[3], x.shape[4]) for x in parts)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        n, m, m_kv, b, s_q, s_k, d, d_v = ctx.dims
        like = next(x for x in (dq, dk, dv) if x is not None)
        flat = like.new_empty(n * b * (m * s_q * d + m_kv * s_k * (d + d_v)))
        for part, t in zip(_parts(flat, ctx.dims), (dq, dk, dv)):
            if t is None:
                part.zero_()
            else:  # [b, heads, n s, d] -> [n, heads, b, s, d]
                heads, s, w = part.shape[1], part.shape[3], part.shape[4]
                part.copy_(t.reshape(b, heads, n, s, w).permute(2, 1, 0, 3, 4))
        send_rows, recv_rows = ctx.rows
        ctx.token.start(flat, recv_rows, send_rows, ctx.group, backward=True)
        return flat, None, None, None, None, None


def _parts(flat: torch.Tensor, dims) -> list[torch.Tensor]:
    """A landed chunk's flat buffer as views q [n, m, b, s_q, d], k [n, m_kv, b, s_k, d], v [n, m_kv, b, s_k, d_v]
    (n sources, each sending its q, k, v rows in turn)."""
    n, m, m_kv, b, s_q, s_k, d, d_v = dims
    shapes = ((m, b, s_q, d), (m_kv, b, s_k, d), (m_kv, b, s_k, d_v))
    per_source = flat.view(n, -1)  # [n, elements from one source]
    sizes = [math.prod(shape) for shape in shapes]
    return [x.view(n, *shape) for x, shape in zip(per_source.split(sizes, dim=1), shapes)]


class OutSend(torch.autograd.Function):
    """out [b, m, n s, d] (this rank's heads, the whole sequence) -> start sending sequence block j to
    rank j; backward: wait for dO and lay it out as [b, m, n s, d]."""

    @staticmethod
    def forward(ctx, out, n, send_rows, recv_rows, group, token: Exchange):
        b, m, full, d = out.shape
        ctx.token, ctx.dims = token, (n, m, b, full // n, d)
        # [b, m, n, s, d] -> [n, m, b, s, d] -> [n m, b, s, d]: rows of block j go to rank j
        send = out.reshape(b, m, n, full // n, d).permute(2, 1, 0, 3, 4).contiguous().view(n * m, b, full // n, d)
        return token.start(send, send_rows, recv_rows, group)

    @staticmethod
    def backward(ctx, _grad):
        n, m, b, s, d = ctx.dims
        recv = ctx.token.wait_back()  # [n m, b, s, d] -> [b, m, n s, d]
        return recv.view(n, m, b, s, d).permute(2, 1, 0, 3, 4).reshape(b, m, n * s, d), None, None, None, None, None


class OutLand(torch.autograd.Function):
    """Wait for every chunk's output exchange and put the heads in order: -> [b, h, s, d] (a transposed
    view of a contiguous [b, s, h, d], what HF attention returns). Backward: send each chunk's dO."""

    @staticmethod
    def forward(ctx, plan: ChunkPlan, rank: int, group, tokens, *recvs):
        ctx.plan, ctx.rank, ctx.group, ctx.tokens = plan, rank, group, tokens
        for t in tokens:
            t.wait()
        if len(recvs) == 1:  # rows already in head order: [h, b, s, d] -> [b, s, h, d]
            return recvs[0].permute(1, 2, 0, 3).contiguous().transpose(1, 2)
        parts, offsets = [], [0] * len(recvs)
        for j in range(len(plan.pieces[0])):  # global head order: rank j's chunks in turn
            for c, chunk in enumerate(plan.pieces):
                m = chunk[j].heads
                parts.append(recvs[c][offsets[c] : offsets[c] + m].permute(1, 2, 0, 3))  # [m, b, s, d] -> [b, s, m, d]
                offsets[c] += m
        return torch.cat(parts, dim=2).transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        plan, rank = ctx.plan, ctx.rank
        rows = dout.permute(1, 0, 2, 3)  # [b, h, s, d] -> [h, b, s, d]
        sends = [None] * plan.chunks
        for c in reversed(range(plan.chunks)):  # the last chunk's dO is needed first
            chunk = plan.pieces[c]
            send = rows.contiguous() if plan.chunks == 1 else torch.cat([rows[p.q[0] : p.q[1]] for p in chunk])
            mine = chunk[rank].heads
            ctx.tokens[c].start(send, [p.heads for p in chunk], [mine] * len(chunk), ctx.group, backward=True)
            sends[c] = send
        return (None, None, None, None, *sends)
