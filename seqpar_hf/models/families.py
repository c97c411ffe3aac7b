"""Which transformers models can be sequence-parallel, decided by what their code does, never by a list.

`inspect_model` checks the structure first (relative position biases, ALiBi, soft-capping, sinks and
chunked attention in the config; position modules that cannot be looked up by position id), then proves
the rest with a dry run of the model (models/proof.py, probe.py): the backbone its forward runs, every
attention call through transformers' `AttentionInterface` (sides, pattern, keywords), its default
positions, its loss and LM head, and (when the layout splits the sequence) that nothing but attention
mixes tokens. Causal LMs and encoder-decoder LMs are patched as a whole; their backbones also on their
own. Every refusal names the module or value, why, and the fix.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn

from .. import _compat

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass
class AttentionModule:
    name: str
    module: nn.Module
    q_side: str | None  # "encoder" or "decoder": which sequence the queries come from (None: token-local)
    kv_side: str | None
    heads: int
    kv_heads: int
    pattern: tuple | None = None  # (causal, window) the unpatched model computes, proven at patch time


@dataclass
class PositionModule:
    side: str
    module: nn.Module
    kind: str  # "rotary": computed on the full positions, then sliced; "ids": looked up by position_ids;
    #            "m2m100": sinusoidal table indexed by padding-aware positions


@dataclass
class ModelFamily:
    kind: str  # "seq2seq" or "causal"
    pretrained: nn.Module  # the transformers model (a PeftModel's base model, or the model itself)
    backbone: nn.Module  # the module that turns token ids into hidden states: where sequences are sharded
    has_lm_head: bool  # pretrained computes logits (and a loss) on top of the backbone
    attention: list[AttentionModule]
    positions: list[PositionModule] = field(default_factory=list)
    layer_stacks: list[nn.Module] = field(default_factory=list)  # modules with `layers` (and maybe `layerdrop`)
    local_attention: list[AttentionModule] = field(default_factory=list)  # token-local calls, run as they are
    default_positions: str = "arange"  # models/default_positions.py: the positions the backbone makes itself
    head_post: object = None  # models/head.Post reproducing the model's logits after its head (None: do not tile)
    layer_inputs: dict = field(default_factory=dict)  # layer path -> its per-token inputs (models/tp_checks.py)
    inplace_outputs: set = field(default_factory=set)  # nn.Linear paths whose outputs the model writes in place
    dry_run_seconds: float = 0.0


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT (and similar) wrappers."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _refuse(name: str, why: str, fix: str):
    raise ValueError(f"seqpar_hf cannot shard {name}: {why}. {fix}")


def _check_structure(model: nn.Module, config, name: str) -> None:
    if any(hasattr(m, "relative_attention_bias") for m in model.modules()) or \
            getattr(config, "relative_attention_num_buckets", None) is not None:
        _refuse(name, "its attention adds a relative position bias computed from the whole query-key distance "
                      "matrix, which no rank holds under sequence parallelism",
                "Models with rotary or absolute positions (Llama, Qwen, Mistral, Marian, BART, M2M100, ...) work")
    if getattr(config, "alibi", False) or \
            getattr(config, "position_embedding_type", "absolute") not in ("absolute", "rope", None):
        _refuse(name, "its attention uses ALiBi or relative-key position biases that span the whole sequence",
                "Use a model with rotary or absolute positions")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        _refuse(name, f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping}) has no "
                      "sharded kernel here", "Set config.attn_logit_softcapping = None before patching (Gemma 2 "
                                              "trains well without it), or train without sequence parallelism")
    if getattr(config, "attention_chunk_size", None):
        _refuse(name, f"chunked attention (attention_chunk_size={config.attention_chunk_size}) is not supported",
                "Set config.attention_chunk_size = None to train with full attention")
    if any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in model.modules()):
        _refuse(name, "its attention has learned sinks, which the sharded kernels here do not take",
                "Train it without sequence parallelism")


def _positions(backbone: nn.Module, kind: str, name: str, encoder) -> list[PositionModule]:
    found = []
    for path, module in backbone.named_modules():
        side = "encoder" if encoder is not None and _inside(module, encoder) else "decoder"
        cls = type(module).__name__
        if cls.endswith("RotaryEmbedding"):
            found.append(PositionModule(side, module, "rotary"))
        elif path.endswith("embed_positions"):
            params = inspect.signature(module.forward).parameters
            if "position_ids" in params:
                found.append(PositionModule(side, module, "ids"))
            elif cls.startswith(("M2M100", "NllbMoe")) and hasattr(module, "weights"):
                found.append(PositionModule(side, module, "m2m100"))
            else:
                _refuse(name, f"its position embedding {path} ({cls}) does not take position ids, so shards "
                              "cannot be given their global positions", "Use a model whose positions are rotary or "
                                                                         "looked up by position id")
    return found


def _inside(module: nn.Module, ancestor: nn.Module) -> bool:
    return any(m is module for m in ancestor.modules())


def pad_token_id(config) -> int:
    """The pad id: the config's, else its text config's (composite vision / audio + text configs keep it
    there), else 0."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
    for c in (config, text):
        value = getattr(c, "pad_token_id", None) if c is not None else None
        if isinstance(value, int):
            return value
    return 0


def inspect_model(model: nn.Module, split: bool = False, ring: bool = False) -> ModelFamily:
    """Find the SP-relevant parts of `model`, or raise a ValueError that names what is wrong and the fix.
    Structure first, then a dry run (models/probe.py) that finds the backbone and every attention call;
    with `split` (the layout splits the sequence) it also proves that every module computes on a shard
    what it computes on the full sequence (`ring`: shards in the ring's zigzag order)."""
    pretrained = unwrap(model)
    config = getattr(pretrained, "config", None)
    name = type(pretrained).__name__
    if config is None:
        raise ValueError(f"seqpar_hf patches transformers models (PreTrainedModel); {name} has no config")
    attn = _compat.attn_implementation(config)
    if attn not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"{name} uses attn_implementation={attn!r}; seqpar_hf replaces one of "
                         f"{', '.join(ATTENTION_IMPLEMENTATIONS)} (load the model with attn_implementation='sdpa')")
    _check_structure(pretrained, config, name)
    guess = getattr(pretrained, "base_model", pretrained)
    if guess is not pretrained and pretrained.get_output_embeddings() is None:
        raise ValueError(f"seqpar_hf patches language models (e.g. LlamaForCausalLM, MarianMTModel) or their "
                         f"backbones (LlamaModel); {name} has a head that is not a language-model head")
    kind = "seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"
    if kind == "causal" and not getattr(config, "is_causal", True):
        raise ValueError(f"{name} is a bidirectional (encoder-only) model; seqpar_hf shards causal LMs and "
                         "encoder-decoder models")
    from . import proof  # the dry run imports the forward machinery, which imports this module
    try:
        return proof.prove(pretrained, kind, pad_token_id(config), attn, guess, split, ring)
    except proof.Refusal as refusal:
        raise ValueError(refusal.message(pretrained)) from None


def structure(pretrained, kind: str, backbone) -> tuple[list[PositionModule], list[nn.Module]]:
    """The position modules and layer stacks of the backbone the dry run found; refuses position modules
    that cannot get global positions."""
    encoder = backbone.get_encoder() if kind == "seq2seq" and hasattr(backbone, "get_encoder") else None
    positions = _positions(backbone, kind, type(pretrained).__name__, encoder)
    stacks = [m for m in backbone.modules() if hasattr(m, "layers") and isinstance(m.layers, nn.ModuleList)]
    return positions, stacks
