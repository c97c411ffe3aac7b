"""The SP-relevant structure of a model, as `models/proof/inspection.inspect_model` finds and proves it: its
backbone, the attention modules and which sequences their queries and keys come from, position modules,
layer stacks (`ModelFamily`); what every other part reads of a patched model (and its pad id).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from transformers import PreTrainedModel


@dataclass
class AttentionModule:
    name: str
    module: nn.Module
    q_side: str | None  # "encoder" or "decoder": which sequence the queries come from (None: token-local)
    kv_side: str | None
    heads: int
    kv_heads: int
    pattern: tuple | None = None  # (causal, window) the unpatched model computes, proven at patch time
    # position_bias= it is given (proof/relative_bias.py): ("zero",) or ("relative", owner module, owner's side)
    bias: tuple | None = None


@dataclass
class PositionModule:
    side: str
    module: nn.Module
    kind: str  # "rotary": computed on the full positions, then sliced; "ids": looked up by position_ids;
    #            "m2m100": sinusoidal table indexed by padding-aware positions


@dataclass
class ModelFamily:
    kind: str  # "seq2seq" or "causal"
    pretrained: PreTrainedModel  # the transformers model (a PeftModel's base model, or the model itself)
    backbone: PreTrainedModel  # the module that turns token ids into hidden states: where sequences are sharded
    has_lm_head: bool  # pretrained computes logits (and a loss) on top of the backbone
    attention: list[AttentionModule]
    positions: list[PositionModule] = field(default_factory=list)
    layer_stacks: list[nn.Module] = field(default_factory=list)  # modules with `layers` (and maybe `layerdrop`)
    local_attention: list[AttentionModule] = field(default_factory=list)  # token-local calls, run as they are
    default_positions: str = "arange"  # forward/default_positions.py: the positions the backbone makes itself
    head_post: object = None  # forward/head.Post reproducing the model's logits after its head (None: do not tile)
    layer_inputs: dict = field(default_factory=dict)  # layer path -> its per-token inputs (tp/tp_checks.py)
    inplace_outputs: set = field(default_factory=set)  # nn.Linear paths whose outputs the model writes in place
    packed_rows: dict = field(default_factory=dict)  # kind of packed batch -> why refused (proof/packed_probe.py)
    # seq2seq: decoder inputs from labels as the model builds them (proof/decoder_inputs.py): None (seqpar_hf's
    # builder), (start, pad) ids its forward uses, or "refuse" (labels alone are refused; pass decoder_input_ids)
    decoder_ids: tuple | str | None = None
    # backbone-relative path -> side of the token mixers run on the whole sequence (models/mixers/gathered.py)
    mixers: dict = field(default_factory=dict)
    # modules beside the backbone run before it on the full batch (a vision tower): proof/probe.py `_front`
    front: tuple = ()
    no_front: str = ""  # why a model with a vision tower keeps its images refused (proof/probe.py)
    dry_run_seconds: float = 0.0


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT (and similar) wrappers."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def pad_token_id(config) -> int:
    """The pad id: the config's, else its text config's (composite vision / audio + text configs keep it
    there), else 0."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
    for c in (config, text):
        value = getattr(c, "pad_token_id", None) if c is not None else None
        if isinstance(value, int):
            return value
    return 0
