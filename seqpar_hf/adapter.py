"""The transformers adapter: patch one model instance so that its forward is sequence-parallel.

Touches transformers only through public hooks, per instance, reversibly:
- an attention function and a mask function registered under the name "seqpar_hf" in
  `AttentionInterface` / `AttentionMaskInterface`, selected by this model's (private copy of its)
  config, so other models in the process are unaffected;
- a wrapped `forward` that shards the full batch and computes the loss over the SP group, and a
  wrapped `generate` that runs without SP;
- forward pre-hooks on absolute position embeddings (Marian/BART) that give each shard its
  global positions.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, causal_mask_function

from . import local_attention
from .checks import check_same_batch
from .comm import all_gather_cat
from .families import ModelFamily, inspect_model
from .layout import ParallelLayout
from .batch import shard_causal, shard_seq2seq
from .loss import sequence_parallel_loss
from .rng import LayerDropSync, per_rank_stream
from .sharding import ShardPlan
from .ring import RingSpec, ring_attention
from .ulysses import split_heads, ulysses_attention

ATTN_NAME = "seqpar_hf"
_STATE = "_seqpar_state"  # attribute on the patched model
_SITE = "_seqpar_site"  # attribute on each patched attention module


# ---------------------------------------------------------------------------------------------
# functions registered with transformers


def sp_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
            **kwargs):
    """Mask function: pass the full key-padding mask [b, s_k] through (None if nothing is masked).

    The patched forward always hands the model the full (padded) 2D mask of the sequence, which is
    identical on every rank of the group, so every rank makes the same None-or-mask decision.
    """
    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        name = getattr(mask_function, "__name__", type(mask_function).__name__)
        raise NotImplementedError(f"seqpar_hf shards plain causal or bidirectional attention; this model asked for "
                                  f"the mask pattern {name!r} (sliding window, chunked or custom masks are not supported)")
    if attention_mask is None:
        return None
    if q_offset or kv_offset or attention_mask.shape[-1] != kv_length:
        raise RuntimeError(f"seqpar_hf: unexpected mask sizes (kv_length={kv_length}, mask {tuple(attention_mask.shape)},"
                           f" offsets {q_offset}/{kv_offset}); is a cache in use under SP?")
    return None if bool(attention_mask.all()) else attention_mask


def sp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Attention function: query [b, h, s_q/sp, d], key/value [b, h_kv, s_k/sp, d] -> [b, s_q/sp, h, d]."""
    site = getattr(module, _SITE, None)
    if site is None:
        raise RuntimeError(f"{type(module).__name__} has attn_implementation={ATTN_NAME!r} but was not patched by "
                           "seqpar_hf.patch_model (a copied config?); patch the model instead")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("output_attentions is not available under sequence parallelism")
    causal = bool(module.is_causal if is_causal is None else is_causal)
    out = site.attend(query, key, value, attention_mask, causal, scaling, dropout)  # [b, h, s_q/sp, d]
    return out.transpose(1, 2), None  # [b, s_q/sp, h, d]


@functools.cache
def _register():
    # Registering a name is global, but only configs that select "seqpar_hf" use it.
    AttentionInterface.register(ATTN_NAME, sp_attention)
    AttentionMaskInterface.register(ATTN_NAME, sp_mask)


# ---------------------------------------------------------------------------------------------
# per-instance state


class AttentionSite:
    """One attention module of a patched model: which sequences its queries and keys come from."""

    def __init__(self, state: "PatchState", q_side: str, kv_side: str):
        self.state, self.q_side, self.kv_side = state, q_side, kv_side

    def attend(self, q, k, v, key_mask, causal, scale, dropout):
        """q [b, h, s_q/sp, d], k/v [b, h_kv, s_k/sp, d] -> [b, h, s_q/sp, d]."""
        layout = self.state.layout
        if key_mask is not None and key_mask.shape[-1] != k.shape[2] * layout.sp_size:
            raise RuntimeError(f"seqpar_hf: key mask covers {key_mask.shape[-1]} tokens, the keys "
                               f"{k.shape[2]} x {layout.sp_size}")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if layout.sizes.ring_size == 1:
            def inner(q, k, v, kv_for_q):
                return local_attention.attention(q, k, v, key_mask, causal, scale, dropout, kv_for_q)
        else:
            if dropout > 0:
                raise NotImplementedError(f"ring attention does not support attention dropout (got {dropout}); "
                                          "set the model's attention_dropout to 0 or use mode='ulysses'")

            def inner(q, k, v, kv_for_q):
                return ring_attention(q, k, v, self._ring_spec(q, key_mask, causal, scale, kv_for_q))
        if layout.ulysses_size == 1:
            rep = q.shape[1] // k.shape[1]
            return inner(q, k, v, None if rep == 1 else tuple(i // rep for i in range(q.shape[1])))
        return ulysses_attention(q, k, v, layout.ulysses_group, layout.ulysses_rank, inner)

    def _ring_spec(self, q, key_mask, causal, scale, kv_for_q) -> RingSpec:
        layout, plans = self.state.layout, self.state.plans
        q_plan, kv_plan = plans[self.q_side], plans[self.kv_side]
        device = q.device
        return RingSpec(group=layout.ring_group, ranks=layout.ring_ranks, index=layout.ring_rank,
                        q_index=q_plan.ring_index(layout.ring_rank, device),
                        k_index=[kv_plan.ring_index(j, device) for j in range(layout.sizes.ring_size)],
                        key_mask=key_mask, causal=causal, zigzag=causal and q_plan.zigzag, scale=scale,
                        kv_for_q=kv_for_q)


class PatchState:
    def __init__(self, model, layout: ParallelLayout, family: ModelFamily, attn_implementation: str):
        self.layout, self.family, self.attn_implementation = layout, family, attn_implementation
        self.positions: dict[str, torch.Tensor] = {}  # side -> [s_loc] global positions, during a forward
        self.plans: dict[str, ShardPlan] = {}  # side -> plan of the last SP forward
        self.local_depth = 0  # > 0 while running without SP (generation)
        self.hooks = []
        self.layerdrop = LayerDropSync(family.layer_stacks)
        self.saved_attrs = {name: model.__dict__.get(name) for name in ("forward", "generate")}

    @contextlib.contextmanager
    def without_sp(self, model):
        """Run the plain model (its original attention implementation) on this rank's data."""
        if self.local_depth == 0:
            model.set_attn_implementation(self.attn_implementation)
        self.local_depth += 1
        try:
            yield
        finally:
            self.local_depth -= 1
            if self.local_depth == 0:
                model.set_attn_implementation(ATTN_NAME)


# ---------------------------------------------------------------------------------------------
# public API


def patch_model(model, layout: ParallelLayout, check_inputs: bool = True):
    """Make `model` (this instance) sequence-parallel over `layout`'s SP group and return it.

    Every rank of an SP group must then pass the same, full batch; the model shards it along the
    sequence itself. `out.loss` is the loss of the group's full batch (the unpatched model's number),
    the same on every rank; `out.logits` is this rank's shard of the sequence ([b, s_local, vocab],
    padding included): `gather_logits(model, out.logits)` returns the full logits. Gradients are
    complete once a data-parallel wrapper (DDP/FSDP/accelerate) averages them over the world.
    `check_inputs` verifies, with one tiny all-gather per forward, that the ranks of the group got the
    same batch, and raises on every rank otherwise.
    """
    state = getattr(model, _STATE, None)
    if state is not None:
        if state.layout is layout:
            return model
        raise ValueError(f"this model is already patched with {state.layout}; call seqpar_hf.unpatch_model(model) "
                         f"before patching it with {layout}")
    attn_implementation = model.config._attn_implementation
    family = inspect_model(model, attn_implementation)
    for site in family.attention:  # refuse head counts Ulysses cannot split, before any forward
        split_heads(*_head_counts(site.module), layout.ulysses_size)
    _register()
    _own_config(model)
    state = PatchState(model, layout, family, attn_implementation)
    state.check_inputs = check_inputs
    for site in family.attention:
        setattr(site.module, _SITE, AttentionSite(state, site.q_side, site.kv_side))
    for side, module in family.position_embeddings.items():
        state.hooks.append(module.register_forward_pre_hook(_position_hook(state, side), with_kwargs=True))
    setattr(model, _STATE, state)
    original_forward, original_generate = model.forward, getattr(model, "generate", None)
    model.forward = functools.wraps(original_forward)(functools.partial(_sp_forward, model, state, original_forward))
    if original_generate is not None:
        @functools.wraps(original_generate)
        def generate(*args, **kwargs):
            with state.without_sp(model):
                return original_generate(*args, **kwargs)
        model.generate = generate
    model.set_attn_implementation(ATTN_NAME)
    return model


def unpatch_model(model):
    """Undo `patch_model`: the instance runs the plain transformers code again."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    model.set_attn_implementation(state.attn_implementation)
    for handle in state.hooks:
        handle.remove()
    state.layerdrop.remove()
    for site in state.family.attention:
        delattr(site.module, _SITE)
    for name, previous in state.saved_attrs.items():
        if previous is None:
            model.__dict__.pop(name, None)
        else:
            setattr(model, name, previous)
    delattr(model, _STATE)
    return model


def is_patched(model) -> bool:
    return getattr(model, _STATE, None) is not None


def sp_disabled(model):
    """Context manager: inside it, a patched model runs without SP on this rank's own data."""
    state = getattr(model, _STATE, None)
    return contextlib.nullcontext() if state is None else state.without_sp(model)


def gather_sequence(model, tensor: torch.Tensor, side: str = "decoder", dim: int = 1) -> torch.Tensor:
    """Gather a sequence-sharded output of the last forward (e.g. logits [b, s_loc, V]) into the full,
    unpadded sequence on every rank of the SP group. `side="encoder"` for encoder outputs. No gradient."""
    state = getattr(model, _STATE, None)
    if state is None:
        return tensor
    plan = state.plans.get(side)
    if plan is None:
        raise ValueError(f"no sharded {side!r} sequence in the last forward of this model")
    return plan.unshard(all_gather_cat(tensor, state.layout.sp_group, dim), dim)


def gather_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """Full logits [b, s, V] from this rank's shard of the last forward's logits."""
    return gather_sequence(model, logits, "decoder")


# ---------------------------------------------------------------------------------------------
# internals


def _head_counts(module) -> tuple[int, int]:
    config = module.config
    heads = getattr(module, "num_heads", None) or config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def _own_config(model):
    """Give the model its own config object, so switching its attention does not touch another
    model built from the same config."""
    old = model.config
    new = copy.deepcopy(old)
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new


def _position_hook(state: PatchState, side: str):
    def hook(module, args, kwargs):
        positions = state.positions.get(side)
        if positions is not None:
            kwargs["position_ids"] = positions  # global positions of this shard, [s_loc]
        return args, kwargs
    return hook


_CACHE_ARGS = ("cache", "past_key_values", "encoder_outputs")


def _sp_forward(model, state: PatchState, original_forward, *args, **kwargs):
    if args:  # name positional arguments the way the original forward does
        names = [p for p in inspect.signature(original_forward).parameters][:len(args)]
        kwargs.update(zip(names, args))
    if state.local_depth or any(kwargs.get(k) is not None for k in _CACHE_ARGS):
        with state.without_sp(model):  # incremental decoding: no SP, this rank's own data
            return original_forward(**kwargs)
    if kwargs.get("logits_to_keep", 0) not in (0, None):
        raise ValueError("logits_to_keep is not supported under sequence parallelism (generation runs without SP)")
    layout = state.layout
    if layout.enabled:
        if not dist.is_initialized():
            raise RuntimeError(f"this model is patched for sequence parallelism ({layout}) but no process group is "
                               "initialised any more; call seqpar_hf.unpatch_model(model) to use it in one process")
        if state.check_inputs:
            device = next((v.device for v in kwargs.values() if isinstance(v, torch.Tensor)), model.device)
            check_same_batch(kwargs, model.training, layout.sp_group, device)
    return_dict = kwargs.pop("return_dict", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    label_smoothing = kwargs.pop("label_smoothing", 0.0)
    batch = (shard_seq2seq if state.family.kind == "seq2seq" else shard_causal)(model, layout, kwargs)
    kwargs, labels = batch.inputs, batch.labels
    state.plans, state.positions = batch.plans, batch.positions
    kwargs["use_cache"] = False  # no cache under SP: its lengths would be local
    training = model.training
    rng = per_rank_stream(layout.sp_rank, labels.device if labels is not None else model.device) \
        if training and layout.enabled else contextlib.nullcontext()
    try:
        with state.layerdrop.decide(training and layout.enabled), rng:
            out = original_forward(**kwargs, return_dict=True)
    finally:
        state.positions = {}
    if labels is not None:
        loss = sequence_parallel_loss(out.logits, labels, layout.sp_group, layout.sp_size, num_items, label_smoothing)
        out = type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})
    return out if return_dict is not False else out.to_tuple()
