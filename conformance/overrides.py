"""What the name rules of tiny.py cannot know, per model_type: config overrides (a dict for a
sub-config updates that sub-config; `_layers` sets the layer count; `_defaults` are arguments without
which the class's own defaults do not validate), and the classes that cannot be built as a tiny text
LM here, with the reason."""

ROPE = {"rope_type": "default", "rope_theta": 10000.0}

OVERRIDES: dict[str, dict] = {
    # hybrid stacks: one layer of each kind (the defaults' periods put attention past layer 2)
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"]),  # weights tied over 2 hybrids
    "lfm2_moe": dict(_layers=3, num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "dory": dict(
        num_hidden_layers=3,
        n_input_layers=1,
        n_recurrent_layers=1,
        n_output_layers=1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    # layers 1-2 looped: sliding and full layers inside and outside the loop (four layer classes)
    "inkling2_loop_text": dict(
        _layers=4,
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=3,
        loop_num_passes=2,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # the default is all attention; checkpoints mix convs in
    # a sparse (lightning-indexer) layer next to a full one; 2 of the 4 key blocks selected
    "minimax_m3_vl_text": dict(layer_types=["minimax_m3_sparse", "full_attention"], index_topk_blocks=2),
    "mllama": dict(cross_attention_layers=[1]),
    "flint": dict(mlp_only_layers=[0]),
    "nllb-moe": dict(encoder_sparse_step=2, decoder_sparse_step=2),
    "switch_transformers": dict(num_sparse_encoder_layers=1, num_sparse_decoder_layers=1),
    "cohere_compass_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": ROPE, "full_attention": ROPE},
    ),
    "qwen4_exp_text": dict(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4
    ),
    # defaults that do not build a model at all
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1),
    "dbrx": dict(attn_config={"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0}),
    "deepseek_v2": dict(num_experts_per_tok=2, n_shared_experts=1),
    "longcat_flash": dict(head_dim=4),  # = qk_rope_head_dim
    "kolibri1_1": dict(head_dim=16),  # its K/V are rounded to NVFP4 in blocks of 16
    "blt": dict(use_cache=False),  # its cache asks BltConfig for num_hidden_layers, which it lacks
    "xlstm": dict(use_cache=False),  # the chunkwise kernel's initial states from the cache have the wrong shape
    "mamba2": dict(head_dim=16),  # num_heads x head_dim = expand x hidden
    # training needs the length (13) to be a multiple of the chunk lengths and the axial position shape's product
    "reformer": dict(
        is_decoder=True,
        attn_layers=["local", "lsh"],
        axial_pos_shape=[1, 13],
        axial_pos_embds_dim=[16, 16],
        local_attn_chunk_length=13,
        lsh_attn_chunk_length=13,
        num_buckets=2,
    ),
    "xmod": dict(_call=("set_default_language", "en_XX")),  # adapters are chosen by language
    "musicgen": dict(num_codebooks=1, _labels="codebooks"),  # labels [batch, length, codebooks]
    "musicgen_melody": dict(num_codebooks=1, _labels="codebooks"),
    "encoder-decoder": dict(pad_token_id=0, decoder_start_token_id=1),
    # its sliding layers' MLA sizes come from swa_* arguments; widths as released, 1/16: q/k 192 + 64, v 128
    "dots3_note_text": dict(
        num_key_value_heads=4,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=4,
        swa_q_lora_rank=16,
        swa_kv_lora_rank=16,
        swa_head_dim=16,
        swa_qk_nope_head_dim=12,
        swa_v_head_dim=8,
    ),
    "vibevoice_asr": dict(
        acoustic_tokenizer_encoder_config={"num_filters": 2, "depths": [1] * 7},
        semantic_tokenizer_encoder_config={"num_filters": 2, "depths": [1] * 7},
    ),
    "nemo_speechlm": dict(
        audio_config={"diarization_config": {"head_config": {"audio_hidden_size": 32}}},
        text_config={"layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"]},
    ),
}
# the mapping's composite model types whose causal-LM class is built from the text config
OVERRIDES["qwen4_exp"] = OVERRIDES["qwen4_exp_text"]
OVERRIDES["dots3_note"] = OVERRIDES["dots3_note_text"]

# variants "<model_type>:<name>": a structure the defaults leave off, switched on (the sample's parity rows for
# fixes that only show with it); their overrides apply after the model type's own
VARIANTS: dict[str, dict] = {
    "phi:qk_layernorm": dict(qk_layernorm=True),  # LayerNorm on q / k per head: a replicated weight under TP
    "olmo:clip_qkv": dict(clip_qkv=0.05),  # q / k / v clamped in place after their (column-parallel) projections
    "cohere:use_qk_norm": dict(use_qk_norm=True),  # per-head norm weights [heads, head_dim]
    # a decoder self-attention whose module says is_causal=False while its mask is causal (as NLLB-MoE's)
    "marian:decoder_is_causal_false": dict(_attrs={"model.decoder.layers.*.self_attn": {"is_causal": False}}),
    # the same under eager attention, which always follows the mask: sharded by the mask, keys from the decoder
    "marian:decoder_is_causal_false_eager": dict(
        _attrs={"model.decoder.layers.*.self_attn": {"is_causal": False}}, _attn="eager"
    ),
    "t5gemma:no_softcap": dict(encoder={"attn_logit_softcapping": None}, decoder={"attn_logit_softcapping": None}),
    # Nemotron-H with 2 head groups (released: 8), so that its Mamba2 mixers split by groups at sp=2
    "nemotron_h:two_groups": dict(n_groups=2),
    # Llama 4 with its NoPE layer's query scale changing every 4 tokens (released: 8192), so that it bites
    "llama4:floor_scale_4": dict(floor_scale=4),
}

# (status, reason): UNBUILDABLE (cannot be built here) or NOT-A-TEXT-LM (built, but it is not a model that
# trains on a batch of token ids)
UNBUILDABLE: dict = {
    "gemma3n": (
        "UNBUILDABLE",
        "needs the optional dependency timm (its vision tower is a TimmWrapperModel); its "
        "text model is Gemma3nForCausalLM (row gemma3n_text)",
    ),
    "gemma4_assistant": (
        "NOT-A-TEXT-LM",
        "a speculative-decoding drafter: its forward requires inputs_embeds and the target model's shared_kv_states",
    ),
    "gemma4_unified_assistant": (
        "NOT-A-TEXT-LM",
        "a speculative-decoding drafter: its forward requires inputs_embeds and the target model's shared_kv_states",
    ),
    "git": (
        "NOT-A-TEXT-LM",
        "an image-captioning decoder: its loss drops the first num_image_tokens logits "
        "(logits[:, num_image_tokens:-1]), so a batch without pixel_values has no logits left",
    ),
    "voxtral_realtime": (
        "NOT-A-TEXT-LM",
        "a streaming speech recogniser: its encoder takes input_features only, there is no text source",
    ),
}
