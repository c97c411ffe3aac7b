"""The released checkpoints' shape ratios that shrinking by field name alone would lose, decided by the
config's attributes (never by the model's name); tiny.shrink applies them.

- KV-shared layers: a config with `num_kv_shared_layers` gets some (its layers: every kind of layer twice,
  the second half reading the first half's K/V, as Gemma 3n / Gemma 4 checkpoints do).
- Per-layer head widths (`per_layer_config`: Gemma 4's wider global heads) keep their ratio to the
  config-wide value they override (512 vs 256 -> 16 vs 8), placed on the tiny layers of the same kind.
- Rotary widths given in channels (`rotary_dim`) keep their fraction of the head; `partial_rotary_factor`
  is a fraction already and is kept as the defaults have it.
- RoPE's `original_max_position_embeddings` keeps its ratio to `max_position_embeddings`, clamped to
  [ROPE_ORIGINAL_MIN, positions]: the padded batch (13 tokens) passes it while a shard of it does not, so
  rope types that choose their frequencies by length (longrope, yarn, llama3) are checked where it matters.

`describe(config)` writes the structure the tiny model keeps in a few words, recorded with every row of
the sweep: a change in it shows up as a changed row.
"""

from __future__ import annotations

ROPE_ORIGINAL_MIN = 8  # > a 2-way shard of the padded batch (7), < the batch (13)


def kv_shared(everything: dict, fields: dict | None, n: int) -> tuple[int, dict]:
    """(layer count, overrides) giving a config that declares num_kv_shared_layers some shared layers."""
    if "num_kv_shared_layers" not in everything or (fields is not None and "num_kv_shared_layers" not in fields):
        return n, {}
    types = everything.get("layer_types")
    if not isinstance(types, list) or not types:
        n = max(n, 2)
        return n, {"num_kv_shared_layers": n // 2}
    kinds = list(dict.fromkeys(types))  # in the order the defaults first use them (Gemma: sliding, then full)
    if kinds[-1] != types[-1]:  # the defaults' last kind stays last (Gemma 4 forces a full layer last)
        kinds = [k for k in kinds if k != types[-1]] + [types[-1]]
    return 2 * len(kinds), {"layer_types": kinds * 2, "num_kv_shared_layers": len(kinds)}


def per_layer_config(everything: dict, tiny: dict, layer_types: list | None) -> dict:
    """`per_layer_config` for the tiny layers: each layer gets the defaults' override of its kind, every
    int in it scaled by the ratio of the tiny config-wide value to the default one."""
    overrides = everything.get("per_layer_config")
    old_types = everything.get("layer_types")
    if not isinstance(overrides, dict) or not overrides or not isinstance(old_types, list) or not layer_types:
        return {}
    if not all(
        k.endswith("head_dim") or k == "num_key_value_heads"
        for v in overrides.values()
        if isinstance(v, dict)
        for k in v
    ):
        return {}  # other per-layer sizes come from arguments of their own (dots3's swa_*: overrides.py)
    by_kind = {}
    for index, values in overrides.items():
        i = int(index)
        if i < len(old_types) and isinstance(values, dict):
            by_kind.setdefault(old_types[i], values)
    out = {}
    for i, kind in enumerate(layer_types):
        if kind not in by_kind:
            continue
        scaled = {}
        for key, value in by_kind[kind].items():
            base, now = everything.get(key), tiny.get(key, everything.get(key))
            if isinstance(value, int) and isinstance(base, int) and isinstance(now, int) and base > 0:
                value = max(1, round(value * now / base))
                value += value % 2 if key.endswith("head_dim") else 0  # rotary halves stay whole
            scaled[key] = value
        out[str(i)] = scaled
    return {"per_layer_config": out}


def rotary_dim(everything: dict, tiny_head: int) -> dict:
    """`rotary_dim` (channels) as the same fraction of the tiny head as of the default one (GPT-J: 64 of 256)."""
    dim = everything.get("rotary_dim")
    heads = next((everything[k] for k in ("num_attention_heads", "n_head") if isinstance(everything.get(k), int)), 0)
    hidden = next((everything[k] for k in ("hidden_size", "n_embd") if isinstance(everything.get(k), int)), 0)
    head = (
        everything.get("head_dim") if isinstance(everything.get("head_dim"), int) else (hidden // heads if heads else 0)
    )
    if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0 or not head:
        return {}
    tiny = max(2, round(dim * tiny_head / head / 2) * 2)
    return {"rotary_dim": min(tiny, tiny_head)}


def rope(value, max_positions: int | None, positions: int):
    """A rope_parameters dict (per layer kind, nested, too) with original_max_position_embeddings at the
    defaults' ratio to max_position_embeddings, clamped (see the module's docstring)."""
    if not isinstance(value, dict):
        return value
    out = {k: rope(v, max_positions, positions) if isinstance(v, dict) else v for k, v in value.items()}
    if isinstance(out.get("original_max_position_embeddings"), int):
        out["original_max_position_embeddings"] = original_positions(
            out["original_max_position_embeddings"], max_positions, positions
        )
    return out


def original_positions(original: int, max_positions: int | None, positions: int) -> int:
    ratio = original / max_positions if isinstance(max_positions, int) and max_positions > 0 else 1.0
    return max(ROPE_ORIGINAL_MIN, min(positions, round(ratio * positions)))


def describe(config) -> str:
    """The tiny model's structure in a few words (windows, partial rotary, KV sharing, head widths, position
    table), of the text config."""
    c = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    parts = []
    windows = sorted(
        {
            v
            for k in (
                "sliding_window",
                "attention_chunk_size",
                "window_size",
                "attention_window",
                "sliding_window_size",
                "local_attention",
                "attention_window_size",
            )
            if isinstance(v := _get(c, k, None), int) and not isinstance(v, bool) and v > 0
        }
    )
    types = _get(c, "layer_types", None)
    if windows:
        kinds = (
            "/".join(sorted(set(types))) if isinstance(types, list) and all(isinstance(t, str) for t in types) else ""
        )
        parts.append(f"window {','.join(map(str, windows))}" + (f" ({kinds})" if kinds else ""))
    factors = _find(_get(c, "rope_parameters", None), "partial_rotary_factor")
    factors += [v for k in ("partial_rotary_factor", "rotary_pct") if isinstance(v := _get(c, k, None), float)]
    if any(f < 1 for f in factors):
        parts.append(f"partial rotary {min(factors):g}")
    if isinstance(_get(c, "rotary_dim", None), int):
        parts.append(f"rotary_dim {c.rotary_dim}")
    shared = _get(c, "num_kv_shared_layers", None)
    if isinstance(shared, int) and shared > 0:
        parts.append(f"kv-shared {shared}/{_get(c, 'num_hidden_layers', '?')}")
    widths = {k: v for k in ("head_dim", "qk_head_dim", "v_head_dim") if isinstance(v := _get(c, k, None), int)}
    if len(set(widths.values())) > 1:
        names = {"head_dim": "head", "qk_head_dim": "qk", "v_head_dim": "v"}
        parts.append("widths " + " ".join(f"{names[k]} {v}" for k, v in widths.items()))
    for k in ("max_position_embeddings", "n_positions", "max_target_positions"):
        if isinstance(v := _get(c, k, None), int):
            parts.append(f"positions {v}")
            break
    originals = _find(_get(c, "rope_parameters", None), "original_max_position_embeddings")
    if originals:
        parts.append(f"rope original {min(originals)}")
    return ", ".join(parts)


def _get(config, key: str, default=None):
    """An attribute, or `default` where reading it raises (a per-layer attribute of a heterogeneous config)."""
    try:
        return getattr(config, key, default)
    except Exception:  # noqa: BLE001
        return default


def _find(value, key: str) -> list:
    if not isinstance(value, dict):
        return []
    found = [value[key]] if isinstance(value.get(key), (int, float)) and not isinstance(value.get(key), bool) else []
    return found + [x for v in value.values() for x in _find(v, key)]
