"""The transformers adapter: patch one model instance so that it runs sequence-parallel.

Where the sequence is sharded: in the forward of the model's backbone (`model.base_model`, e.g.
LlamaModel, MarianModel), the level every entry point passes through: the model's own forward,
PEFT wrappers, a merged PEFT model, TRL's fused LM head (which calls the backbone directly), a
deep copy. The backbone's forward shards its full inputs, builds the forward's context, runs the
layers, and by default gathers its outputs back to the full sequence, so whatever code runs on top
computes exactly what it computes on the unpatched model (at the cost of running that head on the
full sequence on every rank).

The patched language model's own forward, when given labels, asks the backbone for this rank's
shard instead and computes the loss over the SP group itself: logits stay [b, s/sp, vocab] per rank,
the memory-efficient path. Without labels it returns what the unpatched model returns.

The sequence-parallel attention runs only inside a sharded backbone forward (it needs that forward's
context); reached any other way (a submodule called directly, a model rebuilt from the patched
config) it stops on every rank with an error that names the fix.

Touches transformers only through public hooks, per instance, reversibly: an attention function and
a mask function registered under "seqpar_hf" and selected by this model's own copy of its config;
instance `forward` / `generate` wrappers; forward hooks on position embeddings. Every piece is an
object rather than a closure, so `copy.deepcopy` of a patched model is a patched model on the same
layout.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..attention import kernels
from ..attention.ring import ring_attention
from ..attention.ulysses import split_heads, ulysses_attention
from ..parallel.comm import all_gather_cat, gather_sequence as gather_full
from ..parallel.layout import ParallelLayout
from . import positions, tensor_parallel
from .checks import check_same_batch
from .context import CONTEXT_KWARG, ForwardContext
from .families import ModelFamily, inspect_model, unwrap
from .inputs import shard_causal, shard_seq2seq
from .loss import (IGNORE_INDEX, TILED_LOSS_MIN_ELEMENTS, group_mean_loss, tiled_token_loss_sum,
                   token_loss_sum)
from .rng import LayerDropSync, per_rank_stream

ATTN_NAME = "seqpar_hf"
_STATE = "_seqpar_state"  # on the patched model, its transformers model and its backbone
_SITE = "_seqpar_site"  # on each patched attention module
_INCREMENTAL = ("cache", "past_key_values", "encoder_outputs")


# ---------------------------------------------------------------------------------------------
# functions registered with transformers


def _pattern_key(fn):
    """A hashable identity for a mask function: its code and the simple values it closes over
    (transformers builds a new closure per mask, e.g. one per sliding window size)."""
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if callable(value):
            value = _pattern_key(value)
        elif not isinstance(value, (int, float, bool, str, type(None))):
            return None
        cells.append(value)
    code = getattr(fn, "__code__", None)
    return None if code is None else (code, tuple(cells))


_CHECKED: set = set()  # mask functions (by _pattern_key) already found acceptable; a pure function of the key


def _check_mask_pattern(mask_function) -> None:
    """Refuse mask patterns other than causal, bidirectional and causal sliding-window. The pattern is
    read off the function on a small grid of CPU tensors, once per kind of mask function."""
    key = _pattern_key(mask_function)
    if key is not None and key in _CHECKED:
        return
    n = 12
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
    try:
        got = torch.as_tensor(mask_function(torch.tensor(0), torch.tensor(0), q, kv)).expand(n, n)
    except Exception:  # noqa: BLE001 - an unreadable pattern is refused below
        got = None
    if got is not None:
        tril = kv <= q
        seen = int((got & tril)[-1].sum())  # keys the last query sees: the window, if any
        if bool(got.all()) or torch.equal(got, tril) or torch.equal(got, tril & (q - kv < seen)):
            if key is not None:
                _CHECKED.add(key)
            return
    name = getattr(mask_function, "__name__", type(mask_function).__name__)
    raise NotImplementedError(f"seqpar_hf shards causal, bidirectional and causal sliding-window attention; this model "
                              f"asked for another mask pattern ({name!r}: chunked, prefix or custom masks are not "
                              "supported)")


def sp_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
            **kwargs):
    """Mask function: no mask for the layers. Sequence-parallel attention takes padding, documents and
    windows from the forward's context (identical on every rank, so every rank makes the same decisions)."""
    if mask_function is not None:
        _check_mask_pattern(mask_function)
    return None


def sp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                 sliding_window=None, **kwargs):
    """Attention function: query [b, h, s_q/sp, d], key/value [b, h_kv, s_k/sp, d] -> [b, s_q/sp, h, d]."""
    site = getattr(module, _SITE, None)
    if site is None:
        raise RuntimeError(f"{type(module).__name__} has attn_implementation={ATTN_NAME!r} but was not patched by "
                           "seqpar_hf.patch_model (a model rebuilt from a patched config?); build it from the "
                           "original config, or patch the model itself")
    ctx = kwargs.get(CONTEXT_KWARG) or site.state.active
    if ctx is None:
        raise RuntimeError(
            f"seqpar_hf: the sequence-parallel attention of {site.name} ran outside a sharded forward of the patched "
            f"model: a submodule (the encoder, a decoder layer, ...) was called directly. Call the patched model or "
            f"its backbone, run the code inside `with seqpar_hf.sp_disabled(model):` (no SP, this rank's own data), "
            f"or call seqpar_hf.unpatch_model(model) first")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("output_attentions is not available under sequence parallelism")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{site.name}: attention soft-capping and sinks are not supported under sequence "
                                  "parallelism")
    causal = bool(module.is_causal if is_causal is None else is_causal)
    out = site.attend(ctx, query, key, value, causal, sliding_window, scaling, dropout)  # [b, h, s_q/sp, d]
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

    def __init__(self, state: "PatchState", name: str, q_side: str, kv_side: str):
        self.state, self.name, self.q_side, self.kv_side = state, name, q_side, kv_side

    def attend(self, ctx: ForwardContext, q, k, v, causal, window, scale, dropout):
        """q [b, h, s_q/sp, d], k/v [b, h_kv, s_k/sp, d] -> [b, h, s_q/sp, d]."""
        layout = ctx.layout
        spec = ctx.spec(self.q_side, self.kv_side, causal, window)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if layout.sizes.ring_size == 1:
            def inner(q, k, v, kv_for_q):
                return kernels.attention(q, k, v, spec, scale, dropout, kv_for_q, ctx.cache)
        else:
            if dropout > 0:
                raise NotImplementedError(f"ring attention does not support attention dropout (got {dropout}); "
                                          "set the model's attention_dropout to 0 or use mode='ulysses'")
            plan = ctx.ring_plan(spec, q.device)

            def inner(q, k, v, kv_for_q):
                return ring_attention(q, k, v, plan, scale, kv_for_q)
        if layout.ulysses_size == 1:
            rep = q.shape[1] // k.shape[1]
            return inner(q, k, v, None if rep == 1 else tuple(i // rep for i in range(q.shape[1])))
        return ulysses_attention(q, k, v, layout.ulysses_group, layout.ulysses_rank, inner)


class _Slot:
    """A language-model forward's request to the backbone: take this rank's shard of the outputs."""

    def __init__(self, checked: bool):
        self.checked, self.ctx = checked, None


class PatchState:
    def __init__(self, layout: ParallelLayout, family: ModelFamily, attn_implementation: str, check_inputs: bool,
                 tiled_loss: bool | str = "auto"):
        self.layout, self.family, self.attn_implementation = layout, family, attn_implementation
        self.check_inputs, self.tiled_loss = check_inputs, tiled_loss
        config = family.pretrained.config
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.keep_ids = any(p.kind == "m2m100" for p in family.positions)
        self.active: ForwardContext | None = None  # the sharded backbone forward running now (for hooks)
        self.last: ForwardContext | None = None  # the last sharded forward (gather_logits / gather_sequence)
        self.slot: _Slot | None = None
        self.plain_depth = 0  # > 0 while running without SP (generation, sp_disabled)
        self.detached = False  # set by unpatch_model: wrappers someone still holds become pass-through
        self.hooks = []
        self.replaced: list[tuple[object, str, bool, object]] = []  # (object, attribute, had one, previous value)
        self.layerdrop = LayerDropSync(family.layer_stacks)

    def __getstate__(self):  # deepcopy: a copy starts with no forward running
        return {**self.__dict__, "active": None, "last": None, "slot": None}

    @contextlib.contextmanager
    def without_sp(self):
        """Run the plain model (its original attention implementation) on this rank's data."""
        model = self.family.pretrained
        if self.plain_depth == 0:
            model.set_attn_implementation(self.attn_implementation)
        self.plain_depth += 1
        try:
            yield
        finally:
            self.plain_depth -= 1
            if self.plain_depth == 0:
                model.set_attn_implementation(ATTN_NAME)

    @contextlib.contextmanager
    def local_outputs(self, slot: _Slot):
        previous, self.slot = self.slot, slot
        try:
            yield slot
        finally:
            self.slot = previous


def _named(parameters, args, kwargs) -> dict:
    """Keyword arguments only, naming positional ones the way the wrapped forward does."""
    if args:
        kwargs = {**dict(zip(parameters, args)), **kwargs}
    return kwargs


def _incremental(kwargs) -> bool:
    return any(kwargs.get(k) is not None for k in _INCREMENTAL)


class _Wrapper:
    """Base of the instance-level wrappers: keeps the wrapped callable, its signature and its name."""

    def __init__(self, state: PatchState, original):
        self.state, self.original = state, original
        functools.update_wrapper(self, original)
        params = inspect.signature(original).parameters
        self.parameters = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())


class BackboneForward(_Wrapper):
    """The backbone's forward: shard the full batch, run the layers, gather (or keep) the outputs."""

    def __call__(self, *args, **kwargs):
        state = self.state
        if state.detached:
            return self.original(*args, **kwargs)
        kwargs = _named(self.parameters, args, kwargs)
        if state.plain_depth or _incremental(kwargs):
            with state.without_sp():  # incremental decoding: no SP, this rank's own data
                return self.original(**kwargs)
        slot, state.slot = state.slot, None  # a language-model forward's request, for this call only
        layout, family = state.layout, state.family
        if layout.enabled:
            _require_process_group(layout)
            if state.check_inputs and not (slot is not None and slot.checked):
                check_same_batch(kwargs, family.backbone.training, layout.sp_group, _device(kwargs, family.backbone))
        if kwargs.get("output_attentions"):
            raise NotImplementedError("output_attentions is not available under sequence parallelism")
        if kwargs.get("output_hidden_states") and layout.sizes.tp_size > 1:
            raise NotImplementedError("output_hidden_states is not available with tensor parallelism")
        return_dict = kwargs.pop("return_dict", None)
        shard = shard_seq2seq if family.kind == "seq2seq" else shard_causal
        ctx = shard(layout, kwargs, state.pad_id, local_outputs=slot is not None, keep_ids=state.keep_ids)
        if self.takes_kwargs:  # travels with the layers' kwargs (and with gradient checkpointing)
            kwargs[CONTEXT_KWARG] = ctx
        training = family.backbone.training
        device = ctx.positions["decoder"].device
        rng = per_rank_stream(layout.sp_rank, device) if training and layout.enabled else contextlib.nullcontext()
        previous, state.active = state.active, ctx
        try:
            with state.layerdrop.decide(training and layout.enabled), rng:
                out = self.original(**kwargs, return_dict=True)
        finally:
            state.active = previous
        state.last = ctx
        if slot is not None:
            slot.ctx = ctx
        out = _gather_outputs(out, ctx, everything=slot is None)
        return out if return_dict is not False else out.to_tuple()


_SEQUENCE_OUTPUTS = ("last_hidden_state", "hidden_states", "decoder_hidden_states", "encoder_last_hidden_state",
                     "encoder_hidden_states")


def _gather_outputs(out, ctx: ForwardContext, everything: bool):
    """Sequence-sharded outputs -> the full sequence. Under tensor parallelism, first the whole
    SP-local sequence on every TP rank (a TP rank holds a slice of it after the last norm). Router
    logits always (a load-balancing loss on top counts every token); hidden states unless the caller
    takes this rank's shard."""
    layout = ctx.layout
    group, scale = layout.sp_group, float(layout.sp_size)
    if layout.sizes.tp_size > 1:
        for key in ("last_hidden_state", "encoder_last_hidden_state"):
            if out.get(key) is not None:
                out[key] = tensor_parallel.gather_tp(out[key], layout.mesh["tp"])
    batch = out[0].shape[0]
    for key in list(out.keys()):
        value = out[key]
        plan = ctx.plan("encoder" if key.startswith("encoder_") else "decoder")
        if key == "router_logits" and value is not None:
            # per layer [b * s_loc, E] -> [b, s_loc, E] -> [b, S, E] -> [b * S, E]
            out[key] = tuple(gather_full(r.view(batch, -1, r.shape[-1]), plan, group, scale).flatten(0, 1)
                             for r in value)
        elif everything and key in _SEQUENCE_OUTPUTS and value is not None:
            if isinstance(value, tuple):
                out[key] = tuple(gather_full(t, plan, group, scale) for t in value)
            else:
                out[key] = gather_full(value, plan, group, scale)
    return out


class LMForward(_Wrapper):
    """The language model's forward: with labels, this rank's shard of the logits and the group's loss."""

    def __call__(self, *args, **kwargs):
        state = self.state
        if state.detached:
            return self.original(*args, **kwargs)
        kwargs = _named(self.parameters, args, kwargs)
        if state.plain_depth or _incremental(kwargs):
            with state.without_sp():
                return self.original(**kwargs)
        labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        label_smoothing = kwargs.pop("label_smoothing", 0.0)
        if labels is None and shift_labels is None:
            return self.original(**kwargs)  # nothing to compute here: what the unpatched model returns
        if kwargs.get("logits_to_keep", 0) not in (0, None):
            raise ValueError("logits_to_keep is not supported with labels under sequence parallelism")
        return_dict = kwargs.pop("return_dict", None)
        layout, family = state.layout, state.family
        model = family.pretrained
        if layout.enabled:
            _require_process_group(layout)
            if state.check_inputs:
                check_same_batch({**kwargs, "labels": labels, "shift_labels": shift_labels}, model.training,
                                 layout.sp_group, _device(kwargs, model))
        if family.kind == "seq2seq":
            targets = labels
            if kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None:
                kwargs["decoder_input_ids"] = decoder_inputs_from_labels(model, labels, kwargs.get("decoder_position_ids"))
        else:  # shift on the FULL sequence, so the token after a shard boundary keeps its label
            targets = shift_labels if shift_labels is not None else torch.cat(
                [labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
        kwargs["use_cache"] = False  # no cache under SP: its lengths would be local
        head = _TiledHead.make(state, model, targets) if model.training else None
        with state.local_outputs(_Slot(checked=True)) as slot, (head or contextlib.nullcontext()):
            out = self.original(**kwargs, return_dict=True)
        if slot.ctx is None:
            raise RuntimeError(f"seqpar_hf: {type(model).__name__}'s forward did not run its backbone "
                               f"({type(family.backbone).__name__}); cannot compute a sequence-parallel loss")
        if head is not None and head.hidden is None:
            raise RuntimeError(f"seqpar_hf: {type(model).__name__}'s forward did not call its output embeddings; "
                               "patch it with tiled_loss=False")
        device = head.hidden.device if head is not None else out.logits.device
        local_labels = slot.ctx.plan("decoder").pad_and_shard(targets.to(device), IGNORE_INDEX)
        if head is not None:  # no [tokens, vocab] logits: head + cross-entropy in checkpointed chunks
            token_sum = tiled_token_loss_sum(head.hidden, local_labels, head.logits, head.vocab_size, label_smoothing)
        else:
            token_sum = token_loss_sum(out.logits, local_labels, label_smoothing)
        loss = group_mean_loss(token_sum, local_labels, layout.sp_group, layout.sp_size, num_items)
        aux = out.get("aux_loss")
        if aux is not None:  # MoE load balancing, from the gathered router logits: same on every rank
            coef = getattr(model, "router_aux_loss_coef", None)
            loss = loss + (model.config.router_aux_loss_coef if coef is None else coef) * aux.to(loss.device)
        dropped = ("loss", "logits") if head is not None else ("loss",)  # tiled: there are no logits
        out = type(out)(loss=loss, **{k: v for k, v in out.items() if k not in dropped})
        return out if return_dict is not False else out.to_tuple()


class _TiledHead:
    """For one training forward: the LM head returns empty logits ([..., 0, V]) and keeps its input;
    `logits(h)` is the head and what the model's forward does after it, for the tiled loss."""

    def __init__(self, model, module):
        self.module, self.hidden = module, None
        self.vocab_size = int(module.weight.shape[0])
        self.forward = module.forward  # the head's own computation (LoRA included), without module hooks
        config = model.config
        self.bias = getattr(model, "final_logits_bias", None)  # Marian, BART, mBART, Pegasus
        self.softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3
        self.scale = getattr(model, "logit_scale", None)  # Cohere multiplies
        self.divide = getattr(config, "logits_scaling", None)  # Granite divides

    @classmethod
    def make(cls, state: PatchState, model, targets: torch.Tensor) -> "_TiledHead | None":
        setting = state.tiled_loss
        if setting is False or state.layout.sizes.tp_size > 1:
            return None  # under TP the head is a DTensor module whose hooks the capture would bypass
        module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if module is None or getattr(module, "weight", None) is None:
            return None
        if setting == "auto":
            rows, length = targets.shape[0], targets.shape[-1]
            local = -(-length // state.layout.sp_size)
            if rows * local * module.weight.shape[0] < TILED_LOSS_MIN_ELEMENTS:
                return None
        return cls(model, module)

    def __enter__(self):
        self.had = "forward" in self.module.__dict__
        self.module.forward = self._capture
        return self

    def __exit__(self, *exc):
        if self.had:
            self.module.forward = self.forward
        else:
            del self.module.forward

    def _capture(self, hidden):
        self.hidden = hidden
        return hidden.new_empty(*hidden.shape[:-2], 0, self.vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.forward(hidden)
        if self.bias is not None:
            logits = logits + self.bias.to(logits.device)[0]
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class GenerateWithoutSP(_Wrapper):
    """`generate` runs the plain model on this rank's own inputs (incremental decoding has no sequence to split)."""

    def __call__(self, *args, **kwargs):
        if self.state.detached:
            return self.original(*args, **kwargs)
        with self.state.without_sp():
            return self.original(*args, **kwargs)


def decoder_inputs_from_labels(model, labels: torch.Tensor, decoder_position_ids=None) -> torch.Tensor:
    """Decoder inputs from the FULL labels, as the model builds them (shifted right, -100 -> pad, the
    start token first). Packed rows start every pair's target with `decoder_start_token_id`."""
    config = model.config
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    start = config.decoder_start_token_id
    if decoder_position_ids is None and prepare is not None:
        return prepare(labels=labels)
    if start is None:
        raise ValueError(f"{type(model).__name__} has no decoder_start_token_id: pass decoder_input_ids with packed "
                         "rows (each pair's target starting with its start token)")
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    ids = labels.new_full(labels.shape, start)
    ids[:, 1:] = labels[:, :-1]
    ids = ids.masked_fill(ids == IGNORE_INDEX, pad)
    if decoder_position_ids is not None:
        ids = torch.where(decoder_position_ids.expand_as(ids) == 0, torch.full_like(ids, start), ids)
    return ids


# ---------------------------------------------------------------------------------------------
# public API


def _state_of(model) -> PatchState | None:
    for obj in (model, unwrap(model), getattr(unwrap(model), "base_model", None)):
        state = getattr(obj, _STATE, None) if obj is not None else None
        if state is not None and not state.detached:
            return state
    return None


def patch_model(model, layout: ParallelLayout, check_inputs: bool = True, lm_loss: bool = True,
                tiled_loss: bool | str = "auto"):
    """Make `model` (this instance) sequence-parallel over `layout`'s SP group and return it.

    `model` is a causal or encoder-decoder LM (or its backbone, or a PEFT model wrapping one). Every
    rank of an SP group must then pass the same, full batch; the model shards it along the sequence
    itself. With labels, `out.loss` is the loss of the group's full batch (the unpatched model's
    number) on every rank and `out.logits` is this rank's shard ([b, s_local, vocab], padding
    included; `gather_logits(model, out.logits)` returns the full logits). Without labels the outputs
    are the unpatched model's (full sequence). Gradients are complete once a data-parallel wrapper
    (DDP/FSDP/accelerate) averages them over the world. `check_inputs` verifies, with one tiny
    all-gather per forward, that the ranks of the group got the same batch, and raises on every rank
    otherwise. `lm_loss=False` leaves the language model's own forward alone (only the backbone is
    sharded, its outputs always gathered): for a model whose forward another library has replaced.
    `tiled_loss` (training with labels only): compute the LM head and cross-entropy over checkpointed
    chunks of the labelled tokens, never holding this rank's [tokens, vocab] logits; `out.logits` is
    then None. "auto": when those logits would have at least `TILED_LOSS_MIN_ELEMENTS` (2^26)
    elements; True: always; False: never. Evaluation never tiles (it returns logits).
    """
    state = _state_of(model)
    if state is not None:
        if state.layout is layout:
            return model
        raise ValueError(f"this model is already patched with {state.layout}; call seqpar_hf.unpatch_model(model) "
                         f"before patching it with {layout}")
    family = inspect_model(model)
    tp = layout.sizes.tp_size
    if tiled_loss not in (True, False, "auto"):
        raise ValueError(f"tiled_loss={tiled_loss!r}: use True, False or 'auto'")
    if tiled_loss is True and tp > 1:
        raise ValueError(f"tiled_loss=True with tp_size={tp}: the tiled loss does not work with a tensor-parallel LM "
                         "head (a DTensor module; its logits are gathered whole on every TP rank); use "
                         "tiled_loss='auto' (off under TP) or False")
    if tp > 1:
        tensor_parallel.check(family, layout)
    for site in family.attention:  # refuse head counts Ulysses cannot split (TP's share), before any forward
        split_heads(site.heads // tp, site.kv_heads // tp, layout.ulysses_size)
    _register()
    pretrained = family.pretrained
    attn_implementation = pretrained.config._attn_implementation
    _own_config(pretrained)
    state = PatchState(layout, family, attn_implementation, check_inputs, tiled_loss)
    for site in family.attention:
        setattr(site.module, _SITE, AttentionSite(state, site.name, site.q_side, site.kv_side))
    state.hooks = positions.install(state, family, state.pad_id)
    _replace(state, family.backbone, "forward", BackboneForward(state, family.backbone.forward))
    if family.has_lm_head and lm_loss:
        _replace(state, model, "forward", LMForward(state, model.forward))
        model.accepts_loss_kwargs = True  # the Trainer passes num_items_in_batch (its own attribute name)
    for obj in {id(o): o for o in (model, pretrained)}.values():
        if callable(getattr(obj, "generate", None)):
            _replace(state, obj, "generate", GenerateWithoutSP(state, obj.generate))
    for obj in {id(o): o for o in (model, pretrained, family.backbone)}.values():
        setattr(obj, _STATE, state)
    pretrained.set_attn_implementation(ATTN_NAME)
    if tp > 1:
        tensor_parallel.parallelize(family, layout)
    return model


def unpatch_model(model):
    """Undo `patch_model`: the instance runs the plain transformers code again. Only what
    `patch_model` added is removed: a wrapper that another library installed over ours stays, and
    ours inside it becomes a pass-through."""
    state = _state_of(model)
    if state is None:
        return model
    if state.layout.sizes.tp_size > 1:
        raise ValueError("a tensor-parallel model cannot be unpatched in place (its weights are sharded over the TP "
                         "group); save it with seqpar_hf.training.checkpoint.full_model_state_dict / the trainer's save_model and load the "
                         "checkpoint into a fresh model")
    family = state.family
    family.pretrained.set_attn_implementation(state.attn_implementation)
    for handle in state.hooks:
        handle.remove()
    state.layerdrop.remove()
    for site in family.attention:
        if hasattr(site.module, _SITE):
            delattr(site.module, _SITE)
    for obj, name, had, previous in reversed(state.replaced):
        current = obj.__dict__.get(name)
        if isinstance(current, _Wrapper) and current.state is state:
            if had:
                setattr(obj, name, previous)
            else:
                del obj.__dict__[name]
    if "accepts_loss_kwargs" in model.__dict__:
        del model.__dict__["accepts_loss_kwargs"]
    state.detached = True
    for obj in (model, family.pretrained, family.backbone):
        if getattr(obj, _STATE, None) is state:
            delattr(obj, _STATE)
    return model


def is_patched(model) -> bool:
    return _state_of(model) is not None


def sp_disabled(model):
    """Context manager: inside it, a patched model runs without SP on this rank's own data."""
    state = _state_of(model)
    return contextlib.nullcontext() if state is None else state.without_sp()


def gather_sequence(model, tensor: torch.Tensor, side: str = "decoder", dim: int = 1) -> torch.Tensor:
    """The full, unpadded sequence of an output of the last forward (e.g. logits [b, s_loc, V]), on
    every rank of the SP group; `side="encoder"` for encoder outputs. No gradient. Outputs that the
    forward already returned whole (no labels) are returned as they are."""
    state = _state_of(model)
    if state is None or state.last is None:
        return tensor
    ctx = state.last
    if side not in ctx.seqs:
        raise ValueError(f"no sharded {side!r} sequence in the last forward of this model")
    if not ctx.local_outputs and side == "decoder":
        return tensor
    plan = ctx.plan(side)
    return plan.unshard(all_gather_cat(tensor, ctx.layout.sp_group, dim), dim)


def gather_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """Full logits [b, s, V] from this rank's shard of the last forward's logits."""
    return gather_sequence(model, logits, "decoder")


def family_of(model) -> ModelFamily:
    """The SP-relevant structure of a patched model (its backbone, layer stacks, attention modules)."""
    state = _state_of(model)
    if state is None:
        raise ValueError("the model is not patched by seqpar_hf; call seqpar_hf.patch_model(model, layout) first")
    return state.family


def model_kind(model) -> str:
    """'seq2seq' or 'causal' for a patched model (which labels it shifts)."""
    state = _state_of(model)
    if state is None:
        raise ValueError("the model is not patched by seqpar_hf")
    return state.family.kind


# ---------------------------------------------------------------------------------------------
# internals


def _replace(state: PatchState, obj, name: str, value) -> None:
    state.replaced.append((obj, name, name in obj.__dict__, obj.__dict__.get(name)))
    setattr(obj, name, value)


def _device(kwargs: dict, module) -> torch.device:
    return next((v.device for v in kwargs.values() if isinstance(v, torch.Tensor)),
                next(module.parameters()).device)


def _require_process_group(layout: ParallelLayout) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"this model is patched for sequence parallelism ({layout}) but no process group is "
                           "initialised any more; call seqpar_hf.unpatch_model(model) to use it in one process")


def _own_config(model):
    """Give the model its own config object, so switching its attention does not touch another
    model built from the same config."""
    old = model.config
    new = copy.deepcopy(old)
    for module in model.modules():
        if getattr(module, "config", None) is old:
            module.config = new
