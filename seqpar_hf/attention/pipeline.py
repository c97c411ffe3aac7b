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


def _put(buf: torch.Tensor, off: int, x: torch.Tensor) -> int:
    n = x.numel()
    if n:
        buf[off:off + n].view(x.shape).copy_(x)
    return off + n


def _take(buf: torch.Tensor, off: int, dst: torch.Tensor) -> int:
    """dst [b, s, m, d] (a view) <- buf's next m * b * s * d elements, laid out [m, b, s, d]."""
    b, s, m, d = dst.shape
    n = dst.numel()
    if n:
        dst.copy_(buf[off:off + n].view(m, b, s, d).permute(1, 2, 0, 3))
    return off + n


class Pack(torch.autograd.Function):
    """q [b, h, s_q, d], k/v [b, g, s_k, d] -> one flat send buffer per chunk: for each destination
    rank, its query heads [m, b, s_q, d], then its new kv heads of k, then of v [m_kv, b, s_k, d]."""

    @staticmethod
    def forward(ctx, q, k, v, plan: ChunkPlan):
        ctx.plan, ctx.shapes = plan, (q.shape, k.shape)
        kv_send = plan.split.kv_send
        qt, kt, vt = (x.permute(1, 0, 2, 3) for x in (q, k, v))  # [heads, b, s, d] views
        per_q, per_kv = q[:, :1].numel(), k[:, :1].numel()  # elements of one head
        sends = []
        for chunk in plan.pieces:
            buf = q.new_empty(sum(p.heads * per_q + 2 * p.kv_heads * per_kv for p in chunk))
            off = 0
            for p in chunk:
                off = _put(buf, off, qt[p.q[0]:p.q[1]])
                g0 = p.kv[0] if kv_send is None or not p.kv_heads else kv_send[p.kv[0]]  # a run of global kv heads
                for t in (kt, vt):
                    off = _put(buf, off, t[g0:g0 + p.kv_heads])
            sends.append(buf)
        return tuple(sends)

    @staticmethod
    def backward(ctx, *grads):
        plan, (q_shape, k_shape) = ctx.plan, ctx.shapes
        (b, h, s_q, d), (_, g, s_k, _) = q_shape, k_shape
        like = next(x for x in grads if x is not None)
        dq = like.new_empty(b, s_q, h, d)
        dkv = like.new_empty(2, b, s_k, plan.kv_rows, d)  # in the send order of the kv heads
        for chunk, grad in zip(plan.pieces, grads):
            grad = like.new_zeros(sum(p.heads * b * s_q * d + 2 * p.kv_heads * b * s_k * d for p in chunk)) \
                if grad is None else grad
            off = 0
            for p in chunk:
                off = _take(grad, off, dq[:, :, p.q[0]:p.q[1]])
                for t in dkv:
                    off = _take(grad, off, t[:, :, p.kv[0]:p.kv[1]])
        dk, dv = (t.transpose(1, 2) for t in dkv)  # [b, s_k, rows, d] -> [b, rows, s_k, d]
        if plan.split.kv_send is not None:  # replicated kv heads: sum their copies, as index_select's backward
            index = plan.kv_send_index(like.device)
            dk, dv = (like.new_zeros(b, g, s_k, d).index_add_(1, index, t) for t in (dk, dv))
        return dq.transpose(1, 2), dk, dv, None


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
