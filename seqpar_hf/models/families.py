"""Which transformers models can be sequence-parallel, decided by structure rather than by a list.

A model is patched when its attention layers go through transformers' `AttentionInterface` with
[b, h, s, d] q/k/v, and its positions are rotary (full or partial, any `rope_type`), absolute
(learned or sinusoidal, looked up by position id) or none. Causal LMs and encoder-decoder LMs are
patched as a whole; their backbone (`model.base_model`) also on its own.

Refused, with the structural reason and the fix: relative position biases (T5 family) and ALiBi,
whose bias spans the whole relative-distance matrix; attention logit soft-capping and attention
sinks (no sharded kernel for them here); chunked attention; absolute position embeddings that are
not looked up by position id.
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
    q_side: str  # "encoder" or "decoder": which sequence the queries come from
    kv_side: str
    heads: int
    kv_heads: int


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


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT (and similar) wrappers."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _refuse(name: str, why: str, fix: str):
    raise ValueError(f"seqpar_hf cannot shard {name}: {why}. {fix}")


def _uses_attention_interface(module: nn.Module) -> bool:
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def _is_attention(path: str, module: nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("Attention") and hasattr(module, "is_causal") and hasattr(module, "config")


def _head_counts(module: nn.Module) -> tuple[int, int]:
    config = module.config
    heads = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None)
    kv = getattr(module, "num_key_value_heads", None)
    if kv is None and getattr(module, "num_key_value_groups", None):
        kv = heads // module.num_key_value_groups
    return int(heads), int(kv or getattr(config, "num_key_value_heads", None) or heads)


def _check_structure(model: nn.Module, config, name: str) -> None:
    if any(hasattr(m, "relative_attention_bias") for m in model.modules()) or \
            getattr(config, "relative_attention_num_buckets", None) is not None:
        _refuse(name, "its attention adds a relative position bias computed from the whole query-key distance "
                      "matrix, which no rank holds under sequence parallelism",
                "Models with rotary or absolute positions (Llama, Qwen, Mistral, Marian, BART, M2M100, ...) work")
    if getattr(config, "alibi", False) or getattr(config, "model_type", None) in ("bloom", "mpt") or \
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


def inspect_model(model: nn.Module) -> ModelFamily:
    """Find the SP-relevant parts of `model`, or raise a ValueError that names what is wrong and the fix."""
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

    backbone = getattr(pretrained, "base_model", pretrained)
    has_lm_head = backbone is not pretrained
    if has_lm_head and pretrained.get_output_embeddings() is None:
        raise ValueError(f"seqpar_hf patches language models (e.g. LlamaForCausalLM, MarianMTModel) or their "
                         f"backbones (LlamaModel); {name} has a head that is not a language-model head")
    kind = "seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"
    if kind == "causal" and not getattr(config, "is_causal", True):
        raise ValueError(f"{name} is a bidirectional (encoder-only) model; seqpar_hf shards causal LMs and "
                         "encoder-decoder models")
    encoder = backbone.get_encoder() if kind == "seq2seq" else None

    attention = []
    for path, module in backbone.named_modules():
        if not _is_attention(path, module):
            continue
        if not _uses_attention_interface(module):
            _refuse(name, f"its attention {path} ({type(module).__name__}) does not go through transformers' "
                          "AttentionInterface", "Use a model whose attention does (most models in transformers 5)")
        if kind == "causal":
            q_side = kv_side = "decoder"
        else:
            q_side = "encoder" if _inside(module, encoder) else "decoder"
            kv_side = "encoder" if q_side == "encoder" or not module.is_causal else "decoder"
        attention.append(AttentionModule(path, module, q_side, kv_side, *_head_counts(module)))
    if not attention:
        raise ValueError(f"found no attention modules in {name}")
    if kind == "causal":  # decided by the layers: BertConfig has no is_causal, BertSelfAttention says False
        bidirectional = [a.name for a in attention if not a.module.is_causal]
        if bidirectional:
            raise ValueError(f"{name} is a bidirectional (encoder-only) model: its self-attention {bidirectional[0]} "
                             f"(and {len(bidirectional) - 1} more) is not causal (is_causal=False), and its labels are "
                             "not next-token labels (masked-LM labels would be shifted like a causal LM's); seqpar_hf "
                             "shards causal LMs and encoder-decoder models")
    positions = _positions(backbone, kind, name, encoder)
    if kind == "causal" and "position_ids" not in inspect.signature(backbone.forward).parameters:
        _refuse(name, "its backbone takes no position_ids, so shards cannot be given their global positions",
                "Use a model whose forward takes position_ids")
    stacks = [m for m in backbone.modules() if hasattr(m, "layers") and isinstance(m.layers, nn.ModuleList)]
    return ModelFamily(kind, pretrained, backbone, has_lm_head, attention, positions, stacks)
