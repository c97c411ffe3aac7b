"""Positions under sharding: every shard keeps the positions its tokens have in the full sequence.

- Rotary embeddings are computed on the FULL sequence's position ids and sliced to this rank's
  tokens. Scaled rotary types choose their frequencies from the largest position of the forward
  ("dynamic", "longrope"): computed per shard, rank 0 would keep the short-context frequencies
  while the sequence needs the long ones. The full-sequence cos/sin cost [S, head_dim] per rank.
- Absolute embeddings looked up by position id get this rank's position ids.
- M2M100 / NLLB's sinusoidal table is indexed by padding-aware positions (non-padding tokens count
  from padding_idx + 1), computed here on the full sequence.

The hooks are objects, not closures, so `copy.deepcopy` of a patched model rebinds them to the copy.
"""

from __future__ import annotations

import inspect

import torch


class RotaryHook:
    """Forward pre-hook and hook of a rotary embedding module: full positions in, this shard's out."""

    def __init__(self, state, side: str, module):
        self.state, self.side = state, side
        names = list(inspect.signature(module.forward).parameters)
        self.position_index = names.index("position_ids") if "position_ids" in names else 1

    def pre(self, module, args, kwargs):
        ctx = self.state.active
        if ctx is None:
            return None
        full = ctx.full_positions[self.side]  # [b or 1, S_pad], or [axes, b, S_pad]
        given = kwargs.get("position_ids", args[self.position_index] if len(args) > self.position_index else None)
        if full.dim() == 3 and isinstance(given, torch.Tensor) and given.dim() == 3 and given.shape[0] < full.shape[0]:
            full = full[full.shape[0] - given.shape[0] :]  # the text axis dropped before the rotary (M-RoPE's 3 of 4)
        elif full.dim() == 2 and isinstance(given, torch.Tensor) and given.dim() == 3:
            # the backbone spread its 2D positions over M-RoPE's axes itself (Qwen3.5 in transformers 5.17): the
            # same for the full sequence's (the dry run checks the rotary's output on every shard)
            full = full.unsqueeze(0).expand(given.shape[0], max(full.shape[0], given.shape[1]), -1)
        if "position_ids" in kwargs or len(args) <= self.position_index:
            kwargs["position_ids"] = full
        else:
            args = (*args[: self.position_index], full, *args[self.position_index + 1 :])
        return args, kwargs

    def post(self, module, args, kwargs, output):
        ctx = self.state.active
        if ctx is None:
            return None
        plan = ctx.plan(self.side)
        # a copy, not a view: a view would keep the whole sequence's cos/sin alive on every rank
        # (O(s) memory per rank: 4 KiB per local token at sp=8 with head_dim 64)
        if isinstance(output, tuple):  # (cos, sin) [b or 1, S_pad, d] -> [b or 1, s_loc, d]
            return tuple(_own(plan.shard(t, 1)) if isinstance(t, torch.Tensor) else t for t in output)
        return _own(plan.shard(output, 1))


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


class PositionIdsHook:
    """Forward pre-hook and hook of an absolute position embedding that takes `position_ids`: this
    shard's global (or per-document) positions, [s_loc] when every row shares them, else [b, s_loc].
    Some of these modules add a batch dim themselves (BART: `position_ids.unsqueeze(0)`); the hook
    folds a per-row result back to [b, s_loc, d]."""

    def __init__(self, state, side: str, module=None):
        self.state, self.side = state, side
        names = list(inspect.signature(module.forward).parameters) if module is not None else []
        self.position_index = names.index("position_ids") if "position_ids" in names else None

    def pre(self, module, args, kwargs):
        ctx = self.state.active
        if ctx is not None:
            positions = ctx.positions[self.side]  # [b or 1, s_loc]
            i = getattr(self, "position_index", None)
            positional = i is not None and len(args) > i and "position_ids" not in kwargs  # XGLM passes them so
            given = args[i] if positional else kwargs.get("position_ids")
            if isinstance(given, torch.Tensor) and given.dim() == 2:  # keep the [rows, s] the model passes
                positions = positions.expand(given.shape[0], -1) if positions.shape[0] == 1 else positions
            elif positions.shape[0] == 1:
                positions = positions[0]
            if positional:
                args = (*args[:i], positions, *args[i + 1 :])
            else:
                kwargs["position_ids"] = positions
        return args, kwargs

    def post(self, module, args, kwargs, output):
        if self.state.active is not None and output.dim() == 4 and output.shape[0] == 1:
            return output[0]  # [1, b, s_loc, d] -> [b, s_loc, d]
        return None


class M2M100PositionsHook:
    """Forward hook of M2M100's sinusoidal embedding: replace its output by the rows of its table at
    this shard's padding-aware positions, computed on the full sequence."""

    def __init__(self, state, side: str, pad_id: int):
        self.state, self.side, self.pad_id = state, side, pad_id

    def post(self, module, args, kwargs, output):
        ctx = self.state.active
        if ctx is None:
            return None
        meta, plan = ctx.seqs[self.side], ctx.plan(self.side)
        ids = ctx.ids.get(self.side)  # [b, S_pad] full token ids, or None (inputs_embeds)
        pad = module.padding_idx
        full = ctx.full_positions[self.side]
        if ids is None:  # from embeddings: sequential positions from padding_idx + 1
            real = meta.valid if meta.valid is not None else torch.ones_like(full, dtype=torch.bool)
            positions = torch.where(real, full + pad + 1, torch.full_like(full, pad))
        else:  # as M2M100 does: count the non-padding tokens (per document in packed rows)
            real = ids.ne(self.pad_id)
            count = torch.cumsum(real, dim=1)  # [b, S_pad]
            if meta.doc is not None:  # subtract the count before each document's first token
                doc = meta.doc.clamp(min=0)
                before = torch.full(
                    (doc.shape[0], doc.shape[1] + 1), doc.shape[1], dtype=count.dtype, device=count.device
                ).scatter_reduce(1, doc, count - real.long(), "amin")
                count = count - before.gather(1, doc)
            positions = count * real + pad
        local = plan.shard(positions.expand(output.shape[0], -1), 1)  # [b, s_loc]
        top = int(local.max()) + 1
        if top > module.weights.size(0):
            module.make_weights(top + module.offset, module.embedding_dim, pad)
        return module.weights.index_select(0, local.reshape(-1)).view(*local.shape, -1).to(output.dtype).detach()


def install(state, family, pad_id: int) -> list:
    """Register the hooks of every position module; returns the handles (deep-copyable)."""
    handles = []
    hook: RotaryHook | PositionIdsHook | M2M100PositionsHook
    for pos in family.positions:
        module = pos.module
        if pos.kind == "rotary":
            hook = RotaryHook(state, pos.side, module)
            handles.append(module.register_forward_pre_hook(hook.pre, with_kwargs=True))
            handles.append(module.register_forward_hook(hook.post, with_kwargs=True))
        elif pos.kind == "ids":
            hook = PositionIdsHook(state, pos.side, module)
            handles.append(module.register_forward_pre_hook(hook.pre, with_kwargs=True))
            handles.append(module.register_forward_hook(hook.post, with_kwargs=True))
        else:
            hook = M2M100PositionsHook(state, pos.side, pad_id)
            handles.append(module.register_forward_hook(hook.post, with_kwargs=True))
    return handles
