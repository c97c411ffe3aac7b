"""Where a Model's sizes come from: a known name or a transformers config.json, refused unless it
describes the family the planner counts (memory.py: a Llama-like decoder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import checks
from .memory import Model

# Sizes of models people train long contexts with (no download needed).
KNOWN: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256, tied=False),
    "llama-3.2-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256, tied=True),
    "llama-3.2-3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, ffn=8192, vocab=128256, tied=True),
    "qwen3-8b": dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=12288, vocab=151936, tied=False),
    "mistral-7b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=32768, tied=False),
    # benchmarks/longest_sequence.py: bench-44m on CPU, bench-155m on GPU
    "bench-44m": dict(hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, ffn=1408, vocab=32000, tied=False),
    "bench-155m": dict(hidden=1024, layers=8, heads=16, kv_heads=4, head_dim=64, ffn=2816, vocab=32000, tied=False),
}
# Model field -> config.json key (transformers' names for the Llama-like families)
KEYS = dict(
    hidden="hidden_size",
    layers="num_hidden_layers",
    heads="num_attention_heads",
    kv_heads="num_key_value_heads",
    head_dim="head_dim",
    ffn="intermediate_size",
    vocab="vocab_size",
    tied="tie_word_embeddings",
)
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
FAMILY = (
    "the planner models decoder-only transformers with Llama's layer (RMSNorm, rotary positions, a gated MLP, "
    "grouped-query attention: Llama, Mistral, Qwen2/3 and alike) and reads "
    + ", ".join(REQUIRED)
    + " (num_key_value_heads, head_dim, tie_word_embeddings optional)"
)
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")  # mixture-of-experts MLPs


def load_model(name: str) -> Model:
    """A known size by name, or a config.json (or a folder holding one). ValueError names what is wrong."""
    if name in KNOWN:
        return Model(**KNOWN[name])
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(
            f"{name!r}: not a config.json (or a folder with one) and not one of {', '.join(KNOWN)}; "
            "pass a transformers config file, or a known name with --hidden/--layers/... to change sizes"
        )
    return from_config(read_json(path), str(path))


def read_json(path: Path) -> dict:
    """A JSON object from a file, or ValueError saying why not (unreadable, not JSON, not an object)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (not UTF-8), so not a JSON file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean"}.get(type(data), "a number or null")
        raise ValueError(f"{path}: holds {kind}, not a JSON object of keys")
    return data


def from_config(config: dict, source: str = "config") -> Model:
    """The sizes in a transformers config (its text_config for a multimodal one), checked against the family
    the planner counts. Errors name the key and `source`."""
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise ValueError(f"{source}: text_config is not an object of config keys")
    where = source + (" (text_config)" if text is not config else "")
    if config.get("is_encoder_decoder") or text.get("is_encoder_decoder"):
        raise ValueError(f"{where}: an encoder-decoder model (is_encoder_decoder: true); {FAMILY}")
    missing = [k for k in REQUIRED if text.get(k) is None]
    if missing:
        raise ValueError(f"{where}: no {', '.join(missing)}; {FAMILY}")
    experts = {k: text[k] for k in EXPERT_KEYS if text.get(k)}
    if experts:
        raise ValueError(
            f"{where}: a mixture of experts ({', '.join(f'{k}: {v}' for k, v in experts.items())}), "
            f"whose MLPs the planner does not count; {FAMILY}"
        )
    if text.get("rms_norm_eps") is None and (text.get("layer_norm_eps") or text.get("layer_norm_epsilon")):
        raise ValueError(f"{where}: LayerNorm (layer_norm_eps, no rms_norm_eps), not Llama's layer; {FAMILY}")
    sizes: dict[str, Any] = {field: text.get(key) for field, key in KEYS.items()}  # checked below
    heads = sizes["heads"]
    checks.positive_int(f"{where}: {KEYS['heads']}", heads, checks.MEANING["heads"])
    sizes["kv_heads"] = sizes["kv_heads"] or heads
    if sizes["head_dim"] is None:
        checks.positive_int(f"{where}: {KEYS['hidden']}", sizes["hidden"], checks.MEANING["hidden"])
        if sizes["hidden"] % heads:
            raise ValueError(
                f"{where}: {KEYS['hidden']} {sizes['hidden']}: not a multiple of num_attention_heads "
                f"{heads}, and no head_dim says the size of a head"
            )
        sizes["head_dim"] = sizes["hidden"] // heads
    sizes["tied"] = sizes["tied"] if sizes["tied"] is not None else False
    try:
        checks.model_sizes(sizes, name_of=KEYS.get)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return Model(**sizes)
