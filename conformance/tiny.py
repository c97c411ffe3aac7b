"""Tiny fp32 models of every class in transformers' causal-LM and seq2seq-LM auto mappings.

`build_tiny(model_type, class_name)` starts from the config class's defaults and shrinks every size
by the name of the field (hidden 32, 2 layers, 4 heads / 2 kv heads, small FFNs and experts,
vocab 128, position tables 128, windows 4, ...), recursing into sub-configs (text_config, ...).
Per-layer lists are cut to the new layer count keeping one layer of each kind, so a 6:1
sliding:full pattern still has a full-attention layer. Optional sliding windows are switched on
(window 4: released checkpoints use them, and a window is what can go wrong); latent-attention
configs get as many kv heads as heads (as their checkpoints say), and head widths keep their released
proportions (v narrower than q/k stays so: WIDTH_GROUPS). Dropout and stochastic routing are
off; every weight gets a small random perturbation so that zero-initialised gates, convolutions or
residual scales do not hide a mixing path. overrides.py holds what the name rules cannot know (hybrid
layer patterns, defaults that do not build); a class that cannot be built raises `Unbuildable` with
the reason. The attention is sdpa where the class supports it, else eager.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import transformers
from transformers import CONFIG_MAPPING
from transformers.configuration_utils import PreTrainedConfig
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)

from . import released

VOCAB = 128
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 4, 2, 8, 2
FFN, MOE_FFN, EXPERTS, TOP_K, WINDOW = 64, 32, 4, 2, 4
POSITIONS = 32  # position tables as small as the batches allow: the longest (the packed row) has 25 tokens
SPECIAL_IDS = 16  # ids VOCAB-16 .. VOCAB-1 are kept for special / modality tokens; batches draw 3 .. VOCAB-17

# field name -> tiny value (ints); only applied to fields that hold an int larger than the value
# (or, for kv heads / windows, any int), so that flags and small settings stay as the defaults have them
SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "emb_dim", "embedding_dim", "dim",
                     "word_embed_proj_dim", "attention_hidden_size", "lru_width", "embedding_size",
                     "input_embedding_size", "output_embedding_size", "backbone_hidden_size", "ple_embed_dim",
                     "lang_embed_dim", "spkr_embed_dim", "unit_embed_dim", "pronunciation_embed_dim",
                     "shape_embed_dim", "hidden_dim", "hidden_size_global"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "attention_heads", "num_decoder_attention_heads",
                     "num_encoder_attention_heads", "swa_num_attention_heads", "speech_encoder_attention_heads",
                     "t2u_encoder_attention_heads", "t2u_decoder_attention_heads", "linear_num_heads",
                     "linear_num_value_heads", "mamba_n_heads", "mamba_num_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "swa_num_key_value_heads",
                     "linear_num_key_heads", "num_query_groups", "index_n_heads"), KV_HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "attention_head_dim", "kv_channels", "d_head", "dim_head",
                     "attention_head_size", "swa_head_dim", "linear_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "v_head_dim", "qk_head_dim", "index_head_dim", "d_rel"), HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
                     "d_inner", "dff", "dim_ff", "ffn_hidden_size", "intermediate_size_mlp", "dense_intermediate_size",
                     "feed_forward_size", "speech_encoder_intermediate_size", "t2u_encoder_ffn_dim",
                     "t2u_decoder_ffn_dim", "mamba_d_ssm"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
                     "moe_shared_expert_intermediate_size", "shared_intermediate_size", "expert_ffn_hidden_size",
                     "router_hidden_size"), MOE_FFN),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token", "top_k"), TOP_K),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "zero_expert_num"), 1),
    **dict.fromkeys(("n_group", "num_expert_group"), 2),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"), 1),  # 1 dense, then MoE
    **dict.fromkeys(("topk_group",), 1),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_source_positions",
                     "max_target_positions", "max_seq_len", "context_length", "max_encoder_position_embeddings",
                     "max_decoder_position_embeddings", "t2u_max_position_embeddings", "model_max_length",
                     "max_inference_chunksize", "rel_extent", "position_bias_max_distance"), POSITIONS),
    **dict.fromkeys(("sliding_window", "window_size", "attention_window_size", "sliding_window_size",
                     "local_attention_window_len", "keep_window_size", "local_attention", "attention_window",
                     "attention_chunk_size", "local_radius"), WINDOW),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "o_lora_rank", "adapter_rank", "laurel_rank", "gated_norm_rank",
                     "hc_lowrank", "loop_gate_rank", "prompt_mid_dim", "hidden_size_per_layer_input"), 16),
    **dict.fromkeys(("rotary_dim",), HEAD_DIM // 2),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 4),
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size"), 8),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 16),  # 4 heads x 16 = 2 x hidden
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), 4),
    **dict.fromkeys(("chunk_size", "mamba_chunk_size"), 8),
    **dict.fromkeys(("n_groups", "mamba_n_groups", "mamba_ngroups", "o_groups"), 1),
    **dict.fromkeys(("index_topk", "index_topk_blocks"), 4),
    **dict.fromkeys(("index_block_size", "block_size", "lsh_attn_chunk_length", "local_attn_chunk_length",
                     "global_block_size", "patch_size"), 4),
    **dict.fromkeys(("expert_capacity",), 64),
    **dict.fromkeys(("num_global_tokens", "prompt_length", "prompt_types", "segment_types",
                     "position_bias_num_buckets", "num_centroids", "centroid_intermediate_top_k"), 8),
    **dict.fromkeys(("num_mel_bins",), 16),
}
# Head widths shrunk together, keeping their released proportions (multi-head latent attention's q/k =
# nope + rope vs v: DeepSeek-V3 128 + 64 vs 128 -> 8 + 4 vs 8; q/k and v widths of their own: MiMo-V2 192 vs
# 128 -> 12 vs 8): divided by their common divisor, in units of WIDTH_UNIT (rotary widths stay even). The
# first group whose leading field the config has applies; equal widths are left to SIZES.
WIDTH_UNIT = HEAD_DIM // 2
WIDTH_GROUPS = (("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), ("head_dim", "v_head_dim"))
ALWAYS = {"num_key_value_heads", "num_kv_heads", "multi_query_group_num", "num_query_groups", "sliding_window",
          "window_size", "attention_window_size", "sliding_window_size", "local_attention_window_len",
          "keep_window_size", "local_attention", "attention_window", "attention_chunk_size", "local_radius", "n_group",
          "topk_group", "num_expert_group"}
FILL_NONE = {"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS}
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
              "num_decoder_layers", "num_encoder_layers", "num_blocks", "speech_encoder_layers", "t2u_encoder_layers",
              "t2u_decoder_layers", "num_layers_per_stack", "n_recurrent_layers")
ZERO = ("dropout", "_pdrop", "layerdrop", "jitter", "drop_rate", "dropout_p", "dropout_rate", "noise",
        "moe_token_dropout", "mask_time_prob", "mask_feature_prob", "summary_first_dropout")
SPECIAL = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id",
           "mask_token_id", "forced_eos_token_id", "forced_bos_token_id", "unk_token_id", "eod_token_id")


class Unbuildable(Exception):
    """The class cannot be built as a tiny text LM here (the message says why); `status` is UNBUILDABLE
    or NOT-A-TEXT-LM."""

    def __init__(self, reason: str, status: str = "UNBUILDABLE"):
        super().__init__(reason)
        self.status = status


def mapping_classes() -> list[tuple[str, str, str]]:
    """(model_type, class name, mapping) for every entry of both auto mappings."""
    rows = [(mt, cls, "causal") for mt, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()]
    rows += [(mt, cls, "seq2seq") for mt, cls in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.items()]
    return rows


def _scaled(values: list[int], total: int) -> list[int]:
    """An integer list of the same length summing to `total`, roughly proportional (mrope sections)."""
    s = sum(values) or 1
    out = [max(1, v * total // s) for v in values]
    out[-1] += total - sum(out)
    return out


def _cut(values: list, n: int) -> list:
    """A per-layer list cut to n entries, keeping each distinct entry (in its first position's order)."""
    firsts, seen = [], []
    for i, v in enumerate(values):
        key = repr(v)
        if key not in seen:
            seen.append(key)
            firsts.append(i)
    keep = sorted(firsts)[:n]
    rest = [i for i in range(len(values)) if i not in keep]
    return [values[i] for i in sorted(keep + rest[: max(0, n - len(keep))])]


def _distinct(values: list) -> int:
    return len({repr(v) for v in values})


def _fields(config_class) -> dict | None:
    """Declared fields and their defaults; None for configs with their own __init__ (all keys count)."""
    try:
        return {f.name: f.default for f in dataclasses.fields(config_class)}
    except TypeError:
        return None


def shrink(config: PreTrainedConfig, layers: int | None = None) -> dict:
    """Keyword overrides that make `config` (a default instance) tiny. Values derived in
    `__post_init__` (fields defaulting to None, attributes that are not fields: head_dim from the
    hidden size, qk_head_dim, ...) are left to be derived again from the shrunk ones."""
    # keys under the names the constructor takes (to_dict writes attribute_map targets: num_local_experts
    # for Qwen3-MoE's num_experts field)
    aliases = {v: k for k, v in (getattr(type(config), "attribute_map", None) or {}).items()}
    fields = _fields(type(config))
    everything = {(aliases[k] if fields is not None and k not in fields and aliases.get(k) in fields else k): v
                  for k, v in config.to_dict().items()}
    values = everything if fields is None else {
        k: v for k, v in everything.items() if k in fields and (fields[k] is not None or k in ALWAYS)}
    out = {}
    old_layers = {v for k, v in everything.items() if k in LAYER_KEYS and isinstance(v, int) and v > 2}
    # per-layer lists (layer types, no-rope flags, per-layer heads), derived ones too: cut, not re-derived,
    # so that every kind of layer survives the cut
    per_layer = [k for k, v in everything.items() if isinstance(v, list) and len(v) in old_layers
                 and (fields is None or k in fields)]
    n = layers or max([LAYERS] + [min(4, _distinct(everything[k])) for k in per_layer
                                  if all(isinstance(x, str) for x in everything[k])])
    shared_n, shared = released.kv_shared(everything, fields, n)  # KV-shared layers: every kind twice
    if layers is None:
        n = shared_n
    elif shared_n != n:
        shared = {"num_kv_shared_layers": n // 2} if shared else {}
    for key in per_layer:
        values.setdefault(key, everything[key])
    # optional sliding windows switched on (released checkpoints use them; the window path is what can go wrong)
    if fields is not None and "use_sliding_window" in fields:
        out["use_sliding_window"] = True
        out["sliding_window"] = WINDOW
        if "max_window_layers" in fields:  # Qwen2: layers >= it slide; Qwen2-MoE: layers < it (odd ones) slide
            out["max_window_layers"] = 1
        values.pop("layer_types", None)  # derived from the flag
        per_layer = [k for k in per_layer if k != "layer_types"]
    elif fields is not None and "sliding_window" in fields and everything.get("sliding_window") is None:
        out["sliding_window"] = WINDOW
    for key, value in FILL_NONE.items():  # left None by defaults that then fail to build (Ministral, Nemotron)
        if key in everything and everything[key] is None and (fields is None or key in fields):
            out[key] = value
    if everything.get("is_encoder_decoder") and getattr(config, "decoder_start_token_id", None) is None:
        out["decoder_start_token_id"] = everything.get("pad_token_id") or 0  # T5's convention: start = pad
    for key, value in values.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, dict) and key.endswith("_config") and isinstance(getattr(config, key, None),
                                                                               PreTrainedConfig):
            continue  # sub-configs: see build_config
        if isinstance(value, float) and any(z in key for z in ZERO):
            out[key] = 0.0
        elif key in LAYER_KEYS and isinstance(value, int) and value > n:
            out[key] = n
        elif key in SIZES and isinstance(value, int) and (value > SIZES[key] or (key in ALWAYS and value > 0)):
            out[key] = SIZES[key]
        elif "vocab" in key and isinstance(value, int) and value > VOCAB:
            out[key] = VOCAB
        elif key in per_layer:
            out[key] = _cut(value, n)
            if key in SIZES and all(isinstance(x, int) for x in value):  # per-layer widths (Gemma 3n's FFN)
                out[key] = [min(x, SIZES[key]) for x in out[key]]
        elif key == "rope_parameters" and isinstance(value, dict):
            rope = dict(value)
            if isinstance(rope.get("mrope_section"), list):
                rope["mrope_section"] = _scaled(rope["mrope_section"], HEAD_DIM // 2)
            out[key] = rope
    out.update(_head_widths(values))
    out.update(_released(everything, fields, out, shared))
    # special ids inside the vocabulary; modality tokens at its end, away from the ids batches draw
    spare = iter(range(VOCAB - 1, VOCAB - SPECIAL_IDS, -1))
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or not (key.endswith(("_token_id", "_token_index",
                                                                                       "_id")) or key in SPECIAL):
            continue
        if value >= VOCAB:
            known = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0,
                     "forced_eos_token_id": 2, "eod_token_id": 2}
            out[key] = known[key] if key in known else next(spare)
    if everything.get("kv_lora_rank") and "num_key_value_heads" in everything:
        out["num_key_value_heads"] = HEADS  # multi-head latent attention: k has every head (as checkpoints say)
    eos = values.get("eos_token_id")
    if isinstance(eos, list):
        out["eos_token_id"] = [e if e < VOCAB else 2 for e in eos][:2]
    return out


def _released(everything: dict, fields: dict | None, out: dict, shared: dict) -> dict:
    """The released ratios of released.py: KV-shared layers, per-layer overrides, rotary_dim, RoPE's
    original length."""
    extra = dict(shared)
    positions = next((v for k, v in everything.items() if k in ("max_position_embeddings", "n_positions",
                                                                   "max_seq_len") and isinstance(v, int)), None)
    tiny_positions = min(positions, POSITIONS) if positions else POSITIONS
    rope = out.get("rope_parameters", everything.get("rope_parameters"))
    if isinstance(rope, dict) and (fields is None or "rope_parameters" in fields):
        scaled = released.rope(rope, positions, tiny_positions)
        if scaled != rope or "rope_parameters" in out:
            extra["rope_parameters"] = scaled
    original = everything.get("original_max_position_embeddings")
    if isinstance(original, int) and (fields is None or "original_max_position_embeddings" in fields):
        extra["original_max_position_embeddings"] = released.original_positions(original, positions, tiny_positions)
    head = out.get("head_dim") if isinstance(out.get("head_dim"), int) else HEAD_DIM
    if fields is None or "rotary_dim" in fields:
        extra.update(released.rotary_dim(everything, head))
    types = extra.get("layer_types", out.get("layer_types"))
    if fields is None or "per_layer_config" in fields or "per_layer_config" in everything:
        extra.update(released.per_layer_config(everything, {**out, **extra}, types))
    return extra


def _head_widths(values: dict) -> dict:
    """The tiny head widths of the first of WIDTH_GROUPS the config has (see there); {} for none, or for
    widths that are all equal (SIZES shrinks those)."""
    for group in WIDTH_GROUPS:
        widths = {k: values[k] for k in group if type(values.get(k)) is int}
        if group[0] not in widths:
            continue
        if len(set(widths.values())) < 2:
            return {}
        unit = math.gcd(*widths.values())
        return {k: v // unit * WIDTH_UNIT for k, v in widths.items()}
    return {}


def _sub_configs(config_class) -> dict:
    """key -> (config class, spec init kwargs, spec is Auto) of a composite config's sub-configs."""
    specs = dict(getattr(config_class, "sub_configs_defaults", None) or {})
    out = {k: (v.config_class, v.init_kwargs, not (isinstance(v.config_class, type) and
                                                    issubclass(v.config_class, PreTrainedConfig)))
           for k, v in specs.items()}
    for key, cls in (getattr(config_class, "sub_configs", None) or {}).items():
        out.setdefault(key, (cls, {}, not (isinstance(cls, type) and issubclass(cls, PreTrainedConfig))))
    return out


def tiny_kwargs(config: PreTrainedConfig, layers: int | None = None, overrides: dict | None = None) -> dict:
    """Keyword arguments of the tiny version of `config`, sub-configs (nested) as dicts."""
    overrides = dict(overrides or {})
    kwargs = shrink(config, layers)
    for key, (cls, init_kwargs, auto) in _sub_configs(type(config)).items():
        sub = getattr(config, key, None)
        if not isinstance(sub, PreTrainedConfig):
            continue
        sub_kwargs = {**init_kwargs, **tiny_kwargs(sub, layers, overrides.pop(key, None))}
        if auto:
            sub_kwargs["model_type"] = sub.model_type
        kwargs[key] = sub_kwargs
    kwargs.update(overrides)
    return kwargs


def build_config(model_type: str, overrides: dict | None = None, config_class=None) -> PreTrainedConfig:
    """The tiny config of `model_type` (or of `config_class`, the model class's own, e.g. the text
    config of a composite model type): defaults, shrunk, sub-configs shrunk, then `overrides`
    (a dict for a sub-config updates that sub-config's arguments)."""
    config_class = config_class or CONFIG_MAPPING[model_type]
    overrides = dict(overrides or {})
    layers = overrides.pop("_layers", None)
    defaults = overrides.pop("_defaults", {})  # arguments without which the defaults do not even validate
    try:
        default = config_class(**defaults)
    except Exception as exc:  # noqa: BLE001
        raise Unbuildable(f"{config_class.__name__}'s defaults do not validate: {_first_line(exc)}") from exc
    return config_class(**tiny_kwargs(default, layers, overrides))


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {' / '.join(lines[:2])}"[:300]


def base_type(model_type: str) -> str:
    """The transformers model type of a sweep entry ("phi:qk_layernorm" is a variant of "phi")."""
    return model_type.partition(":")[0]


def _family_overrides(model_type: str) -> dict:
    """The model type's overrides, then its variant's (overrides.VARIANTS)."""
    from .overrides import OVERRIDES, VARIANTS
    out = dict(OVERRIDES.get(base_type(model_type), {}))
    out.update(VARIANTS.get(model_type, {}))
    return out


def build_tiny(model_type: str, class_name: str, seed: int = 0, perturb: float = 0.02):
    """(model, note): the tiny fp32 model of `class_name` with attn_implementation sdpa where it is
    supported, else eager. Raises Unbuildable with the reason."""
    from .overrides import UNBUILDABLE
    if base_type(model_type) in UNBUILDABLE:
        status, reason = UNBUILDABLE[base_type(model_type)]
        raise Unbuildable(reason, status)
    model_class = getattr(transformers, class_name, None)
    if model_class is None:
        raise Unbuildable(f"transformers has no attribute {class_name}")
    overrides = _family_overrides(model_type)
    harness = {k: overrides.pop(k) for k in list(overrides) if k in ("_call", "_labels", "_attrs", "_attn")}
    config_class = getattr(model_class, "config_class", None)
    if not (isinstance(config_class, type) and issubclass(config_class, PreTrainedConfig)):
        config_class = None
    config = build_config(base_type(model_type), overrides, config_class)
    torch.manual_seed(seed)
    model, attn = None, None
    for attn in (harness["_attn"],) if "_attn" in harness else ("sdpa", "eager"):
        try:
            model = model_class._from_config(config, attn_implementation=attn, dtype=torch.float32)
            break
        except ValueError as exc:
            if "does not support" not in str(exc) and "sdpa" not in str(exc).lower():
                raise
    if model is None:
        raise Unbuildable(f"{class_name} supports neither sdpa nor eager attention")
    model = model.float()
    if "_call" in harness:
        method, *args = harness["_call"]
        getattr(model, method)(*args)
    for pattern, values in harness.get("_attrs", {}).items():  # module attributes no config sets
        import fnmatch
        for name, module in model.named_modules():
            if fnmatch.fnmatch(name, pattern):
                for key, value in values.items():
                    setattr(module, key, value)
    if perturb:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.add_(torch.randn(p.shape, generator=g) * perturb)
    n_params = sum(p.numel() for p in model.parameters())
    return model, {"attn": attn, "params": n_params, "labels": harness.get("_labels")}


def is_seq2seq(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


__all__ = ["build_tiny", "build_config", "base_type", "mapping_classes", "Unbuildable", "VOCAB", "SPECIAL_IDS", "is_seq2seq"]
