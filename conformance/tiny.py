"""Tiny fp32 models of every class in transformers' causal-LM and seq2seq-LM auto mappings.

`build_tiny(model_type, class_name)` starts from the config class's defaults and shrinks every size
by the name of the field (sizes.py: hidden 32, 2 layers, 4 heads / 2 kv heads, small FFNs and experts,
vocab 128, position tables 32, windows 4, ...), recursing into sub-configs (text_config, ...), and
keeps the released checkpoints' ratios that names alone would lose (released.py: KV-shared layers,
per-layer head widths, rotary_dim, RoPE's original length).
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
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
)

from . import released
from .sizes import (
    ALWAYS,
    FILL_NONE,
    HEAD_DIM,
    HEADS,
    LAYER_KEYS,
    LAYERS,
    POSITIONS,
    SIZES,
    SOFTCAP,
    SPECIAL,
    SPECIAL_IDS,
    VOCAB,
    WIDTH_GROUPS,
    WIDTH_UNIT,
    WINDOW,
    ZERO,
)


class Unbuildable(Exception):
    """The class cannot be built as a tiny text LM here (the message says why); `status` is UNBUILDABLE
    or NOT-A-TEXT-LM."""

    def __init__(self, reason: str, status: str = "UNBUILDABLE"):
        super().__init__(reason)
        self.status = status


def mapping_classes() -> list[tuple[str, str, str]]:
    """(model_type, class name, mapping) for every entry of the text auto mappings, then of the
    image-text-to-text one (its rows run with images: conformance/images.py)."""
    rows = [(mt, cls, "causal") for mt, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()]
    rows += [(mt, cls, "seq2seq") for mt, cls in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.items()]
    rows += [(mt, cls, "image") for mt, cls in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()]
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
    everything = {
        (aliases[k] if fields is not None and k not in fields and aliases.get(k) in fields else k): v
        for k, v in config.to_dict().items()
    }
    values = (
        everything
        if fields is None
        else {k: v for k, v in everything.items() if k in fields and (fields[k] is not None or k in ALWAYS)}
    )
    out = {}
    old_layers = {v for k, v in everything.items() if k in LAYER_KEYS and isinstance(v, int) and v > 2}
    # per-layer lists (layer types, no-rope flags, per-layer heads), derived ones too: cut, not re-derived,
    # so that every kind of layer survives the cut
    per_layer = [
        k
        for k, v in everything.items()
        if isinstance(v, list) and len(v) in old_layers and (fields is None or k in fields)
    ]
    n = layers or max(
        [LAYERS]
        + [min(4, _distinct(everything[k])) for k in per_layer if all(isinstance(x, str) for x in everything[k])]
    )
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
    if everything.get("attn_logit_softcapping"):  # made to bite: tanh(score / cap) far from linear
        out["attn_logit_softcapping"] = SOFTCAP
    for key, value in FILL_NONE.items():  # left None by defaults that then fail to build (Ministral, Nemotron)
        if key in everything and everything[key] is None and (fields is None or key in fields):
            out[key] = value
    if everything.get("is_encoder_decoder") and getattr(config, "decoder_start_token_id", None) is None:
        out["decoder_start_token_id"] = everything.get("pad_token_id") or 0  # T5's convention: start = pad
    for key, value in values.items():
        if isinstance(value, bool):
            continue
        if (
            isinstance(value, dict)
            and key.endswith("_config")
            and isinstance(getattr(config, key, None), PreTrainedConfig)
        ):
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
        if (
            not isinstance(value, int)
            or isinstance(value, bool)
            or not (key.endswith(("_token_id", "_token_index", "_id")) or key in SPECIAL)
        ):
            continue
        if value >= VOCAB:
            known = {
                "pad_token_id": 0,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "decoder_start_token_id": 0,
                "forced_eos_token_id": 2,
                "eod_token_id": 2,
            }
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
    positions = next(
        (
            v
            for k, v in everything.items()
            if k in ("max_position_embeddings", "n_positions", "max_seq_len") and isinstance(v, int)
        ),
        None,
    )
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
    out = {
        k: (
            v.config_class,
            v.init_kwargs,
            not (isinstance(v.config_class, type) and issubclass(v.config_class, PreTrainedConfig)),
        )
        for k, v in specs.items()
    }
    for key, cls in (getattr(config_class, "sub_configs", None) or {}).items():
        out.setdefault(key, (cls, {}, not (isinstance(cls, type) and issubclass(cls, PreTrainedConfig))))
    return out


def tiny_kwargs(config: PreTrainedConfig, layers: int | None = None, overrides: dict | None = None) -> dict:
    """Keyword arguments of the tiny version of `config`, sub-configs (nested) as dicts."""
    overrides = dict(overrides or {})
    kwargs = shrink(config, layers)
    for key, (_cls, init_kwargs, auto) in _sub_configs(type(config)).items():
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
    except Exception as exc:
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
    perturbed(model, seed, perturb)
    n_params = sum(p.numel() for p in model.parameters())
    return model, {"attn": attn, "params": n_params, "labels": harness.get("_labels")}


def perturbed(model, seed: int, scale: float):
    """Seeded noise of std `scale` on every float weight (the same on every rank), so that no zero-initialised
    path hides; the model."""
    if scale:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def is_seq2seq(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


__all__ = [
    "SPECIAL_IDS",
    "VOCAB",
    "Unbuildable",
    "base_type",
    "build_config",
    "build_tiny",
    "is_seq2seq",
    "mapping_classes",
]
