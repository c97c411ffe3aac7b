"""What a model's config and module tree show before any dry run: attention that spans the whole
sequence by construction (relative position biases other than T5's, ALiBi) is refused (soft-capping, sinks
and T5's bias are honoured, proven: proof/score_mods.py, relative_bias.py; queries scaled by their index,
proven: proof/temperature.py); the backbone's position modules and layer stacks are found
(models/families.py), and position modules that cannot be given global positions are refused. Every refusal
names the value, why, and the fix.
"""

from __future__ import annotations

import inspect

from torch import nn

from ..families import PositionModule
from . import temperature
from .relative_bias import computes_bias


def _refuse(name: str, why: str, fix: str):
    raise ValueError(f"seqpar_hf cannot shard {name}: {why}. {fix}")


def check_structure(model: nn.Module, config, name: str) -> None:
    """Refuse attention that spans the whole sequence by construction, read off the config and the modules."""
    tables = [(path, m) for path, m in model.named_modules() if hasattr(m, "relative_attention_bias")]
    other = [path for path, m in tables if not computes_bias(m)]
    if other or (not tables and getattr(config, "relative_attention_num_buckets", None) is not None):
        # a bias table without T5's compute_bias (T5's is proven by distance at the dry run: proof/relative_bias.py)
        where = f"{other[0]} ({type(model.get_submodule(other[0])).__name__})" if other else "its attention"
        _refuse(
            name,
            f"{where} adds a relative position bias other than T5's (a table by query-key distance, gathered by "
            "compute_bias(query_length, key_length, device, past_seen_tokens)): computed from the whole query-key "
            "distance matrix, which no rank holds under sequence parallelism",
            "T5, mT5, UMT5 and Switch Transformers work, as do models with rotary or absolute positions",
        )
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", "absolute") not in (
        "absolute",
        "rope",
        None,
    ):
        _refuse(
            name,
            "its attention uses ALiBi or relative-key position biases that span the whole sequence",
            "Use a model with rotary or absolute positions",
        )
    for path, module in model.named_modules():
        if temperature.tuned(module):  # past the dry run's lengths: it cannot see it (Llama 4's floor_scale is 8192)
            own = getattr(module, "config", None) or config.get_text_config()  # a VLM's text config holds it
            why = temperature.prove(module, own.hidden_size)
            if why is not None:
                _refuse(
                    name,
                    f"{path} scales its queries by their index counted from 0 in each call (attention temperature "
                    f"tuning of its NoPE layers: attn_temperature_tuning=True, floor_scale="
                    f"{getattr(module, 'floor_scale', '?')}), and {why}; every rank would count its shard from 0 "
                    "(silently wrong past floor_scale tokens)",
                    "Set config.attn_temperature_tuning = False before building the model (identical below "
                    "floor_scale tokens), or train without sequence parallelism",
                )


def _positions(backbone: nn.Module, kind: str, name: str, encoder) -> list[PositionModule]:
    found = []
    for path, module in backbone.named_modules():
        side = "encoder" if encoder is not None and _inside(module, encoder) else "decoder"
        cls = type(module).__name__
        if cls.endswith("RotaryEmbedding"):
            found.append(PositionModule(side, module, "rotary"))
        elif path.endswith("embed_positions"):
            params = inspect.signature(module.forward).parameters
            if "position_ids" in params:
                found.append(PositionModule(side, module, "ids"))
            elif cls.startswith(("M2M100", "NllbMoe")) and hasattr(module, "weights"):
                found.append(PositionModule(side, module, "m2m100"))
            else:
                _refuse(
                    name,
                    f"its position embedding {path} ({cls}) does not take position ids, so shards "
                    "cannot be given their global positions",
                    "Use a model whose positions are rotary or looked up by position id",
                )
    return found


def _inside(module: nn.Module, ancestor: nn.Module) -> bool:
    return any(m is module for m in ancestor.modules())


def structure(pretrained, kind: str, backbone) -> tuple[list[PositionModule], list[nn.Module]]:
    """The position modules and layer stacks of the backbone the dry run found; refuses position modules
    that cannot get global positions."""
    encoder = backbone.get_encoder() if kind == "seq2seq" and hasattr(backbone, "get_encoder") else None
    positions = _positions(backbone, kind, type(pretrained).__name__, encoder)
    stacks = [m for m in backbone.modules() if hasattr(m, "layers") and isinstance(m.layers, nn.ModuleList)]
    return positions, stacks
