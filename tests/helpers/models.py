"""Tiny models of every supported family and batches with the shapes that break SP code:
odd lengths, padding, a source that is mostly padding, source length != target length."""

from __future__ import annotations

import torch
import transformers
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    M2M100Config,
    M2M100ForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    MBartConfig,
    MBartForConditionalGeneration,
    MistralConfig,
    MistralForCausalLM,
    PegasusConfig,
    PegasusForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 97
NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def seq2seq_config(family: str, heads: int = 4, d_model: int = 24, layers: int = 2, **overrides):
    common = dict(
        vocab_size=VOCAB,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=40,
        decoder_ffn_dim=40,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
        **NO_DROPOUT,
    )
    common.update(overrides)
    if family == "marian":
        return MarianConfig(**common)
    if family == "bart":
        return BartConfig(bos_token_id=1, forced_eos_token_id=None, **common)
    if family == "mbart":
        return MBartConfig(bos_token_id=1, forced_eos_token_id=None, **common)
    if family == "pegasus":
        return PegasusConfig(**common)
    if family == "m2m100":
        common.pop("forced_eos_token_id", None)
        return M2M100Config(bos_token_id=1, **common)
    if family == "t5":  # relative position bias (buckets up to 16 apart), encoder and decoder run by the model itself
        t5 = dict(
            vocab_size=VOCAB,
            d_model=d_model,
            d_kv=d_model // heads,
            d_ff=40,
            num_layers=layers,
            num_heads=heads,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=0,
        )
        t5.update({k: v for k, v in overrides.items() if k != "init_std"})
        return transformers.T5Config(**t5)
    raise ValueError(family)


def causal_config(family: str, heads: int = 4, kv_heads: int = 2, head_dim: int = 8, layers: int = 2, **overrides):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=heads * head_dim,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attention_dropout=0.0,
    )
    common.update(overrides)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**{"sliding_window": None, **common})
    if family == "qwen2":
        return Qwen2Config(**{"use_sliding_window": False, **common})
    extra = CAUSAL_EXTRA[family]
    config_class = getattr(transformers, extra["config"])
    if extra.get("mla"):
        common["num_key_value_heads"] = heads
    kwargs = {
        k: v for k, v in {**common, **extra.get("kwargs", {}), **overrides}.items() if k not in extra.get("drop", ())
    }
    return config_class(**kwargs)


# Decoder-only families beyond the first three: config class, model class, config tweaks. Tiny and fp32;
# each one exercises a structural feature (noted).
CAUSAL_EXTRA = {
    "qwen3": dict(config="Qwen3Config", model="Qwen3ForCausalLM"),  # q/k norm
    "qwen3_moe": dict(
        config="Qwen3MoeConfig",
        model="Qwen3MoeForCausalLM",  # mixture of experts
        kwargs=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    ),
    "mixtral": dict(
        config="MixtralConfig",
        model="MixtralForCausalLM",  # mixture of experts
        kwargs=dict(num_local_experts=4, num_experts_per_tok=2),
    ),
    "phi3": dict(config="Phi3Config", model="Phi3ForCausalLM", drop=("head_dim",)),  # fused qkv projection
    "gemma": dict(config="GemmaConfig", model="GemmaForCausalLM"),
    "gemma2": dict(
        config="Gemma2Config",
        model="Gemma2ForCausalLM",  # alternating sliding window
        kwargs=dict(
            attn_logit_softcapping=None, final_logit_softcapping=30.0, sliding_window=4, query_pre_attn_scalar=8
        ),
    ),
    "gemma3": dict(
        config="Gemma3TextConfig",
        model="Gemma3ForCausalLM",  # 5 local : 1 global
        kwargs=dict(sliding_window=4, query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"]),
    ),
    "olmo2": dict(config="Olmo2Config", model="Olmo2ForCausalLM"),  # norms after attention, q/k norm
    "llama4": dict(
        config="Llama4TextConfig",
        model="Llama4ForCausalLM",  # chunked attention (chunks of 4) and a NoPE layer whose queries are scaled by
        # their index (temperature tuning from index 3 on: floor_scale=3), MoE
        kwargs=dict(
            attention_chunk_size=4,
            layer_types=["chunked_attention", "full_attention"],
            no_rope_layers=[1, 0],
            floor_scale=3,
            attn_scale=0.5,
            intermediate_size_mlp=48,
            num_local_experts=2,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
        ),
    ),
    "granitemoehybrid": dict(
        config="GraniteMoeHybridConfig",
        model="GraniteMoeHybridForCausalLM",  # Granite 4: Mamba2 mixers (run whole under SP) + MoE + attention
        drop=("head_dim",),
        kwargs=dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"],
            mamba_n_heads=4,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_head=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
        ),
    ),
    "bamba": dict(
        config="BambaConfig",
        model="BambaForCausalLM",  # Mamba2 mixers of one head group (run whole under SP) + attention
        drop=("head_dim",),
        kwargs=dict(
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_d_head=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=8,
        ),
    ),
    "jamba": dict(
        config="JambaConfig",
        model="JambaForCausalLM",  # Mamba mixers its layers call without their keyword arguments + attention + MoE
        drop=("head_dim",),
        kwargs=dict(
            num_experts=2,
            num_experts_per_tok=1,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
            mamba_dt_rank=4,
            use_mamba_kernels=False,
        ),
    ),
    "mamba": dict(
        config="MambaConfig",
        model="MambaForCausalLM",  # attention-free: Mamba's selective scan split along the sequence, nothing else
        drop=("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "attention_dropout"),
        kwargs=dict(state_size=8, conv_kernel=4, expand=2, time_step_rank=4),
    ),
    "mamba2": dict(
        config="Mamba2Config",
        model="Mamba2ForCausalLM",  # attention-free: Mamba2's SSD split along the sequence; no position_ids taken
        drop=("num_attention_heads", "num_key_value_heads", "intermediate_size", "attention_dropout"),
        kwargs=dict(num_heads=8, head_dim=8, state_size=8, n_groups=2, conv_kernel=4, expand=2, chunk_size=8),
    ),
    "qwen3_5": dict(
        config="Qwen3_5TextConfig",
        model="Qwen3_5ForCausalLM",  # gated DeltaNet (split along the sequence under SP) + full attention
        kwargs=dict(
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
    "qwen3_next": dict(
        config="Qwen3NextConfig",
        model="Qwen3NextForCausalLM",  # fused q/k/v/z projections of its gated DeltaNet; MoE
        kwargs=dict(
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
    ),
    "smollm3": dict(
        config="SmolLM3Config",
        model="SmolLM3ForCausalLM",  # layers without rotary (NoPE)
        kwargs=dict(no_rope_layer_interval=2),
    ),
    "gpt_neox": dict(
        config="GPTNeoXConfig",
        model="GPTNeoXForCausalLM",  # partial rotary, fused qkv
        drop=("num_key_value_heads", "head_dim"),
        kwargs=dict(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            hidden_dropout=0.0,
        ),
    ),
    # multi-head latent attention with the released checkpoints' widths, scaled: q/k 12 (8 + 4 rotary) per head,
    # v 8 (as 192 vs 128); `v_head_dim=16` for a value wider than q/k. Every head has its own k (kv heads = heads)
    "deepseek_v3": dict(
        config="DeepseekV3Config",
        model="DeepseekV3ForCausalLM",
        drop=("head_dim",),
        mla=True,
        kwargs=dict(
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            kv_lora_rank=16,
            q_lora_rank=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
    ),
    "deepseek_v2": dict(
        config="DeepseekV2Config",
        model="DeepseekV2ForCausalLM",
        mla=True,  # q without a LoRA (Lite)
        kwargs=dict(
            head_dim=4,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=8,
            kv_lora_rank=16,
            q_lora_rank=None,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
    ),
}


MODEL_CLASSES = {
    "marian": MarianMTModel,
    "bart": BartForConditionalGeneration,
    "mbart": MBartForConditionalGeneration,
    "pegasus": PegasusForConditionalGeneration,
    "m2m100": M2M100ForConditionalGeneration,
    "t5": transformers.T5ForConditionalGeneration,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    **{name: getattr(transformers, extra["model"]) for name, extra in CAUSAL_EXTRA.items()},
}
SEQ2SEQ = ("marian", "bart", "mbart", "pegasus", "m2m100", "t5")


def build_model(family: str, seed: int = 0, **config_kwargs):
    torch.manual_seed(seed)
    config = (seq2seq_config if family in SEQ2SEQ else causal_config)(family, **config_kwargs)
    model = MODEL_CLASSES[family](config).float()
    model.set_attn_implementation("eager" if family in EAGER_ONLY else "sdpa")
    return model


EAGER_ONLY = ("gemma2", "mamba", "mamba2")  # transformers 5.24 has no SDPA path for Gemma 2; Mamba: no attention


def rope(rope_type: str, head_dim: int = 8, original: int = 8) -> dict:
    """rope_parameters of each rope type, scaled for a model trained on `original` positions (the
    test sequences are longer, so the scaled branches run)."""
    half = head_dim // 2
    params = {"rope_theta": 10000.0, "rope_type": rope_type}
    if rope_type in ("linear", "dynamic"):
        params.update(factor=2.0)
    elif rope_type == "yarn":
        params.update(factor=4.0, original_max_position_embeddings=original)
    elif rope_type == "longrope":
        params.update(
            short_factor=[1.0 + 0.1 * i for i in range(half)],
            long_factor=[2.0 + 0.5 * i for i in range(half)],
            original_max_position_embeddings=original,
        )
    elif rope_type == "llama3":
        params.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=original)
    return params


def seq2seq_batch(
    seed: int, batch: int = 3, src_len: int = 13, tgt_len: int = 9, pad: bool = True, empty_source: bool = False
):
    """Right-padded source and target; sample 1's source is mostly padding (2 real tokens), or all
    padding with `empty_source` (every key of its attention rows masked)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, src_len), generator=g)
    labels = torch.randint(3, VOCAB, (batch, tgt_len), generator=g)
    attention_mask = torch.ones(batch, src_len, dtype=torch.long)
    if pad:
        attention_mask[1, 0 if empty_source else 2 :] = 0
        if batch > 2:
            attention_mask[2, src_len - 3 :] = 0
        labels[0, tgt_len - 2 :] = -100
    input_ids[attention_mask == 0] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def causal_batch(seed: int, batch: int = 3, length: int = 11, pad: bool = True, left_pad: bool = True):
    """Left padding on sample 1 (as for generation-style batches), right padding on sample 2.

    With left padding the last padding position predicts the first real token: its query sees no key,
    and transformers' own kernels disagree there (SDPA: output 0, eager: the mean of every value).
    seqpar_hf follows SDPA; eager-only models are compared with `left_pad=False`."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    if pad:
        attention_mask[1, :3] = 0 if left_pad else 1
        attention_mask[1, length - 2 :] = 1 if left_pad else 0
        if batch > 2:
            attention_mask[2, length - 4 :] = 0
    input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_batch(family: str, seed: int, **kwargs):
    return (seq2seq_batch if family in SEQ2SEQ else causal_batch)(seed, **kwargs)


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """||actual - expected|| / max(||expected||, floor)."""
    denom = max(expected.double().norm().item(), floor)
    return (actual.double() - expected.double()).norm().item() / denom if denom > 0 else 0.0
