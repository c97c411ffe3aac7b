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
so query and kv rows may differ in length (cross-attention: s_q != s_k).
"""

from __future__ import annotations

import torch

from ..parallel.comm import start_all_to_all
from .heads import ChunkPlan


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


class Pack(torch.autograd.Function):
    """q [b, h, s_q, d], k/v [b, g, s_k, d] -> one flat send buffer per chunk: for each destination
    rank, its query heads [m, b, s_q, d], then its new kv heads of k, then of v [m_kv, b, s_k, d]
    (the runs of `ChunkPlan.runs`). Backward: each gradient run back in place, one concatenation per
    tensor (`ChunkPlan.order`)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: ChunkPlan):
        ctx.plan, ctx.shapes = plan, (q.shape, k.shape)
        sources = [x.permute(1, 0, 2, 3) for x in (q, k, v)]  # [heads, b, s, d] views
        if q.shape[2] == k.shape[2]:  # rows of one length: one copy
            return tuple(torch.cat([sources[r.kind][r.lo:r.hi] for r in runs]).view(-1) for runs in plan.runs)
        per_q, per_kv = q[:, :1].numel(), k[:, :1].numel()  # elements of one head
        sends = []
        for runs in plan.runs:  # cross-attention: q and kv rows differ in length
            buf = q.new_empty(sum((r.hi - r.lo) * (per_kv if r.kind else per_q) for r in runs))
            for r in runs:
                off, x = r.q_before * per_q + r.kv_before * per_kv, sources[r.kind][r.lo:r.hi]
                buf[off:off + x.numel()].view(x.shape).copy_(x)
            sends.append(buf)
        return tuple(sends)

    @staticmethod
    def backward(ctx, *grads):
        plan, (q_shape, k_shape) = ctx.plan, ctx.shapes
        (b, _, s_q, d), (_, g, s_k, _) = q_shape, k_shape
        like = next(x for x in grads if x is not None)
        per = (b * s_q * d, b * s_k * d)

        def run(c, i):  # [m, b, s, d] of run i of chunk c -> [b, s, m, d]
            r, grad = plan.runs[c][i], grads[c]
            m, s, one = r.hi - r.lo, (s_q, s_k, s_k)[r.kind], per[r.kind > 0]
            if grad is None:
                return like.new_zeros(b, s, m, d)
            off = r.q_before * per[0] + r.kv_before * per[1]
            return grad[off:off + m * one].view(m, b, s, d).permute(1, 2, 0, 3)

        # [b, s, heads, d] in head (kv: send-row) order -> [b, heads, s, d]
        dq, dk, dv = (torch.cat([run(c, i) for c, i in order], dim=2).transpose(1, 2) for order in plan.order)
        if plan.split.kv_send is not None:  # replicated kv heads: sum their copies, as index_select's backward
            index = plan.kv_send_index(like.device)
            dk, dv = (like.new_zeros(b, g, s_k, d).index_add_(1, index, t) for t in (dk, dv))
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
    q [b, m, n s_q, d], k/v [b, m_kv, n s_k, d] (source order = sequence order). Backward: pack the
    gradients the same way and start the reverse exchange."""

    @staticmethod
    def forward(ctx, recv, token: Exchange, dims, send_rows, recv_rows, group):
        n, m, m_kv, b, s_q, s_k, d = dims
        ctx.token, ctx.dims, ctx.rows, ctx.group = token, dims, (send_rows, recv_rows), group
        token.wait()
        if s_q == s_k:  # one copy: [n, rows, b, s, d] -> [b, rows, n, s, d] -> [b, rows, n s, d], then views
            rows = recv.view(n, m + 2 * m_kv, b, s_q, d).permute(2, 1, 0, 3, 4).reshape(b, m + 2 * m_kv, n * s_q, d)
            return rows[:, :m], rows[:, m:m + m_kv], rows[:, m + m_kv:]
        per_source = recv.view(n, -1)
        split = m * b * s_q * d
        # [n, m, b, s_q, d] -> [b, m, n, s_q, d] -> [b, m, n s_q, d]
        q = per_source[:, :split].view(n, m, b, s_q, d).permute(2, 1, 0, 3, 4).reshape(b, m, n * s_q, d)
        # [n, 2, m_kv, b, s_k, d] -> [2, b, m_kv, n, s_k, d] -> [2, b, m_kv, n s_k, d]
        kv = per_source[:, split:].view(n, 2, m_kv, b, s_k, d).permute(1, 3, 2, 0, 4, 5).reshape(2, b, m_kv, n * s_k, d)
        return q, kv[0], kv[1]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        n, m, m_kv, b, s_q, s_k, d = ctx.dims
        like = next(x for x in (dq, dk, dv) if x is not None)
        flat = like.new_empty(n * (m * s_q + 2 * m_kv * s_k) * b * d)
        per_source = flat.view(n, -1)
        split = m * b * s_q * d
        if dq is not None:  # [b, m, n s_q, d] -> [n, m, b, s_q, d]
            per_source[:, :split].view(n, m, b, s_q, d).copy_(dq.reshape(b, m, n, s_q, d).permute(2, 1, 0, 3, 4))
        kv = per_source[:, split:].view(n, 2, m_kv, b, s_k, d)
        for i, t in enumerate((dk, dv)):  # [b, m_kv, n s_k, d] -> [n, m_kv, b, s_k, d]
            if t is None:
                kv[:, i].zero_()
            else:
                kv[:, i].copy_(t.reshape(b, m_kv, n, s_k, d).permute(2, 1, 0, 3, 4))
        if dq is None:
            per_source[:, :split].zero_()
        send_rows, recv_rows = ctx.rows
        ctx.token.start(flat, recv_rows, send_rows, ctx.group, backward=True)
        return flat, None, None, None, None, None


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
                parts.append(recvs[c][offsets[c]:offsets[c] + m].permute(1, 2, 0, 3))  # [m, b, s, d] -> [b, s, m, d]
                offsets[c] += m
        return torch.cat(parts, dim=2).transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        plan, rank = ctx.plan, ctx.rank
        rows = dout.permute(1, 0, 2, 3)  # [b, h, s, d] -> [h, b, s, d]
        sends = [None] * plan.chunks
        for c in reversed(range(plan.chunks)):  # the last chunk's dO is needed first
            chunk = plan.pieces[c]
            send = rows.contiguous() if plan.chunks == 1 else torch.cat([rows[p.q[0]:p.q[1]] for p in chunk])
            mine = chunk[rank].heads
            ctx.tokens[c].start(send, [p.heads for p in chunk], [mine] * len(chunk), ctx.group, backward=True)
            sends[c] = send
        return (None, None, None, None, *sends)
