"""The fixed CI sample of the sweep (tests/test_zoo_sample.py): one class per structural kind, and a row for
each fix of conformance/results/diagnosis.md (its group noted), some on a variant ("<model_type>:<name>",
overrides.VARIANTS) that switches on the structure the defaults leave off. Rows that fail would be listed
in KNOWN_FAILURES with their root cause (xfail(strict=True) there, so a fix shows as XPASS): none today.

Kinds: plain decoder with GQA (Llama), q/k norm + sliding window (Qwen3), sliding window (Mistral),
sliding:full pattern (Gemma 3), MoE (Qwen3-MoE, Mixtral), MoE + window not passed (Qwen2-MoE),
latent attention + MoE (DeepSeek-V3), partial rotary + fused qkv (GPT-NeoX), learned absolute positions
(GPT-2), short-conv hybrid (LFM2), Mamba hybrid (Jamba), gated-DeltaNet hybrid (Qwen3-Next), pure SSM
(Mamba), ALiBi computed by hand (BLOOM), relative position bias (T5), soft-capping (Gemma 2), encoder-decoder (Marian,
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
    ("qwen2_moe", "Qwen2MoeForCausalLM", ("ulysses", "ring")),  # C: window only in the mask
    ("phimoe", "PhimoeForCausalLM", ("ulysses",)),  # C
    ("deepseek_v3", "DeepseekV3ForCausalLM", ("ulysses", "ring")),
    ("longcat_flash", "LongcatFlashForCausalLM", ("ulysses",)),  # E3: MLA found by its call, not its name
    ("gpt_neox", "GPTNeoXForCausalLM", ("ulysses", "ring")),
    ("gpt2", "GPT2LMHeadModel", ("ulysses", "ring")),
    ("lfm2", "Lfm2ForCausalLM", ("ulysses", "ring", "tp2")),  # A: short convolution
    ("jamba", "JambaForCausalLM", ("ulysses",)),  # A: Mamba mixer
    ("qwen3_next", "Qwen3NextForCausalLM", ("ulysses",)),  # A: gated DeltaNet
    ("mamba", "MambaForCausalLM", ("ulysses",)),  # A / E5: pure SSM, named
    ("openai-gpt", "OpenAIGPTLMHeadModel", ("ulysses",)),  # E5: attention written by hand, named
    ("bloom", "BloomForCausalLM", ("ulysses",)),
    ("t5", "T5ForConditionalGeneration", ("ulysses",)),
    ("gemma2", "Gemma2ForCausalLM", ("ulysses",)),
    ("gemma4_text", "Gemma4ForCausalLM", ("ring",)),  # L: fp32 near miss, re-checked in float64 on the ring
    ("marian", "MarianMTModel", ("ulysses", "ring", "tp2")),
    ("bart", "BartForConditionalGeneration", ("ulysses", "ring")),
    ("m2m_100", "M2M100ForConditionalGeneration", ("ulysses", "ring")),
    ("roberta", "RobertaForCausalLM", ("ulysses",)),  # B: padding-aware default positions
    ("apertus", "ApertusForCausalLM", ("tp2",)),  # I2: xIELU alpha summed over TP
    ("phi:qk_layernorm", "PhiForCausalLM", ("tp2",)),  # TP: per-head norm weights summed over TP
    ("olmo:clip_qkv", "OlmoForCausalLM", ("tp2",)),  # TP: q / k / v clamped in place
    ("cohere:use_qk_norm", "CohereForCausalLM", ("tp2",)),  # TP: [heads, head_dim] norm weights, refused
    ("diffllama", "DiffLlamaForCausalLM", ("tp2",)),  # I1: a plan that shards nothing, refused
    ("gemma3n_text", "Gemma3nForCausalLM", ("tp2",)),  # I3: per-layer inputs, refused
    ("opt", "OPTForCausalLM", ("ulysses",)),  # F: the LM forward calls model.decoder
    ("mllama", "MllamaForCausalLM", ("ulysses",)),  # F: base_model is the LM itself
    ("encoder-decoder", "EncoderDecoderModel", ("ulysses",)),  # F: two models, refused
    ("phi3", "Phi3ForCausalLM", ("ulysses", "ring")),
    ("inkling_text", "InklingForCausalLM", ("ulysses",)),  # D: position_bias=, refused
    ("deepseek_v32", "DeepseekV32ForCausalLM", ("ulysses",)),  # D: indices=, refused
    ("minimax_m3_vl_text", "MiniMaxM3VLForCausalLM", ("ulysses",)),  # D: was HUNG, refused at patch time
    ("nllb-moe", "NllbMoeForConditionalGeneration", ("ulysses",)),  # routing capacity over the tokens, refused
    ("marian:decoder_is_causal_false_eager", "MarianMTModel", ("ulysses", "ring")),  # E1: sides from key lengths
    ("pegasus_x", "PegasusXForConditionalGeneration", ("ulysses",)),  # E4: global-local attention, refused
    ("t5gemma", "T5GemmaForConditionalGeneration", ("ulysses",)),  # softcap=, refused at patch time
    ("t5gemma:no_softcap", "T5GemmaForConditionalGeneration", ("ulysses",)),  # G: bidirectional sliding window
    ("blt", "BltForCausalLM", ("ulysses",)),  # H: bytes resampled into patches, refused
    ("whisper", "WhisperForCausalLM", ("ulysses",)),  # a loss without the causal shift, refused
    ("codegen", "CodeGenForCausalLM", ("ulysses",)),  # J: no pad_token_id in the config
]

# rows that must be REFUSED, with a part of the message (the module and why); every other row must be EXACT
_CONV = "runs a convolution along the sequence"
EXPECT_REFUSED: dict[tuple[str, str], str] = {
    ("lfm2", "ulysses"): f"model.layers.0.conv (Lfm2ShortConv) {_CONV}",
    ("lfm2", "ring"): f"model.layers.0.conv (Lfm2ShortConv) {_CONV}",
    ("lfm2", "tp2"): f"model.layers.0.conv (Lfm2ShortConv) {_CONV}",
    ("jamba", "ulysses"): f"model.layers.0.mamba (JambaMambaMixer) {_CONV}",
    ("qwen3_next", "ulysses"): f"model.layers.0.linear_attn (Qwen3NextGatedDeltaNet) {_CONV}",
    ("mamba", "ulysses"): f"backbone.layers.0.mixer (MambaMixer) {_CONV}",
    ("openai-gpt", "ulysses"): "transformer.h.0.attn (Attention) computes attention itself",
    ("bloom", "ulysses"): "transformer (BloomModel) computes attention itself",  # its ALiBi over the sequence
    ("t5", "ulysses"): "relative position bias",
    ("gemma2", "ulysses"): "soft-capping",
    ("cohere:use_qk_norm", "tp2"): "layers.0.self_attn.q_norm.weight (CohereLayerNorm, one row per attention head",
    ("diffllama", "tp2"): "plan shards no projection",
    ("gemma3n_text", "tp2"): "layers.0 takes per-token inputs besides its hidden states (per_layer_input)",
    ("encoder-decoder", "ulysses"): "runs attention in several modules it calls itself",
    ("inkling_text", "ulysses"): "model.layers.0.self_attn (InklingAttention) passes position_bias=",
    ("deepseek_v32", "ulysses"): "model.layers.0.self_attn (DeepseekV32Attention) passes indices=",
    ("minimax_m3_vl_text", "ulysses"): "model.layers.0.self_attn (MiniMaxM3VLAttention) passes block_indices=",
    ("nllb-moe", "ulysses"): "(NllbMoeTop2Router) decides for each token from the batch's other tokens",
    ("pegasus_x", "ulysses"): "model.encoder.embed_positions (PegasusXSinusoidalPositionalEmbedding) fails on a shard",
    ("t5gemma", "ulysses"): "model.encoder.layers.0.self_attn (T5GemmaSelfAttention) passes softcap=",
    ("blt", "ulysses"): "(BltCrossAttention) attends to keys that are not a sequence of the model",
    ("whisper", "ulysses"): "against the label at the same position (no shift)",
}

# rows that fail today, with their root cause: xfail(strict=True) in tests/test_zoo_sample.py
KNOWN_FAILURES: dict[tuple[str, str], str] = {}
# refusals that do not say why (the sample test asks every REFUSED row for a clear message)
UNCLEAR_REFUSALS: dict[tuple[str, str], str] = {}


def sample_tasks() -> list[tuple[str, str, str]]:
    return [(mt, cls, layout) for mt, cls, layouts in SAMPLE for layout in layouts]
