"""The fixed CI sample of the sweep (tests/test_zoo_sample.py): one class per structural kind, with the
rows that fail today and their root cause (xfail(strict=True) there, so a fix shows as XPASS).

Kinds: plain decoder with GQA (Llama), q/k norm + sliding window (Qwen3), sliding window (Mistral),
sliding:full pattern (Gemma 3), MoE (Qwen3-MoE, Mixtral), MoE + window not passed (Qwen2-MoE),
latent attention + MoE (DeepSeek-V3), partial rotary + fused qkv (GPT-NeoX), learned absolute positions
(GPT-2), short-conv hybrid (LFM2), Mamba hybrid (Jamba), gated-DeltaNet hybrid (Qwen3-Next), pure SSM
(Mamba), ALiBi (BLOOM), relative position bias (T5), soft-capping (Gemma 2), encoder-decoder (Marian,
BART, M2M100 with padding-aware sinusoidal positions), an LM forward around its backbone (OPT),
padding-aware learned positions (RoBERTa), an activation with learned parameters under TP (Apertus),
fused qkv + window (Phi-3), an attention bias passed as a kwarg (Inkling), DeepSeek sparse attention
(DeepSeek-V3.2), a decoder self-attention with is_causal=False (NLLB-MoE), a bidirectional
sliding-window encoder (T5Gemma), a config without pad_token_id (CodeGen).
"""

from __future__ import annotations

SAMPLE: list[tuple[str, str, tuple[str, ...]]] = [
    ("llama", "LlamaForCausalLM", ("ulysses", "ring", "tp2")),
    ("qwen3", "Qwen3ForCausalLM", ("ulysses", "ring", "tp2")),
    ("mistral", "MistralForCausalLM", ("ulysses", "ring")),
    ("gemma3_text", "Gemma3ForCausalLM", ("ulysses", "ring")),
    ("qwen3_moe", "Qwen3MoeForCausalLM", ("ulysses", "ring")),
    ("mixtral", "MixtralForCausalLM", ("ulysses", "ring")),
    ("qwen2_moe", "Qwen2MoeForCausalLM", ("ulysses", "ring")),
    ("deepseek_v3", "DeepseekV3ForCausalLM", ("ulysses", "ring")),
    ("gpt_neox", "GPTNeoXForCausalLM", ("ulysses", "ring")),
    ("gpt2", "GPT2LMHeadModel", ("ulysses", "ring")),
    ("lfm2", "Lfm2ForCausalLM", ("ulysses", "ring", "tp2")),
    ("jamba", "JambaForCausalLM", ("ulysses",)),
    ("qwen3_next", "Qwen3NextForCausalLM", ("ulysses",)),
    ("mamba", "MambaForCausalLM", ("ulysses",)),
    ("bloom", "BloomForCausalLM", ("ulysses",)),
    ("t5", "T5ForConditionalGeneration", ("ulysses",)),
    ("gemma2", "Gemma2ForCausalLM", ("ulysses",)),
    ("marian", "MarianMTModel", ("ulysses", "ring", "tp2")),
    ("bart", "BartForConditionalGeneration", ("ulysses", "ring")),
    ("m2m_100", "M2M100ForConditionalGeneration", ("ulysses", "ring")),
    ("roberta", "RobertaForCausalLM", ("ulysses",)),
    ("apertus", "ApertusForCausalLM", ("tp2",)),
    ("opt", "OPTForCausalLM", ("ulysses",)),
    ("phi3", "Phi3ForCausalLM", ("ulysses", "ring")),
    ("inkling_text", "InklingForCausalLM", ("ulysses",)),
    ("deepseek_v32", "DeepseekV32ForCausalLM", ("ulysses",)),
    ("nllb-moe", "NllbMoeForConditionalGeneration", ("ulysses",)),
    ("t5gemma", "T5GemmaForConditionalGeneration", ("ulysses",)),
    ("codegen", "CodeGenForCausalLM", ("ulysses",)),
]

_MIXER = "token mixing outside attention runs on each rank's shard alone (patch_model does not refuse it)"
KNOWN_FAILURES: dict[tuple[str, str], str] = {
    ("qwen2_moe", "ulysses"): "Qwen2MoeAttention builds a sliding-window mask but passes no sliding_window=; the "
                              "patched attention drops the mask and attends without the window",
    ("qwen2_moe", "ring"): "same as ulysses: window only in the dropped mask",
    ("lfm2", "ulysses"): f"Lfm2ShortConv: {_MIXER}",
    ("lfm2", "ring"): f"Lfm2ShortConv: {_MIXER}",
    ("lfm2", "tp2"): "base_model_tp_plan parallelises only embed_tokens; the TP pre-hooks still turn every self_attn "
                     "input into a DTensor that meets plain q_proj weights",
    ("jamba", "ulysses"): f"JambaMambaMixer: {_MIXER}",
    ("qwen3_next", "ulysses"): f"Qwen3NextGatedDeltaNet: {_MIXER}",
    ("apertus", "tp2"): "the xIELU activation's learned alpha_p / alpha_n see only the rank's half of the MLP "
                        "features; their gradient is never summed over TP",
    ("opt", "ulysses"): "OPTForCausalLM.forward calls self.model.decoder, not the patched backbone (OPTModel)",
    ("inkling_text", "ulysses"): "InklingAttention passes its relative-position bias as position_bias= (SDPA adds it; "
                                 "sp_attention drops it) and runs short convolutions on k / v (k_sconv, v_sconv)",
    ("deepseek_v32", "ulysses"): "DeepseekV32Attention feeds attention_mask[:, 0] to its indexer; the patched mask "
                                 "function returns None (and the top-k indices= would be dropped by sp_attention)",
    ("nllb-moe", "ulysses"): "NllbMoeAttention of the decoder's self-attention has is_causal=False; patch_model takes "
                             "it for cross-attention (keys from the encoder) and the shapes clash",
    ("t5gemma", "ulysses"): "the encoder's mask is bidirectional AND sliding-window ('and_mask'); it is refused only "
                            "inside the first forward, after patch_model accepted the model",
}
# refusals that do not say why (the sample test asks every REFUSED row for a clear message)
UNCLEAR_REFUSALS: dict[tuple[str, str], str] = {
    ("mamba", "ulysses"): "MambaMixer is refused only with 'found no attention modules', which names neither the "
                          "mixer nor why",
    ("codegen", "ulysses"): "PatchState reads config.pad_token_id, which CodeGenConfig does not define: an "
                            "AttributeError (with it set, CodeGen is EXACT)",
}


def sample_tasks() -> list[tuple[str, str, str]]:
    return [(mt, cls, layout) for mt, cls, layouts in SAMPLE for layout in layouts]
