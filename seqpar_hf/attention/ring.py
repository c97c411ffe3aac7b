"""Ring attention (Liu et al. 2023, arXiv 2310.01889; ring self-attention of Li et al. 2021,
arXiv 2105.13120), load-balanced for causal attention by zigzag sharding.

Each rank keeps its queries and passes its K/V block around the ring with batch_isend_irecv; the
transfer of the next block overlaps the attention on the current one. Partial results merge with a
log-sum-exp update in fp32 (float64 for float64 inputs). The backward is a second ring: K/V travel
again, together with fp32 dK/dV accumulators that arrive home after the last step; block gradients are
recomputed from the final output and log-sum-exp. K/V travel with their own (grouped-query) head count,
and v with its own width (multi-head latent attention: 128 vs q/k's 192), packed flat in one message. Every transfer
is started before the kernel of the step and waited for after it, forward and backward (the
accumulator of a step included), and no step reads a tensor's value on the host.

What each step computes (which rows and columns, with which mask, or nothing at all) is a
`RingPlan`, built once per forward and attention pattern and reused by every layer and by the
backward (also when gradient checkpointing recomputes a layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .kernels import accumulation_dtype, block_backward, block_forward, merge
from .masks import MaskSpec
from .scores import NONE, ScoreMods, distance_index, relative_block, sink_grad, with_sinks


@dataclass
class Block:
    """The work between the local queries and one ring rank's keys."""

    rows: slice
    cols: slice
    causal: bool  # the kernel's own causal flag (the diagonal block of a zigzag causal ring)
    allowed: torch.Tensor | None  # [b, 1, rows, cols] bool, None: every pair
    valid_rows: torch.Tensor | None = None  # [b, 1, rows]: False where a query sees no key in this block
    q_idx: torch.Tensor | None = None  # [rows] global indices of the block's queries
    k_idx: torch.Tensor | None = None  # [cols] ... and of its keys
    _bias: dict | None = None
    _distance: dict | None = None

    def bias(self, dtype) -> torch.Tensor | None:
        """Additive 0 / -inf bias for the kernels, per dtype, made once."""
        if self.allowed is None:
            return None
        self._bias = self._bias or {}
        if dtype not in self._bias:
            self._bias[dtype] = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device).masked_fill(
                ~self.allowed, float("-inf")
            )
        return self._bias[dtype]

    def distance(self, center: int) -> torch.Tensor:
        """[rows, cols] entries of a by-distance bias table (relative position bias), made once."""
        self._distance = self._distance or {}
        if center not in self._distance:
            assert self.q_idx is not None and self.k_idx is not None  # set by RingPlan.build
            self._distance[center] = distance_index(center, self.q_idx, self.k_idx)
        return self._distance[center]


@dataclass
class RingPlan:
    """Everything a ring attention call needs besides q, k, v; identical on every ring rank up to
    `index`. `blocks[j]` is the work against ring rank j's keys (None: nothing to attend)."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]  # global ranks in ring order
    index: int  # this rank's position in the ring
    blocks: list[Block | None]
    _kv_index: dict = field(default_factory=dict, repr=False)  # kv_for_q -> index tensor, made once

    def kv_index(self, kv_for_q: tuple[int, ...] | None, device) -> torch.Tensor | None:
        """The [h] kv head of each query head as a tensor (None: one to one), copied to the device once
        per forward rather than once per layer."""
        if kv_for_q is None:
            return None
        if kv_for_q not in self._kv_index:
            self._kv_index[kv_for_q] = torch.tensor(kv_for_q, device=device)
        return self._kv_index[kv_for_q]

    @classmethod
    def build(
        cls, spec: MaskSpec, group, ranks, index: int, q_index: torch.Tensor, k_index: list[torch.Tensor]
    ) -> RingPlan:
        """`q_index` [s_q]: global positions of the local queries; `k_index[j]` [s_k]: ring rank j's keys.
        Zigzag causal: own block causal; an earlier rank's block is seen whole by every query through
        its first chunk; a later rank's block is seen whole by the second query chunk only. Host syncs:
        two per masked block, once per forward."""
        # blocks that attend both ways reach later ranks' keys: every block is masked as it is (no zigzag skips)
        zigzag = spec.causal and spec.q.plan.zigzag and spec.blocks is None
        s_q = q_index.numel()
        blocks: list[Block | None] = []
        for source in range(len(ranks)):
            s_k = k_index[source].numel()
            rows, cols, causal = slice(0, s_q), slice(0, s_k), False
            if zigzag:
                if source == index:
                    causal = True
                elif source < index:
                    cols = slice(0, s_k // 2)
                else:
                    rows = slice(s_q // 2, s_q)
            q_idx, k_idx = q_index[rows], k_index[source][cols]
            if (
                spec.causal
                and not zigzag
                and spec.blocks is None
                and source == index
                and _ascending_self(spec, q_idx, k_idx)
            ):
                # contiguous self-attention block (a ring of one under Ulysses): the kernel's causal flag, with
                # no [s, s] mask where nothing else (padding, documents, a window) needs one
                causal = spec.block_mask(q_idx, k_idx, causal=False) is None
            allowed = spec.block_mask(q_idx, k_idx, causal=spec.causal and not zigzag and not causal)
            if allowed is not None and causal:  # one mask carries everything
                n = q_idx.numel()
                allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()
                causal = False
            if allowed is not None:
                if not bool(allowed.any()):
                    blocks.append(None)  # e.g. other documents, or outside the sliding window
                    continue
                if bool(allowed.all()):
                    allowed = None
            valid_rows = None
            if allowed is not None:
                allowed = allowed.expand(allowed.shape[0], 1, q_idx.numel(), k_idx.numel())
                valid_rows = allowed.any(-1)  # [b, 1, rows]
            blocks.append(Block(rows, cols, causal, allowed, valid_rows, q_idx, k_idx))
        return cls(group, tuple(ranks), index, blocks)


def _ascending_self(spec: MaskSpec, q_idx: torch.Tensor, k_idx: torch.Tensor) -> bool:
    """Queries and keys are the same tokens in position order (host sync: once per forward)."""
    return spec.q is spec.k and torch.equal(q_idx, k_idx) and bool((q_idx[1:] > q_idx[:-1]).all())


class Ring:
    """Point-to-point exchange with the ring neighbours."""

    def __init__(self, plan: RingPlan):
        n = self.size = len(plan.ranks)
        self.group, self.next, self.prev = (
            plan.group,
            plan.ranks[(plan.index + 1) % n],
            plan.ranks[(plan.index - 1) % n],
        )

    def start(self, send: torch.Tensor):
        if self.size == 1:  # a ring of one (Ulysses with score modifiers): the block is already home
            return send, []
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending):
        recv, works = pending
        for w in works:
            w.wait()
        return recv


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k [b, h_kv, s, d] and v [b, h_kv, s, d_v] (contiguous) -> one flat message [b h_kv s (d + d_v)]."""
    return torch.cat([k.view(-1), v.view(-1)])


def _unpack(flat: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `_pack`, as views: -> k [b, h_kv, s, d], v [b, h_kv, s, d_v]."""
    k = flat[: k_shape.numel()]
    return k.view(k_shape), flat[k_shape.numel() :].view(v_shape)


def _expand(x: torch.Tensor, kv_index) -> torch.Tensor:
    return x if kv_index is None else x.index_select(1, kv_index)  # [b, h_kv, s, d] -> [b, h, s, d]


def _reduce(dx: torch.Tensor, kv_index, heads_kv: int) -> torch.Tensor:
    if kv_index is None:
        return dx
    out = dx.new_zeros((dx.shape[0], heads_kv, *dx.shape[2:]))
    return out.index_add_(1, kv_index, dx)  # [b, h, s, d] -> [b, h_kv, s, d]


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, relative, plan: RingPlan, scale: float, kv_index, softcap, center):
        n, ring = len(plan.ranks), Ring(plan)
        b, h, s_q, _ = q.shape
        acc_dtype = accumulation_dtype(q.dtype)
        out = torch.zeros(b, h, s_q, v.shape[-1], dtype=acc_dtype, device=q.device)
        lse = torch.full((b, h, s_q), float("-inf"), dtype=acc_dtype, device=q.device)
        kv = _pack(k, v)  # one message per step
        for step in range(n):
            pending = ring.start(kv) if step + 1 < n else None
            block = plan.blocks[(plan.index - step) % n]
            if block is not None:
                rows, cols = block.rows, block.cols
                k_held, v_held = _unpack(kv, k.shape, v.shape)
                kb, vb = _expand(k_held[:, :, cols], kv_index), _expand(v_held[:, :, cols], kv_index)
                o, block_lse = block_forward(
                    q[:, :, rows].contiguous(),
                    kb.contiguous(),
                    vb.contiguous(),
                    block.bias(q.dtype),
                    block.causal,
                    scale,
                    softcap,
                    None if relative is None else relative_block(relative, block.distance(center)),
                )
                if block.valid_rows is not None:  # kernels report lse 0 for rows that saw no key: make it -inf
                    block_lse = block_lse.masked_fill(~block.valid_rows, float("-inf"))
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, block_lse)
            if pending is not None:
                kv = Ring.wait(pending)
        if sinks is not None:  # each head's sink joins the denominator once, after every block
            out, lse = with_sinks(out, lse, sinks)
        # laid out as [b, s, h, d] in memory: the caller's transpose to [b, s, h, d] is then free, so the
        # output projection's saved input shares this storage instead of keeping a second copy
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        lse = lse.masked_fill(torch.isinf(lse), 0.0)  # rows that saw no key at all: grads are 0 anyway
        ctx.save_for_backward(q, k, v, out, lse, sinks, relative)
        ctx.plan, ctx.scale, ctx.kv_index, ctx.softcap, ctx.center = plan, scale, kv_index, softcap, center
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, relative = ctx.saved_tensors
        plan, scale, kv_index, softcap, center = ctx.plan, ctx.scale, ctx.kv_index, ctx.softcap, ctx.center
        drelative = (
            None
            if relative is None
            else torch.zeros(relative.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
        )
        n, ring = len(plan.ranks), Ring(plan)
        heads_kv = k.shape[1]
        dout = dout.contiguous()
        acc_dtype = accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        kv = _pack(k, v)  # travels as in the forward
        carried = None  # pending fp32 dK/dV accumulator of the block held at this step (packed as k and v)
        for step in range(n):
            pending_kv = ring.start(kv) if step + 1 < n else None
            block = plan.blocks[(plan.index - step) % n]
            if block is not None:
                rows, cols = block.rows, block.cols
                k_held, v_held = _unpack(kv, k.shape, v.shape)
                kb, vb = _expand(k_held[:, :, cols], kv_index), _expand(v_held[:, :, cols], kv_index)
                grads = block_backward(
                    dout[:, :, rows],
                    q[:, :, rows].contiguous(),
                    kb.contiguous(),
                    vb.contiguous(),
                    out[:, :, rows].contiguous(),
                    lse[:, :, rows].contiguous(),
                    block.bias(q.dtype),
                    block.causal,
                    scale,
                    softcap,
                    None if relative is None else relative_block(relative, block.distance(center)),
                )
                dq_b, dk_b, dv_b = grads[:3]
                if drelative is not None:  # the block's score gradient, summed by distance into the table
                    index = block.distance(center).reshape(-1)
                    drelative.index_add_(1, index, grads[3].reshape(relative.shape[0], -1).to(drelative.dtype))
                dq[:, :, rows] += dq_b.to(acc_dtype)
            # the accumulator of this block travelled during the kernel above; waiting for it only now keeps
            # that transfer in flight while the kernel runs (the same additions, in the same order)
            acc = (
                torch.zeros(k.numel() + v.numel(), dtype=acc_dtype, device=k.device)
                if carried is None
                else Ring.wait(carried)
            )
            if block is not None:
                dk_acc, dv_acc = _unpack(acc, k.shape, v.shape)  # views: the sums land in `acc`
                dk_acc[:, :, cols] += _reduce(dk_b.to(acc_dtype), kv_index, heads_kv)
                dv_acc[:, :, cols] += _reduce(dv_b.to(acc_dtype), kv_index, heads_kv)
            carried = ring.start(acc)  # to the next rank, who holds this block at the next step
            if pending_kv is not None:
                kv = Ring.wait(pending_kv)
        dk, dv = _unpack(Ring.wait(carried), k.shape, v.shape)  # our own block's gradient, home after a full turn
        # blocks taken with the final lse (sinks in it) are the sink-augmented softmax's backward already
        dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        if drelative is not None:
            drelative = drelative.to(relative.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks, drelative, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    scale: float,
    kv_for_q: tuple[int, ...] | None = None,
    mods: ScoreMods = NONE,
) -> torch.Tensor:
    """q [b, h, s_q, d], k [b, h_kv, s_k, d], v [b, h_kv, s_k, d_v] (this rank's blocks) -> [b, h, s_q, d_v];
    `mods`: soft-capping and sinks for these h query heads."""
    kv_index = plan.kv_index(kv_for_q, q.device)
    return RingAttention.apply(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        mods.sinks,
        mods.relative,
        plan,
        scale,
        kv_index,
        mods.softcap,
        mods.center,
    )
