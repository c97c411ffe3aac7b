"""What the attention of a patched model does while `generate` runs under SP (see `generation/generate.py`).

A `DecodeSession` lives for one `generate` call. Its sharded part (the encoder, or a decoder-only
model's prompt) runs as an ordinary sharded forward; every later forward is a decoding step
(`DecodeStep`): no sequence is sharded, the step's new tokens are replicated, and each kind of
attention site does this:
- cross-attention (decoder queries, encoder keys): the keys are this rank's shard of the encoder
  states (its cross-attention cache holds [b, h, S/sp, d]); attend locally with the local source mask
  and merge over the group (`attention.decode`);
- decoder self-attention of an encoder-decoder model: the target is short and replicated, so the
  model's ORIGINAL attention function runs, with the mask its ORIGINAL mask function builds (the masks
  of a step are deferred, `DeferredMask`, and built only here);
- self-attention of a decoder-only model: the keys are this rank's shard of the KV cache
  (`sharded_cache`); attend locally (causal and window by global index) and merge over the group.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ... import _compat
from ...attention import decode
from ...attention.scores import ScoreMods
from ...parallel.layout import ParallelLayout
from ...parallel.sharding import ShardPlan
from ..forward.context import CONTEXT_KWARG, ForwardContext
from .sharded_cache import SequenceShardedCache, narrower

_MISSING = object()


class DecodeStep:
    """Per-forward metadata of one decoding step of sequence-parallel generation (no sequence is
    sharded in it: the step's few new tokens are replicated on every rank). `source_valid`
    [b, S_pad / sp] marks which of this rank's encoder positions are real (None: all of them), for
    cross-attention over the sharded encoder states; decoder-only models read their keys' positions
    from the sequence-sharded cache, `cache`."""

    def __init__(self, layout: ParallelLayout, source_valid: torch.Tensor | None = None, cache=None):
        self.layout, self.source_valid, self.cache = layout, source_valid, cache


class DeferredMask:
    """A mask transformers asked for while the decode implementation is selected: its arguments, built by
    the original implementation's mask function only if an attention site needs it, once per forward
    (every layer gets the same object)."""

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs, self.value = args, kwargs, _MISSING

    def __getitem__(self, key):
        """A model that slices its masks along the queries (Gemma 4 before its KV-shared layers, to the
        `logits_to_keep` last positions) gets the same mask back when the slice keeps every position, as
        in the sharded prompt forward (`BackboneForward` passes `logits_to_keep=0`); the attention of a
        sharded forward reads no mask."""
        keys = key if isinstance(key, tuple) else (key,)
        if all(k is Ellipsis or (isinstance(k, slice) and k.start in (None, 0) and k.stop is None) for k in keys):
            return self
        raise NotImplementedError(
            f"generate under sequence parallelism: the model slices its attention mask ({key!r}); "
            "generate without SP (`with seqpar_hf.sp_disabled(model):`)"
        )

    def build(self, implementation: str):
        if self.value is _MISSING:
            self.value = ALL_MASK_ATTENTION_FUNCTIONS[implementation](*self.args, **self.kwargs)
        return self.value


class DecodeSession:
    """One `generate` call under SP: the sequence-sharded KV cache (decoder-only) or the source's shard
    plan (encoder-decoder), from which each decoding step's metadata is made."""

    def __init__(
        self, layout: ParallelLayout, cache: SequenceShardedCache | None = None, source_plan: ShardPlan | None = None
    ):
        self.layout, self.cache, self.source_plan = layout, cache, source_plan
        # (the full source mask it was made from, its local validity)
        self._source: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def prefill_pending(self) -> bool:
        """A decoder-only model's next forward is the prompt's: run it sharded."""
        return self.cache is not None and self.cache.get_seq_length() == 0

    def begin_prefill(self, ctx: ForwardContext) -> None:
        meta, plan = ctx.seqs["decoder"], ctx.plan("decoder")
        device = ctx.positions["decoder"].device
        valid = plan.shard(meta.valid) if meta.valid is not None else None  # [b, S_pad] -> [b, s_loc]
        assert self.cache is not None  # a decoder-only session (prefill_pending)
        lead = None if meta.valid is None else (meta.valid.long().cumsum(-1) == 0).sum(-1)  # [b] left padding
        self.cache.begin_prefill(plan.global_index(device=device), valid, plan.length, lead)

    def end_prefill(self) -> None:
        assert self.cache is not None  # a decoder-only session (prefill_pending)
        self.cache.end_prefill()

    def step(self, kwargs: dict) -> DecodeStep:
        """The metadata of a decoding step from the arguments of its backbone forward."""
        if self.source_plan is None:
            return DecodeStep(self.layout, cache=self.cache)
        return DecodeStep(self.layout, source_valid=self._source_valid(kwargs))

    def _source_valid(self, kwargs: dict) -> torch.Tensor | None:
        """[b, S_pad / sp] validity of this rank's encoder positions (the source padding mask generate
        passes at every step, beam-expanded, and the padding to a multiple of sp); made once per mask."""
        mask = kwargs.get("attention_mask")
        if mask is self._source[0] and self._source[0] is not None:
            return self._source[1]
        plan = self.source_plan
        assert plan is not None  # an encoder-decoder session (step)
        if mask is None:
            if plan.padded == plan.length:
                return None
            mask = torch.ones(1, plan.length, dtype=torch.bool, device=kwargs["encoder_outputs"][0].device)
        valid = plan.shard(plan.pad(mask.bool(), False))  # [b, S] -> [b, S_pad / sp]
        self._source = (mask, valid)
        return valid


def deferred_mask(*args, **kwargs) -> DeferredMask:
    """Mask function of the decode implementation (see `DeferredMask`)."""
    return DeferredMask(args, kwargs)


def attend(
    site,
    module,
    query,
    key,
    value,
    attention_mask,
    step: DecodeStep,
    dropout,
    scaling,
    is_causal,
    sliding_window,
    window,
    kwargs,
):
    """A decoding step's attention at `site`: query [b, h, s_q, d] (replicated), key/value what the module
    took from its cache -> ([b, s_q, h, d], None), as transformers' attention functions return. The
    replicated original attention gets the call's own `is_causal` / `sliding_window`; the cache shard the
    window the unpatched model computes (`window`, which may come from the mask alone)."""
    state = site.state
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    group = step.layout.sp_group
    if site.q_side == "decoder" and site.kv_side == "encoder":  # this rank's shard of the encoder states
        allowed = None if step.source_valid is None else step.source_valid[:, None, None, :]  # [b, 1, 1, S/sp]
        return decode.attention(query, key, value, allowed, scale, group, ScoreMods.of(kwargs)).transpose(1, 2), None
    if step.cache is None:  # an encoder-decoder model's decoder self-attention: replicated, the original one
        implementation = state.attn_implementation
        if isinstance(attention_mask, DeferredMask):
            attention_mask = attention_mask.build(implementation)
        extra = {k: v for k, v in kwargs.items() if k != CONTEXT_KWARG}
        if is_causal is not None:
            extra["is_causal"] = is_causal
        if sliding_window is not None:
            extra["sliding_window"] = sliding_window
        function = _compat.original_attention_function(module, implementation)
        return function(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **extra)
    if site.bias is not None and site.bias[0] == "relative":
        raise NotImplementedError(
            f"generate under sequence parallelism: {site.name} adds a relative position bias to a decoder-only "
            "model's cached keys; generate without SP (`with seqpar_hf.sp_disabled(model):`)"
        )
    layer = step.cache.reader(module.layer_idx, key, window)  # this rank's shard of the KV cache (or the one it shares)
    out = decode.attention(query, key, value, layer.allowed(), scale, group, ScoreMods.of(kwargs))  # [b, h, s_q, d]
    return out.transpose(1, 2), None


def after_prefill_attention(state, module, sliding_window) -> None:
    """A sharded forward of a session with a KV cache is the prompt's: once a layer has attended, its
    cache shard keeps only what later queries can see (a sliding window's last tokens)."""
    session = state.decoding
    if session is not None and session.cache is not None:
        layer = session.cache.layer(module.layer_idx)  # None: a KV-shared layer, whose owner trims its shard
        if layer is not None:
            layer.set_window(narrower(sliding_window, layer.cache_window))
            layer.evict()
