"""The instance forwards a patched model runs: where sequences are sharded and the loss is computed.

- `BackboneForward` (the backbone: `model.base_model`, e.g. LlamaModel, MarianModel) is the level every
  entry point passes through: the model's own forward, PEFT wrappers, TRL's fused LM head (which calls
  the backbone directly), a deep copy. It shards its full inputs, builds the forward's context, runs the
  layers, and gathers its outputs back to the full sequence, so whatever code runs on top computes what
  it computes on the unpatched model (at the cost of running that head on the full sequence).
- `LMForward` (the language model's own forward), given labels, asks the backbone for this rank's shard
  instead and computes the loss over the SP group: logits stay [b, s/sp, vocab] per rank. It shards its
  labels with the plan it knows the backbone uses (`inputs.shard_plan` of what it passes down): the data
  flows one way, the backbone never reports back. Without labels it returns what the unpatched model does.
While `generate` runs under SP (`models.generation`), a decoder-only model's first forward (the prompt)
is sharded like any other and returns only its last position; every later forward is a decoding step
that shards nothing (`models.generation.decoding`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.distributed as dist

from ...attention.mask_patterns import check_mask_pattern
from ...parallel import announce
from ...parallel.comm import gather_sequence as gather_full
from ...parallel.layout import ParallelLayout
from ..tp import tensor_parallel
from . import front_masks
from . import labels as labels_
from .checks import check_forward
from .context import CONTEXT_KWARG, ForwardContext, carry
from .head import TiledHead
from .inputs import FLASH_KWARGS, shard_causal, shard_plan, shard_seq2seq
from .loss import IGNORE_INDEX, group_mean_loss, tiled_token_loss_sum, token_loss_sum
from .rng import per_rank_stream
from .state import PatchState, Request
from .validate import check_unsharded

_INCREMENTAL = ("cache", "past_key_values", "encoder_outputs")
_SEQUENCE_OUTPUTS = (
    "logits",  # a model that is its own backbone (T5: its stacks and head in one forward)
    "last_hidden_state",
    "hidden_states",
    "decoder_hidden_states",
    "encoder_last_hidden_state",
    "encoder_hidden_states",
)


class Wrapper:
    """Base of the instance-level wrappers: keeps the wrapped callable, its signature and its name."""

    def __init__(self, state: PatchState, original):
        self.state, self.original = state, original
        # not its __dict__: a wrapper over a wrapper (the LM forward over the backbone's, when the model is its own
        # backbone) would take the inner one's state and original
        functools.update_wrapper(self, original, updated=())  # type: ignore[arg-type]  # subclasses are callables
        params = inspect.signature(original).parameters
        self.parameters = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())

    def named(self, args, kwargs) -> dict:
        """Keyword arguments only, naming positional ones the way the wrapped forward does."""
        return {**dict(zip(self.parameters, args)), **kwargs} if args else kwargs


def _incremental(kwargs) -> bool:
    return any(kwargs.get(k) is not None for k in _INCREMENTAL)


def _device(kwargs: dict, module) -> torch.device:
    return next((v.device for v in kwargs.values() if isinstance(v, torch.Tensor)), next(module.parameters()).device)


def require_process_group(layout: ParallelLayout) -> None:
    """Raise, naming the fix, when the process group a patched model runs on is gone."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"this model is patched for sequence parallelism ({layout}) but no process group is "
            "initialised any more; call seqpar_hf.unpatch_model(model) to use it in one process"
        )


class BackboneForward(Wrapper):
    """The backbone's forward: shard the full batch, run the layers, gather (or keep) the outputs."""

    announced = False  # the first sharded forward's lengths are logged once (parallel/announce.py)

    def __call__(self, *args, **kwargs):
        state = self.state
        if state.detached:
            return self.original(*args, **kwargs)
        kwargs = self.named(args, kwargs)
        session = state.decoding
        front = front_masks.prepared(kwargs.get("attention_mask"))  # masks a front prepared, deferred
        if state.plain_depth or (_incremental(kwargs) and session is None):
            # incremental decoding outside generate (or a cache its caller made: Idefics3's eval forward): no
            # SP, this rank's own data; its outputs are whole (`gather_logits` returns them as they are)
            state.outputs = None
            if front:
                kwargs["attention_mask"] = front_masks.build(kwargs["attention_mask"], state.attn_implementation)
            with state.without_sp():
                return self.original(**kwargs)
        if session is not None and not session.prefill_pending():
            return self._decoding_step(session, kwargs)
        blocks = documents = None
        if front and state.family.kind == "seq2seq":
            raise NotImplementedError("seqpar_hf: an encoder-decoder backbone handed masks prepared before it")
        if front:  # the padding mask, the blocks that see each other both ways (Gemma 3's images), documents
            kwargs["attention_mask"], blocks, documents = front_masks.take(kwargs["attention_mask"], check_mask_pattern)
        request = state.take_request()  # a language-model forward's, for this call only
        layout, family = state.layout, state.family
        if layout.replica_size > 1:
            require_process_group(layout)
            if not (request is not None and request.checked):  # fingerprint, then the full batch's validation
                # generate compared its inputs across the group already: the prompt's forward validates only
                check_forward(
                    state, kwargs, family.backbone.training, _device(kwargs, family.backbone), compare=session is None
                )
        if family.front:  # a multimodal model's text model: what its front hands it (checked before, if not)
            check_unsharded(family, kwargs)
        if kwargs.get("output_attentions"):
            raise NotImplementedError("output_attentions is not available under sequence parallelism")
        if state.offload_layers is not None and state.offload_layers.problem:  # after the ranks compared settings
            raise ValueError(state.offload_layers.problem)
        if kwargs.get("output_hidden_states") and layout.sizes.tp_size > 1:
            raise NotImplementedError("output_hidden_states is not available with tensor parallelism")
        if family.mixers and any(kwargs.get(k) is not None for k in FLASH_KWARGS[:4]):
            kinds = sorted({type(family.backbone.get_submodule(n)).__name__ for n in family.mixers})
            raise NotImplementedError(
                f"cu_seq_lens_q / max_length_q with token mixers outside attention ({', '.join(kinds)}): their "
                "kernels may reset their state at each document where they read cu_seqlens (flash-linear-attention, "
                "mamba-ssm), which the mixers run under SP are not given. Pass restarting position_ids alone "
                "(DataCollatorWithFlattening(return_flash_attn_kwargs=False)), as the unpatched model then runs"
            )
        return_dict = kwargs.pop("return_dict", None)
        shard = shard_seq2seq if family.kind == "seq2seq" else shard_causal
        ctx = shard(
            layout,
            kwargs,
            state.pad_id,
            local_outputs=request is not None,
            keep_ids=state.keep_ids,
            default_positions=state.default_positions,
            packed=family.packed_rows,
            **({"blocks": blocks, "documents": documents, "front": True} if front else {}),
            use_cache=request.use_cache
            if request is not None
            else session is None and _use_cache(kwargs, family.backbone),
        )
        if not self.announced:
            self.announced = True
            announce.first_forward(layout, {side: seq.plan for side, seq in ctx.seqs.items()})
        if self.takes_kwargs:  # travels with the layers' kwargs (and with gradient checkpointing)
            kwargs[CONTEXT_KWARG] = ctx
        carry(kwargs, ctx)  # and on the shard's mask, for layers given no keyword arguments but it (Mamba)
        training = family.backbone.training
        device = ctx.positions["decoder"].device
        rng = per_rank_stream(layout.sp_rank, device) if training and layout.enabled else contextlib.nullcontext()
        if kwargs.get("logits_to_keep") is not None and isinstance(kwargs["logits_to_keep"], int):
            # a backbone that slices its own positions to the last ones (Gemma 4's KV-shared layers) would
            # keep each shard's last tokens: it computes all of them; the head slices the gathered outputs
            kwargs["logits_to_keep"] = 0
        if session is not None:
            session.begin_prefill(ctx)  # the attention modules store their local K/V in the sharded cache
        try:
            with state.running(ctx), state.layerdrop.decide(training and layout.enabled), rng:
                out = self.original(**kwargs, return_dict=True)
        finally:
            if session is not None:
                session.end_prefill()
        if request is None:
            state.outputs = None  # returned whole
        out = _gather_outputs(out, ctx, everything=request is None, last_only=session is not None)
        return out if return_dict is not False else out.to_tuple()

    def _decoding_step(self, session, kwargs):
        """A decoding step of generation under SP: the step's tokens are replicated, nothing is sharded."""
        step = session.step(kwargs)
        if self.takes_kwargs:
            kwargs[CONTEXT_KWARG] = step
        with self.state.stepping(step):
            return self.original(**kwargs)


def _use_cache(kwargs: dict, module) -> bool:
    """Whether the caller's forward would build a cache: its keyword, else the config's default."""
    given = kwargs.get("use_cache")
    if given is None:
        config = getattr(module, "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        given = getattr(text, "use_cache", False)
    return bool(given)


def _gather_outputs(out, ctx: ForwardContext, everything: bool, last_only: bool = False):
    """Sequence-sharded outputs -> the full sequence. Under tensor parallelism, first the whole
    SP-local sequence on every TP rank (a TP rank holds a slice of it after the last norm). Router
    logits always (a load-balancing loss on top counts every token); hidden states unless the caller
    takes this rank's shard. `last_only` (the prompt's forward in generation): the last hidden state
    of the last position only, [b, 1, d], which is all the next token needs."""
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
        if last_only and key == "last_hidden_state":
            out[key] = _last_position(value, plan, group)
        elif key == "router_logits" and value is not None:
            # per layer [b * s_loc, E] -> [b, s_loc, E] -> [b, S, E] -> [b * S, E]
            out[key] = tuple(
                gather_full(r.view(batch, -1, r.shape[-1]), plan, group, scale).flatten(0, 1) for r in value
            )
        elif everything and key in _SEQUENCE_OUTPUTS and value is not None:
            if isinstance(value, tuple):
                out[key] = tuple(gather_full(t, plan, group, scale) for t in value)
            else:
                out[key] = gather_full(value, plan, group, scale)
    return out


def _last_position(x: torch.Tensor, plan, group) -> torch.Tensor:
    """[b, s_loc, d] shards -> [b, 1, d]: the sequence's last real position, sent by the rank holding it."""
    last = plan.length - 1
    owner = next(r for r in range(plan.sp_size) if bool((plan.global_index(r) == last).any()))
    index = int((plan.global_index(owner) == last).nonzero()[0])
    out = x[:, index : index + 1].contiguous() if owner == plan.sp_rank else x.new_zeros(x.shape[0], 1, *x.shape[2:])
    if group is not None:
        dist.broadcast(out, group=group, group_src=owner)
    return out


class LMForward(Wrapper):
    """The language model's forward: with labels, this rank's shard of the logits and the group's loss."""

    def __call__(self, *args, **kwargs):
        state = self.state
        if state.detached:
            return self.original(*args, **kwargs)
        kwargs = self.named(args, kwargs)
        if state.plain_depth or (_incremental(kwargs) and state.decoding is None):
            with state.without_sp():
                return self.original(**kwargs)
        labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        label_smoothing = kwargs.pop("label_smoothing", 0.0)
        if labels is None and shift_labels is None:
            return self.original(**kwargs)  # nothing to compute here: what the unpatched model returns
        layout, family = state.layout, state.family
        model = family.pretrained
        if layout.replica_size > 1:  # before any error of this rank alone: fingerprint, then validation
            require_process_group(layout)
            check_forward(
                state,
                kwargs,
                model.training,
                _device(kwargs, model),
                labels,
                shift_labels,
                num_items,
                label_smoothing,
                lm_loss=True,
            )
        if kwargs.get("logits_to_keep", 0) not in (0, None):
            raise ValueError("logits_to_keep is not supported with labels under sequence parallelism")
        return_dict = kwargs.pop("return_dict", None)
        targets = labels_.targets(family.kind, labels, shift_labels)  # on the full sequence
        if (
            family.kind == "seq2seq"
            and kwargs.get("decoder_input_ids") is None
            and kwargs.get("decoder_inputs_embeds") is None
        ):
            if family.decoder_ids == "refuse":
                raise ValueError(
                    f"{type(model).__name__} builds its decoder inputs from labels in a way seqpar_hf does not "
                    "reproduce (seen at patch time): pass decoder_input_ids with the labels"
                )
            ids = family.decoder_ids if isinstance(family.decoder_ids, tuple) else None
            kwargs["decoder_input_ids"] = labels_.decoder_inputs(model, labels, kwargs.get("decoder_position_ids"), ids)
        use_cache = _use_cache(kwargs, model)
        kwargs["use_cache"] = False  # no cache under SP: its lengths would be local
        plans = _output_plans(family.kind, layout, kwargs)  # the plans the backbone will use
        head = TiledHead.make(state, model, targets) if model.training else None
        with state.handing(Request(checked=True, use_cache=use_cache)), head or contextlib.nullcontext():
            out = self.original(**kwargs, return_dict=True)
            bypassed = state.request is not None  # the backbone forward takes the request
        if bypassed:
            raise RuntimeError(
                f"seqpar_hf: {type(model).__name__}'s forward did not run its backbone "
                f"({type(family.backbone).__name__}); cannot compute a sequence-parallel loss"
            )
        if head is not None and head.hidden is None:
            raise RuntimeError(
                f"seqpar_hf: {type(model).__name__}'s forward did not call its output embeddings; "
                "patch it with tiled_loss=False"
            )
        state.outputs = plans
        device = head.hidden.device if head is not None else out.logits.device
        local_labels = plans["decoder"].pad_and_shard(targets.to(device), IGNORE_INDEX)
        if head is not None:  # no [tokens, vocab] logits: head + cross-entropy in checkpointed chunks
            token_sum = tiled_token_loss_sum(
                head.hidden, local_labels, head.logits, head.vocab_size, label_smoothing, head.chunk_elements
            )
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


def _length(kwargs: dict, ids: str, embeds: str) -> int | None:
    x = kwargs.get(ids) if kwargs.get(ids) is not None else kwargs.get(embeds)
    return None if x is None else x.shape[1]


def _output_plans(kind: str, layout: ParallelLayout, kwargs: dict) -> dict:
    """The shard plans of the sequences the backbone will shard, from the inputs passed down to it."""
    sides = (
        {"decoder": ("decoder_input_ids", "decoder_inputs_embeds"), "encoder": ("input_ids", "inputs_embeds")}
        if kind == "seq2seq"
        else {"decoder": ("input_ids", "inputs_embeds")}
    )
    lengths = {side: _length(kwargs, *keys) for side, keys in sides.items()}
    return {side: shard_plan(layout, n, causal=side == "decoder") for side, n in lengths.items() if n is not None}
