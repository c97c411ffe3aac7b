"""`model.generate(...)` on a patched model: the long side is sharded along the sequence, and every rank of
the SP group returns exactly the tokens the unpatched model returns for the full batch.

Every rank passes the same, full batch and the same arguments (as in training). transformers' own
`generate` runs unchanged on every rank, around:
- encoder-decoder models: the encoder, run here sharded (Ulysses / ring / hybrid, as in training); its
  outputs stay sharded, [b, S/sp, d] per rank, and are handed to `generate` as `encoder_outputs`, so each
  decoder layer's cross-attention computes and caches K/V of this rank's shard only;
- decoder-only models: a `SequenceShardedCache`; the prompt's forward runs sharded and fills each rank's
  shard of every layer's K/V, and only the last position's hidden state is sent to every rank.
Each decoding step is replicated (its new tokens, the decoder's self-attention over the short target, the
MLPs, the head): attention over the sharded side is computed per rank and merged across the group by
log-sum-exp (`decoding`, `attention.decode`). Beam search reorders the local shards.

Before any collective, what is not supported is found by name and the full prompt or source is validated
as a forward's (`validate`: ids, lengths, the position table); then ONE all-gather compares the call's
inputs, settings, sampling generator state and refusals across the group, and every rank raises if any
differ or if the call is refused. `with seqpar_hf.sp_disabled(model):` keeps the plain per-rank
generation (this rank's own inputs).
"""

from __future__ import annotations

import inspect

import torch
from transformers.modeling_outputs import BaseModelOutput

from ... import _compat
from ..forward import validate
from ..forward.context import CONTEXT_KWARG
from ..forward.forwards import Wrapper, require_process_group
from ..forward.inputs import shard_source
from ..forward.state import PatchState
from .decoding import DecodeSession
from .generation_check import check_same_generation
from .sharded_cache import SequenceShardedCache, unpatched_states, unpatched_windows

# generate's own parameters besides the model and generation-config keywords
_GENERATE_ARGUMENTS = (
    "inputs",
    "generation_config",
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
)
_MODES = ("greedy_search", "sample", "beam_search", "beam_sample")
_FIX = "; generate without SP (`with seqpar_hf.sp_disabled(model):`, each rank its own inputs) if you need it"


class GenerateSP(Wrapper):
    """The instance's `generate`: under SP (see the module docstring) when the layout shards sequences.
    `outer`: a wrapper's generate (PEFT) that reaches the model's own, which does the work."""

    def __init__(self, state: PatchState, original, outer: bool = False):
        super().__init__(state, original)
        self.outer = outer

    def __call__(self, *args, **kwargs):
        state = self.state
        if state.detached or self.outer or state.decoding is not None:
            return self.original(*args, **kwargs)
        # a layout property, the same on every rank: refused before any collective, with SP or without
        # (sp_size=1, sp_disabled), since the forwards of a TP model stay tensor-parallel either way
        if state.layout.sizes.tp_size > 1:
            raise NotImplementedError(
                f"generate on a tensor-parallel model (tp_size={state.layout.sizes.tp_size}): its weights are "
                "sharded over the TP ranks and its norms along the sequence, which one decoding step (one token) "
                "cannot be. Generate with a plain copy holding the full weights "
                "(seqpar_hf.training.generation.plain_copy(model), what SequenceParallelTrainer does)"
            )
        if state.plain_depth or not state.layout.enabled:
            with state.without_sp():
                return self.original(*args, **kwargs)
        return generate(state, self.original, self.named(args, kwargs))


@torch.no_grad()  # as transformers' generate: the encoder's sharded forward keeps no graph
def generate(state: PatchState, original, kwargs: dict):
    """Run `original` (transformers' generate, bound to the model) under SP with `kwargs` (named)."""
    model, layout = state.family.pretrained, state.layout
    require_process_group(layout)
    device = next(model.parameters()).device
    if kwargs.get("inputs") is not None and kwargs.get("input_ids") is None:
        kwargs["input_ids"] = kwargs.pop("inputs")
    error: Exception | None = None
    config, settings, windows = None, {}, None
    try:
        config, _ = _compat.prepare_generation_config(
            model, kwargs.get("generation_config"), {k: v for k, v in kwargs.items() if k not in _GENERATE_ARGUMENTS}
        )
        settings = {
            **{f"generation_config.{k}": v for k, v in config.to_dict().items()},
            **{k: v for k, v in kwargs.items() if k != "generation_config" and not isinstance(v, torch.Tensor)},
        }
        reason = refusal(state, kwargs, config)
        if reason is not None:
            error = NotImplementedError(f"generate under sequence parallelism: {reason}{_FIX}")
        else:
            _validate(state, kwargs, device)
            if state.family.kind != "seq2seq":
                windows = unpatched_windows(model)
    except Exception as exc:  # noqa: BLE001 - an argument transformers rejects: every rank must still reach the check
        error = exc
    rng = _rng_state(device) if config is not None and config.do_sample else None
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    if state.check_inputs:  # patch_model(..., check_inputs=False) turns it off, as for forwards
        check_same_generation(
            state,
            tensors,
            settings,
            rng,
            None if error is None else str(error),
            model.training,
            layout.sp_group,
            device,
        )
    if error is not None:
        raise error
    assert config is not None  # made above, or an error was raised
    session = DecodeSession(layout)
    call = dict(kwargs)
    with state.generating(session):
        if state.family.kind == "seq2seq":
            call["encoder_outputs"], session.source_plan = _encode(state, call, device)
        else:
            states = unpatched_states(model)[0] if state.family.mixers else {}
            session.cache = SequenceShardedCache(layout.sp_size, layout.sp_rank, windows, states)
            call[_cache_argument(model)] = session.cache
        if config.cache_implementation is not None:  # "dynamic" (checked): the cache above replaces it
            call["cache_implementation"] = None
        return original(**call)


def refusal(state: PatchState, kwargs: dict, config) -> str | None:
    """Why this `generate` call cannot run under SP (None: it can), decided on this rank with no collective."""
    model = state.family.pretrained
    unindexed = _unindexed(state)
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    mode = getattr(mode, "value", mode)
    checks = [
        (
            getattr(model, "main_input_name", "input_ids") != "input_ids",
            f"{type(model).__name__} generates from {model.main_input_name!r}; only token ids are sharded",
        ),
        (
            kwargs.get("inputs_embeds") is not None or kwargs.get("decoder_inputs_embeds") is not None,
            "inputs_embeds are not supported; pass input_ids",
        ),
        (kwargs.get("input_ids") is None, "pass the prompt (or source) as input_ids"),
        (
            model.training,
            "the model is in training mode (dropout would draw different masks on the ranks); call model.eval() first",
        ),
        (
            mode not in _MODES or config.dola_layers is not None,
            f"generation mode {mode!r} (assisted decoding, prompt lookup, contrastive search, DoLa, group or "
            f"constrained beam search) is not supported; greedy, sampling and beam search are",
        ),
        (kwargs.get("custom_generate") is not None, "custom_generate is not supported"),
        (
            state.family.kind == "causal" and bool(unindexed),
            f"attention module {unindexed[0] if unindexed else ''} has no layer index of its own (a block shared "
            "by several layers, as Zamba's), by which the sequence-sharded cache keeps each layer's keys",
        ),
        (
            bool(state.family.mixers) and not _default_cache(model),
            f"{type(model).__name__} keeps its token mixers' states ({', '.join(_kinds(state))}) in a cache of its "
            "own, which the sequence-sharded cache cannot stand in for",
        ),
        (
            bool(state.family.mixers) and bool(unpatched_states(model)[1]),
            f"{type(model).__name__} caches a token mixer's states ({', '.join(_kinds(state))}) and attention keys "
            f"in the same layers ({unpatched_states(model)[1][:4]}), which the sequence-sharded cache does not hold "
            "yet; generate inside seqpar_hf.sp_disabled(model) (one process's generation on this rank's data)",
        ),
        (
            config.cache_implementation not in (None, "dynamic"),
            f"cache_implementation={config.cache_implementation!r} (static, offloaded, quantized or compiled caches) "
            "is not supported; the KV cache is sharded along the sequence by seqpar_hf",
        ),
        (
            any(kwargs.get(k) is not None for k in ("cache", "past_key_values")),
            "a cache passed to generate is not supported (the cache is made sequence-sharded here)",
        ),
        (config.use_cache is False, "use_cache=False is not supported (decoding steps read the sharded cache)"),
        (bool(config.output_attentions), "output_attentions is not available under sequence parallelism"),
        (
            bool(config.output_hidden_states),
            "output_hidden_states is not supported (hidden states stay sharded; "
            "the prompt's forward returns its last position only)",
        ),
        (config.prefill_chunk_size is not None, "prefill_chunk_size is not supported (the prompt is sharded instead)"),
        (bool(config.token_healing), "token_healing is not supported"),
        (
            config.guidance_scale not in (None, 1) or kwargs.get("negative_prompt_ids") is not None,
            "classifier-free guidance (guidance_scale, negative_prompt_ids) is not supported",
        ),
        (
            kwargs.get("position_ids") is not None or kwargs.get("decoder_position_ids") is not None,
            "position_ids are not supported (packed prompts): pass left-padded rows with an attention_mask",
        ),
        (
            kwargs.get("encoder_outputs") is not None,
            "encoder_outputs are not supported (the encoder runs sharded here); pass input_ids",
        ),
        (
            isinstance(kwargs.get("attention_mask"), torch.Tensor) and kwargs["attention_mask"].dim() != 2,
            "attention_mask must be 2D [batch, length]",
        ),
    ]
    return next((why for failed, why in checks if failed), None)


def _validate(state: PatchState, kwargs: dict, device) -> None:
    """The forward's validation (`validate`) of the full prompt or source, here where every rank still
    reaches the check: sharded, an id past the vocabulary or a source past the position table would fail
    on the rank that holds it only, while the others wait in a collective."""
    # images and other inputs: taken where a vision tower runs before the text model (family.front), else refused
    validate.check_unsharded(state.family, kwargs, outer=True)
    inputs = {k: kwargs.get(k) for k in ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")}
    values = validate.extremes(state.family.kind, inputs, None, None, device).tolist()  # one host sync
    validate.check(state.family, inputs, None, None, values)


def _rng_state(device: torch.device) -> torch.Tensor:
    """The generator(s) sampling draws from on `device` (identical on every rank, or the ranks diverge)."""
    state = torch.get_rng_state()
    if device.type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(device)])
    return state


def _default_cache(model) -> bool:
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    return supports is None or bool(supports())


def _unindexed(state: PatchState) -> list[str]:
    sites = state.family.attention
    return [site.name for site in sites if not isinstance(getattr(site.module, "layer_idx", None), int)]


def _kinds(state: PatchState) -> list[str]:
    backbone = state.family.backbone
    return sorted({type(backbone.get_submodule(name)).__name__ for name in state.family.mixers})


def _cache_argument(model) -> str:
    """transformers >= 5.2x names the cache `cache`; earlier 5.x `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _encode(state: PatchState, kwargs: dict, device):
    """Run the encoder sharded; return (its outputs, [b, S_pad / sp, d] on this rank, the source plan)."""
    encoder = state.family.backbone.get_encoder()
    mask = kwargs.get("attention_mask")
    inputs = {"input_ids": kwargs["input_ids"].to(device), "attention_mask": None if mask is None else mask.to(device)}
    ctx = shard_source(state.layout, inputs, state.pad_id, keep_ids=state.keep_ids)
    params = inspect.signature(encoder.forward).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in params):  # travels to the layers' attention
        inputs[CONTEXT_KWARG] = ctx
    with state.running(ctx):
        out = encoder(**inputs, return_dict=True)
    # the encoder's own output type (its other fields None: per-rank shards no caller may read, as Switch's
    # router logits), so that a model reading such a field of its encoder_outputs finds it
    kind = type(out) if "last_hidden_state" in getattr(type(out), "__dataclass_fields__", {}) else BaseModelOutput
    return kind(last_hidden_state=out.last_hidden_state), ctx.plan("encoder")
