"""The fixed CI sample of the sweep (tests/test_zoo_sample.py): one class per distinct structure, each
variant (padded, packed, generate) represented, the 4-rank hybrid on three classes (Llama, Gemma 3, Marian),
and a row for each fix of conformance/results/diagnosis.md (its group noted), some on a variant
("<model_type>:<name>", overrides.VARIANTS) that switches on the structure the defaults leave off. Rows
that fail are listed in KNOWN_FAILURES with their root cause (xfail(strict=True) there, so a fix shows as
XPASS); none today (Gemma 4's and Moshi's generate rows, diagnosis.md M1 / M2, were the last).

Structures: plain decoder with GQA (Llama), q/k norm + sliding window (Qwen3), window (Mistral), sliding:full
pattern (Gemma 3), KV-shared layers (Gemma 3n; Gemma 4 with partial rotary and wider global heads), MoE (Qwen3-MoE,
Mixtral), MoE + window not passed (Qwen2-MoE, PhiMoE), latent attention with v narrower than q/k (DeepSeek-V3,
LongCat), partial rotary on some layers (Laguna), partial rotary + fused qkv (GPT-NeoX), learned absolute positions
in a 32-row table (GPT-2), yarn whose original length is shorter than the batch (Ministral 3), encoder-decoder
(Marian, BART, M2M100 with padding-aware sinusoidal positions), padding-aware learned positions (RoBERTa), an LM
forward around its backbone (OPT: its packed rows refused), a window only in the cache (Moshi), a config without
pad_token_id (CodeGen), a bidirectional sliding-window encoder with soft-capping (T5Gemma), soft-capping (Gemma 2),
learned sinks (gpt-oss), chunked attention and queries scaled by index (Llama 4), a relative position bias and an
encoder-decoder that runs its own stacks (T5), TP fixes (Apertus, Phi, OLMo), and token mixers (LFM2's short
convolution by channel, Nemotron-H's and Granite 4's Mamba2 and Qwen3-Next's gated DeltaNet by heads, Jamba's Mamba
run whole), models without attention (Mamba, Mamba2), and the refusals: a mixer under TP (LFM2), hand-written
attention (GPT-1, BLOOM's
ALiBi), a relative position bias other than T5's (LongT5), attention keywords (Inkling, DeepSeek-V3.2, MiniMax-M3),
routing capacity (NLLB-MoE), two models whose decoder makes its own positions (EncoderDecoder), global-local
attention (PEGASUS-X), patches (BLT), a loss without the shift (Whisper); under TP: per-head norms (Cohere), a plan
that shards nothing (DiffLlama), per-layer inputs (Gemma 3n); generate under TP.
"""

from __future__ import annotations

P, K, G = "padded", "packed", "generate"
ALL = (P, K, G)
IM, IG = "images", "images-generate"  # the image-text-to-text rows (images.py)
# (model_type, class, layouts, variants): every variant on every listed layout. Rows refused at patch_model
# run the padded variant only (the refusal is the same for every batch).
SAMPLE: list[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = [
    ("llama", "LlamaForCausalLM", ("ring", "tp2", "hybrid"), ALL),  # Ulysses: the parity and packing runs
    ("qwen3", "Qwen3ForCausalLM", ("ulysses",), ALL),
    ("qwen3", "Qwen3ForCausalLM", ("tp2",), (P, K)),
    ("mistral", "MistralForCausalLM", ("ring",), ALL),  # window 4 < every batch
    ("gemma3_text", "Gemma3ForCausalLM", ("ulysses", "hybrid"), ALL),  # sliding:full pattern
    ("gemma3n_text", "Gemma3nForCausalLM", ("ring",), ALL),  # KV-shared layers (the second half)
    ("gemma4_text", "Gemma4ForCausalLM", ("ulysses",), ALL),  # KV-shared, partial rotary, wider global heads
    ("gemma4_text", "Gemma4ForCausalLM", ("ring",), (P,)),  # L: fp32 near miss, re-checked in float64 on the ring
    ("qwen3_moe", "Qwen3MoeForCausalLM", ("ulysses",), ALL),
    ("mixtral", "MixtralForCausalLM", ("ring",), (P, K)),
    ("qwen2_moe", "Qwen2MoeForCausalLM", ("ring",), (P, K)),  # C: window only in the mask
    ("phimoe", "PhimoeForCausalLM", ("ulysses",), (P,)),  # C
    ("deepseek_v3", "DeepseekV3ForCausalLM", ("ulysses",), ALL),  # latent attention: v narrower than q/k
    ("deepseek_v3", "DeepseekV3ForCausalLM", ("ring",), (P,)),
    ("laguna", "LagunaForCausalLM", ("ring",), (P, G)),  # partial rotary on the full layers only, window 4
    ("longcat_flash", "LongcatFlashForCausalLM", ("ulysses",), (P,)),  # E3: MLA found by its call, not its name
    ("gpt_neox", "GPTNeoXForCausalLM", ("ulysses",), ALL),  # partial rotary 1/4, fused qkv
    ("gpt2", "GPT2LMHeadModel", ("ring",), ALL),  # learned absolute positions, a table of 32
    ("ministral3", "Ministral3ForCausalLM", ("ulysses",), (P, G)),  # yarn whose original length (8) < the batch
    ("phi3", "Phi3ForCausalLM", ("ulysses", "ring"), (P,)),  # fused qkv + window
    ("marian", "MarianMTModel", ("ring", "hybrid"), ALL),  # Ulysses: the parity and generation runs
    ("marian", "MarianMTModel", ("tp2",), (P, K)),
    ("bart", "BartForConditionalGeneration", ("ring",), ALL),
    ("m2m_100", "M2M100ForConditionalGeneration", ("ulysses",), ALL),  # padding-aware sinusoidal positions
    ("roberta", "RobertaForCausalLM", ("ulysses",), (P, G)),  # B: padding-aware default positions
    ("opt", "OPTForCausalLM", ("ulysses",), ALL),  # F: the LM forward calls model.decoder; packed refused
    ("mllama", "MllamaForCausalLM", ("ulysses",), (P,)),  # F: base_model is the LM itself
    ("moshi", "MoshiForCausalLM", ("ulysses",), (P, G)),  # its window only in its cache (decoding), not its mask
    ("codegen", "CodeGenForCausalLM", ("ulysses",), (P, G)),  # J: no pad_token_id; rotary_dim 1/4 of the head
    ("t5gemma", "T5GemmaForConditionalGeneration", ("ulysses",), (P,)),  # G: bidirectional window; soft-capping
    ("gemma2", "Gemma2ForCausalLM", ("ring",), (P, G)),  # soft-capping (0.02: it bites) in the block kernels
    ("gpt_oss", "GptOssForCausalLM", ("ulysses",), ALL),  # learned sinks (a ring of one); packed rows refused
    ("llama4:floor_scale_4", "Llama4ForCausalLM", ("ring",), (P, G)),  # chunks; queries scaled by their index
    ("t5", "T5ForConditionalGeneration", ("ring",), (P, G)),  # relative position bias; the model runs its stacks
    ("switch_transformers", "SwitchTransformersForConditionalGeneration", ("ulysses",), (P, G)),  # encoder output type
    ("marian:decoder_is_causal_false_eager", "MarianMTModel", ("ulysses", "ring"), (P,)),  # E1: sides from keys
    ("apertus", "ApertusForCausalLM", ("tp2",), (P,)),  # I2: xIELU alpha summed over TP
    ("phi:qk_layernorm", "PhiForCausalLM", ("tp2",), (P,)),  # TP: per-head norm weights summed over TP
    ("olmo:clip_qkv", "OlmoForCausalLM", ("tp2",), (P,)),  # TP: q / k / v clamped in place
    # token mixers outside attention (models/mixers/)
    ("lfm2", "Lfm2ForCausalLM", ("ulysses",), (P,)),  # short convolution, split along the sequence with a halo
    ("jamba", "JambaForCausalLM", ("ring",), (P,)),  # Mamba: selective scan, its state added; no layer kwargs
    ("qwen3_next", "Qwen3NextForCausalLM", ("ulysses",), (P, G)),  # gated DeltaNet: its state passed (+ MoE)
    ("nemotron_h:two_groups", "NemotronHForCausalLM", ("ulysses",), (P, G)),  # Mamba2: its SSD state passed
    ("zamba2", "Zamba2ForCausalLM", ("ulysses",), (G,)),  # a cache layer holding a mixer's states and keys
    ("zamba", "ZambaForCausalLM", ("ulysses",), (G,)),  # generate refused: shared attention without a layer index
    ("granitemoehybrid", "GraniteMoeHybridForCausalLM", ("ring",), (P,)),  # Mamba2 of one group, zigzag shards
    ("mamba", "MambaForCausalLM", ("ulysses",), (P, G)),  # no attention: the context on the shard's mask
    ("mamba2", "Mamba2ForCausalLM", ("ring",), (P,)),  # no attention, no position_ids taken
    # vision-language models with images (Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3: tests/test_vlm_gloo.py)
    ("idefics3", "Idefics3ForConditionalGeneration", ("ring",), (IM,)),  # images [rows, n, c, h, w]; eval makes a cache
    # refused at patch_model, naming the module and why
    ("lfm2", "Lfm2ForCausalLM", ("tp2",), (P,)),  # a mixer run whole under TP
    ("openai-gpt", "OpenAIGPTLMHeadModel", ("ulysses",), (P,)),  # E5: attention written by hand, named
    ("bloom", "BloomForCausalLM", ("ulysses",), (P,)),
    ("cohere:use_qk_norm", "CohereForCausalLM", ("tp2",), (P,)),  # TP: [heads, head_dim] norm weights
    ("diffllama", "DiffLlamaForCausalLM", ("tp2",), (P,)),  # I1: a plan that shards nothing
    ("gemma3n_text", "Gemma3nForCausalLM", ("tp2",), (P,)),  # I3: per-layer inputs
    ("encoder-decoder", "EncoderDecoderModel", ("ulysses",), (P,)),  # F: two models; its BERT decoder's positions
    ("longt5", "LongT5ForConditionalGeneration", ("ulysses",), (P,)),  # a relative bias other than T5's table
    ("inkling_text", "InklingForCausalLM", ("ulysses",), (P,)),  # D: position_bias=
    ("deepseek_v32", "DeepseekV32ForCausalLM", ("ulysses",), (P,)),  # D: indices=
    ("minimax_m3_vl_text", "MiniMaxM3VLForCausalLM", ("ulysses",), (P,)),  # D: was HUNG
    ("nllb-moe", "NllbMoeForConditionalGeneration", ("ulysses",), (P,)),  # routing capacity over the tokens
    ("pegasus_x", "PegasusXForConditionalGeneration", ("ulysses",), (P,)),  # E4: global-local attention
    ("blt", "BltForCausalLM", ("ulysses",), (P,)),  # H: bytes resampled into patches
    ("whisper", "WhisperForCausalLM", ("ulysses",), (P,)),  # a loss without the causal shift
]

# rows that must be REFUSED, with a part of the message (the module and why), by (model_type, layout) for
# every variant or by (model_type, layout, variant); every other row must be EXACT
_TP_GENERATE = "generate on a tensor-parallel model (tp_size=2)"
EXPECT_REFUSED: dict[tuple, str] = {
    ("llama", "tp2", G): _TP_GENERATE,
    ("opt", "ulysses", K): "lets model.decoder.layers.0.self_attn (OPTAttention) attend across the documents",
    ("gpt_oss", "ulysses", K): "lets model.layers.0.self_attn (GptOssAttention) attend across the documents",
    ("lfm2", "tp2"): "layers.0.conv (Lfm2ShortConv) mixes tokens outside attention (a convolution or a scan)",
    ("zamba", "ulysses", G): "attention module layers.1.shared_transf.self_attn has no layer index of its own",
    ("openai-gpt", "ulysses"): "transformer.h.0.attn (Attention) computes attention itself",
    ("bloom", "ulysses"): "transformer (BloomModel) computes attention itself",  # its ALiBi over the sequence
    ("longt5", "ulysses"): "adds a relative position bias other than T5's",
    ("cohere:use_qk_norm", "tp2"): "layers.0.self_attn.q_norm.weight (CohereLayerNorm, one row per attention head",
    ("diffllama", "tp2"): "plan shards no projection",
    ("gemma3n_text", "tp2"): "layers.0 takes per-token inputs besides its hidden states (per_layer_input)",
    ("encoder-decoder", "ulysses"): "decoder.bert.embeddings (BertEmbeddings) mixes information along the sequence",
    ("inkling_text", "ulysses"): "model.layers.0.self_attn (InklingAttention) passes position_bias=",
    ("deepseek_v32", "ulysses"): "model.layers.0.self_attn (DeepseekV32Attention) passes indices=",
    ("minimax_m3_vl_text", "ulysses"): "model.layers.0.self_attn (MiniMaxM3VLAttention) passes block_indices=",
    ("nllb-moe", "ulysses"): "(NllbMoeTop2Router) decides for each token from the batch's other tokens",
    ("pegasus_x", "ulysses"): "model.encoder.embed_positions (PegasusXSinusoidalPositionalEmbedding) fails on a shard",
    ("blt", "ulysses"): "(BltCrossAttention) attends to keys that are not a sequence of the model",
    ("whisper", "ulysses"): "against the label at the same position (no shift)",
}

# rows that fail today, by (model_type, layout, variant), with their root cause: xfail(strict=True) in
# tests/test_zoo_sample.py
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}
# refusals that do not say why (the sample test asks every REFUSED row for a clear message)
UNCLEAR_REFUSALS: dict[tuple[str, str, str], str] = {}


def expected_refusal(model_type: str, layout: str, variant: str) -> str | None:
    return EXPECT_REFUSED.get((model_type, layout, variant)) or EXPECT_REFUSED.get((model_type, layout))


def sample_tasks() -> list[tuple[str, str, str, str]]:
    """(model_type, class, layout, variant), each once, layouts grouped as the sweep runs them."""
    tasks = [(mt, cls, layout, v) for mt, cls, layouts, variants in SAMPLE for layout in layouts for v in variants]
    return list(dict.fromkeys(tasks))
