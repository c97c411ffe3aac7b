"""What transformers calls: the attention function and the mask function registered under "seqpar_hf"
(and under "seqpar_hf_decode", selected while `generate` runs under SP: `generation/decoding.py`).

Registering a name is process-wide, but only a patched model's own copy of its config selects it, so
every other model keeps its attention. The attention function finds its module's `AttentionSite` and
the forward's context (in the layer kwargs), and runs sequence-parallel attention; the mask function
builds no mask (attention takes padding, documents and windows from the context) after checking that
the model asks for a pattern the sharded kernels reproduce.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..attention.mask_patterns import check_mask_pattern
from .forward import front_masks
from .forward.context import CONTEXT_KWARG
from .forward.sites import resolve, site_of
from .forward.state import ATTN_DECODE_NAME, ATTN_NAME
from .generation import decoding
from .generation.decoding import DecodeStep
from .proof import temperature


def sp_mask(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None, **kwargs
):
    """Mask function: no mask for the layers. Sequence-parallel attention takes padding, documents and
    windows from the forward's context (identical on every rank, so every rank makes the same decisions).
    Outside a sharded forward (a multimodal model's front preparing its text model's masks) the mask is
    deferred: the text model's forward reads what it was made of (`forward/front_masks.py`)."""
    if not front_masks.SHARDED.get():
        return decoding.DeferredMask(
            (batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask), kwargs
        )
    if mask_function is not None:
        check_mask_pattern(mask_function, attention_mask, batch_size)
    return None


def sp_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, sliding_window=None, **kwargs
):
    """Attention function: query [b, h, s_q/sp, d], key/value [b, h_kv, s_k/sp, d] -> [b, s_q/sp, h, d]."""
    site = site_of(module)
    if site is None:
        raise RuntimeError(
            f"{type(module).__name__} has attn_implementation={ATTN_NAME!r} but was not patched by "
            "seqpar_hf.patch_model (a model rebuilt from a patched config?); build it from the "
            "original config, or patch the model itself"
        )
    if site.local:  # attention over a token's own states, not along the sequence: as the unpatched model
        return site(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            sliding_window=sliding_window,
            **kwargs,
        )
    ctx = kwargs.get(CONTEXT_KWARG) or site.state.active or site.state.step
    if ctx is None:
        raise RuntimeError(
            f"seqpar_hf: the sequence-parallel attention of {site.name} ran outside a sharded forward of the patched "
            f"model: a submodule (the encoder, a decoder layer, ...) was called directly. Call the patched model or "
            f"its backbone, run the code inside `with seqpar_hf.sp_disabled(model):` (no SP, this rank's own data), "
            f"or call seqpar_hf.unpatch_model(model) first"
        )
    if kwargs.get("output_attentions"):
        raise NotImplementedError("output_attentions is not available under sequence parallelism")
    causal, window = resolve(site, module, is_causal, sliding_window, kwargs)  # refuses keywords it would drop
    if isinstance(ctx, DecodeStep):  # a decoding step of generation under SP: nothing is sharded in it
        return decoding.attend(
            site,
            module,
            query,
            key,
            value,
            attention_mask,
            ctx,
            dropout,
            scaling,
            is_causal,
            sliding_window,
            window,
            kwargs,
        )
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-2] > 1:
        # the mask functions above build none: this one came from elsewhere (a hook, the model's own code) and
        # differs between queries, which the inputs' padding (all the sharded kernels take) cannot make. A mask
        # over the keys alone is the padding a model built by hand (T5-style encoders), which they do apply.
        raise NotImplementedError(
            f"seqpar_hf: {site.name} was given an attention mask of shape {tuple(attention_mask.shape)} that "
            "transformers' mask functions did not build (a forward hook or the model's own code made it); the "
            "sequence-parallel kernels take padding, documents and windows from the forward's inputs and would drop "
            "it. Express it through the model's inputs (attention_mask, position_ids) or run without seqpar_hf"
        )
    query = temperature.on_shard(module, query, ctx.plan(site.q_side))  # queries scaled by their index
    mods = site.score_mods(ctx, kwargs)  # soft-capping, sinks, a relative position bias
    out = site.attend(ctx, query, key, value, causal, window, scaling, dropout, mods)  # [b, h, s_q/sp, d]
    if site.state.decoding is not None:  # the prompt's forward of generation: trim this layer's cache shard
        decoding.after_prefill_attention(site.state, module, window)
    return out.transpose(1, 2), None  # [b, s_q/sp, h, d]


def sp_decode_mask(*args, **kwargs):
    """Mask function while `generate` runs under SP: the sharded forwards need none (as `sp_mask`), a
    decoding step's replicated self-attention needs the original one; so the mask is deferred and built
    only where an attention site asks for it (`decoding.DeferredMask`)."""
    mask_function = kwargs.get("mask_function", args[5] if len(args) > 5 else None)
    if mask_function is not None and front_masks.SHARDED.get():
        attention_mask = kwargs.get("attention_mask", args[6] if len(args) > 6 else None)
        check_mask_pattern(mask_function, attention_mask, kwargs.get("batch_size", args[0] if args else 1))
    elif mask_function is not None:  # a front's masks (read by the prompt's forward) or a decoding step's
        front_masks.check_deferred(decoding.DeferredMask(args, kwargs), check_mask_pattern)
    return decoding.deferred_mask(*args, **kwargs)


@functools.cache
def register() -> None:
    AttentionInterface.register(ATTN_NAME, sp_attention)
    AttentionMaskInterface.register(ATTN_NAME, sp_mask)
    AttentionInterface.register(ATTN_DECODE_NAME, sp_attention)
    AttentionMaskInterface.register(ATTN_DECODE_NAME, sp_decode_mask)
