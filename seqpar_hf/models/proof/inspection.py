"""Which transformers models can be sequence-parallel, decided by what their code does, never by a list.

`inspect_model` checks the structure first (structure.py: relative position biases, ALiBi, soft-capping, sinks and
chunked attention in the config; position modules that cannot be looked up by position id), then proves
the rest with a dry run of the model (prove.py, probe.py): the backbone its forward runs, every
attention call through transformers' `AttentionInterface` (sides, pattern, keywords), its default
positions, its loss and LM head, and (when the layout splits the sequence) that nothing but attention
mixes tokens. Causal LMs and encoder-decoder LMs are patched as a whole; their backbones also on their
own. Every refusal names the module or value, why, and the fix.
"""

from __future__ import annotations

from typing import cast

from torch import nn
from transformers import PreTrainedModel

from ... import _compat
from ..families import ModelFamily, pad_token_id, unwrap
from .probe_checks import Refusal
from .prove import prove
from .structure import check_structure

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def inspect_model(model: nn.Module, split: bool = False, ring: bool = False) -> ModelFamily:
    """Find the SP-relevant parts of `model`, or raise a ValueError that names what is wrong and the fix.
    Structure first, then a dry run (models/proof/probe.py) that finds the backbone and every attention call;
    with `split` (the layout splits the sequence) it also proves that every module computes on a shard
    what it computes on the full sequence (`ring`: shards in the ring's zigzag order)."""
    pretrained = cast(PreTrainedModel, unwrap(model))  # a transformers model, or refused below
    config = getattr(pretrained, "config", None)
    name = type(pretrained).__name__
    if config is None:
        raise ValueError(f"seqpar_hf patches transformers models (PreTrainedModel); {name} has no config")
    attn = _compat.attn_implementation(config)
    if attn not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"{name} uses attn_implementation={attn!r}; seqpar_hf replaces one of "
            f"{', '.join(ATTENTION_IMPLEMENTATIONS)} (load the model with attn_implementation='sdpa')"
        )
    check_structure(pretrained, config, name)
    guess = getattr(pretrained, "base_model", pretrained)
    if guess is not pretrained and pretrained.get_output_embeddings() is None:
        raise ValueError(
            f"seqpar_hf patches language models (e.g. LlamaForCausalLM, MarianMTModel) or their "
            f"backbones (LlamaModel); {name} has a head that is not a language-model head"
        )
    kind = "seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"
    if kind == "causal" and not getattr(config, "is_causal", True):
        raise ValueError(
            f"{name} is a bidirectional (encoder-only) model; seqpar_hf shards causal LMs and encoder-decoder models"
        )
    try:
        return prove(pretrained, kind, pad_token_id(config), attn, guess, split, ring)
    except Refusal as refusal:
        raise ValueError(refusal.message(pretrained)) from None
