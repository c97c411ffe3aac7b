"""Tiny models of every supported family and batches with the shapes that break SP code:
odd lengths, padding, a source that is mostly padding, source length != target length."""

from __future__ import annotations

import torch
from transformers import (BartConfig, BartForConditionalGeneration, LlamaConfig, LlamaForCausalLM, MarianConfig,
                          MarianMTModel, MBartConfig, MBartForConditionalGeneration, MistralConfig, MistralForCausalLM,
                          PegasusConfig, PegasusForConditionalGeneration, Qwen2Config, Qwen2ForCausalLM)

VOCAB = 97
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def seq2seq_config(family: str, heads: int = 4, d_model: int = 24, layers: int = 2, **overrides):
    common = dict(vocab_size=VOCAB, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                  encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=40,
                  decoder_ffn_dim=40, max_position_embeddings=128, pad_token_id=0, eos_token_id=2,
                  decoder_start_token_id=0, **NO_DROPOUT)
    common.update(overrides)
    if family == "marian":
        return MarianConfig(**common)
    if family == "bart":
        return BartConfig(bos_token_id=1, forced_eos_token_id=None, **common)
    if family == "mbart":
        return MBartConfig(bos_token_id=1, forced_eos_token_id=None, **common)
    if family == "pegasus":
        return PegasusConfig(**common)
    raise ValueError(family)


def causal_config(family: str, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, layers: int = 2, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=heads * head_dim, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=256, pad_token_id=0, attention_dropout=0.0)
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if family == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    raise ValueError(family)


MODEL_CLASSES = {"marian": MarianMTModel, "bart": BartForConditionalGeneration, "mbart": MBartForConditionalGeneration,
                 "pegasus": PegasusForConditionalGeneration, "llama": LlamaForCausalLM, "mistral": MistralForCausalLM,
                 "qwen2": Qwen2ForCausalLM}
SEQ2SEQ = ("marian", "bart", "mbart", "pegasus")


def build_model(family: str, seed: int = 0, **config_kwargs):
    torch.manual_seed(seed)
    config = (seq2seq_config if family in SEQ2SEQ else causal_config)(family, **config_kwargs)
    config._attn_implementation = "sdpa"
    return MODEL_CLASSES[family](config).float()


def seq2seq_batch(seed: int, batch: int = 3, src_len: int = 13, tgt_len: int = 9, pad: bool = True,
                  empty_source: bool = False):
    """Right-padded source and target; sample 1's source is mostly padding (2 real tokens), or all
    padding with `empty_source` (every key of its attention rows masked)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, src_len), generator=g)
    labels = torch.randint(3, VOCAB, (batch, tgt_len), generator=g)
    attention_mask = torch.ones(batch, src_len, dtype=torch.long)
    if pad:
        attention_mask[1, 0 if empty_source else 2:] = 0
        if batch > 2:
            attention_mask[2, src_len - 3:] = 0
        labels[0, tgt_len - 2:] = -100
    input_ids[attention_mask == 0] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def causal_batch(seed: int, batch: int = 3, length: int = 11, pad: bool = True):
    """Left padding on sample 1 (as for generation-style batches), right padding on sample 2."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    if pad:
        attention_mask[1, :3] = 0
        if batch > 2:
            attention_mask[2, length - 4:] = 0
    input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_batch(family: str, seed: int, **kwargs):
    return (seq2seq_batch if family in SEQ2SEQ else causal_batch)(seed, **kwargs)


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """||actual - expected|| / max(||expected||, floor)."""
    denom = max(expected.double().norm().item(), floor)
    return (actual.double() - expected.double()).norm().item() / denom if denom > 0 else 0.0
