"""The SP-relevant structure of a model, as `models/inspection.inspect_model` finds and proves it: its
backbone, the attention modules and which sequences their queries and keys come from, position modules,
layer stacks (`ModelFamily`), and the structural helpers the proof uses (position modules, pad id).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from torch import nn


@dataclass
class AttentionModule:
    name: str
    module: nn.Module
    q_side: str | None  # "encoder" or "decoder": which sequence the queries come from (None: token-local)
    kv_side: str | None
    heads: int
    kv_heads: int
    pattern: tuple | None = None  # (causal, window) the unpatched model computes, proven at patch time


@dataclass
class PositionModule:
    side: str
    module: nn.Module
    kind: str  # "rotary": computed on the full positions, then sliced; "ids": looked up by position_ids;
    #            "m2m100": sinusoidal table indexed by padding-aware positions


@dataclass
class ModelFamily:
    kind: str  # "seq2seq" or "causal"
    pretrained: nn.Module  # the transformers model (a PeftModel's base model, or the model itself)
    backbone: nn.Module  # the module that turns token ids into hidden states: where sequences are sharded
    has_lm_head: bool  # pretrained computes logits (and a loss) on top of the backbone
    attention: list[AttentionModule]
    positions: list[PositionModule] = field(default_factory=list)
    layer_stacks: list[nn.Module] = field(default_factory=list)  # modules with `layers` (and maybe `layerdrop`)
    local_attention: list[AttentionModule] = field(default_factory=list)  # token-local calls, run as they are
    default_positions: str = "arange"  # models/default_positions.py: the positions the backbone makes itself
    head_post: object = None  # models/head.Post reproducing the model's logits after its head (None: do not tile)
    layer_inputs: dict = field(default_factory=dict)  # layer path -> its per-token inputs (models/tp_checks.py)
    inplace_outputs: set = field(default_factory=set)  # nn.Linear paths whose outputs the model writes in place
    packed_rows: dict = field(default_factory=dict)  # kind of packed batch -> why refused (models/packed_probe.py)
    dry_run_seconds: float = 0.0


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT (and similar) wrappers."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _refuse(name: str, why: str, fix: str):
    raise ValueError(f"seqpar_hf cannot shard {name}: {why}. {fix}")


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
                _refuse(name, f"its position embedding {path} ({cls}) does not take position ids, so shards "
                              "cannot be given their global positions", "Use a model whose positions are rotary or "
                                                                         "looked up by position id")
    return found


def _inside(module: nn.Module, ancestor: nn.Module) -> bool:
    return any(m is module for m in ancestor.modules())


def pad_token_id(config) -> int:
    """The pad id: the config's, else its text config's (composite vision / audio + text configs keep it
    there), else 0."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
    for c in (config, text):
        value = getattr(c, "pad_token_id", None) if c is not None else None
        if isinstance(value, int):
            return value
    return 0


def structure(pretrained, kind: str, backbone) -> tuple[list[PositionModule], list[nn.Module]]:
    """The position modules and layer stacks of the backbone the dry run found; refuses position modules
    that cannot get global positions."""
    encoder = backbone.get_encoder() if kind == "seq2seq" and hasattr(backbone, "get_encoder") else None
    positions = _positions(backbone, kind, type(pretrained).__name__, encoder)
    stacks = [m for m in backbone.modules() if hasattr(m, "layers") and isinstance(m.layers, nn.ModuleList)]
    return positions, stacks
