"""Which transformers models can be sequence-parallel, and where their SP-relevant parts are.

Supported: encoder-decoder models whose attention is plain scaled dot-product attention with
absolute positions (Marian, BART family) and rotary decoder-only models (Llama family).
Refused: models whose attention carries a position bias computed from the full relative
distance matrix (T5 and relatives), sliding-window attention, and anything not listed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

SEQ2SEQ_TYPES = ("marian", "bart", "mbart", "pegasus")
CAUSAL_TYPES = ("llama", "mistral", "qwen2")
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def supported() -> str:
    return f"encoder-decoder {', '.join(SEQ2SEQ_TYPES)}; decoder-only {', '.join(CAUSAL_TYPES)}"


@dataclass
class AttentionModule:
    name: str
    module: nn.Module
    q_side: str  # "encoder" or "decoder": which sequence the queries come from
    kv_side: str


@dataclass
class ModelFamily:
    kind: str  # "seq2seq" or "causal"
    attention: list[AttentionModule]
    position_embeddings: dict[str, nn.Module] = field(default_factory=dict)  # side -> module taking position_ids
    layer_stacks: list[nn.Module] = field(default_factory=list)  # modules with `layers` (and maybe `layerdrop`)


def inspect_model(model: nn.Module, attn_implementation: str | None) -> ModelFamily:
    """Find the SP-relevant parts of `model`, or raise a ValueError that names what is wrong."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__
    if model_type not in SEQ2SEQ_TYPES + CAUSAL_TYPES:
        why = (" (its relative position bias spans the whole sequence and cannot be sharded this way)"
               if model_type in ("t5", "mt5", "umt5", "longt5", "switch_transformers") else "")
        raise ValueError(f"seqpar_hf cannot patch {name} (model_type {model_type!r}){why}. "
                         f"Supported families: {supported()}")
    if getattr(model, "lm_head", None) is None:
        raise ValueError(f"seqpar_hf patches language-model heads (e.g. MarianMTModel, LlamaForCausalLM); "
                         f"{name} has no lm_head")
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"{name} uses attn_implementation={attn_implementation!r}; seqpar_hf replaces one of "
                         f"{', '.join(ATTENTION_IMPLEMENTATIONS)} (load the model with attn_implementation='sdpa')")
    window = getattr(config, "sliding_window", None)
    if model_type in CAUSAL_TYPES and window is not None and getattr(config, "use_sliding_window", True):
        raise ValueError(f"{name} uses sliding-window attention (sliding_window={window}), which seqpar_hf does "
                         "not shard; set config.sliding_window=None (or use_sliding_window=False) to train it "
                         "with full attention")

    attention = []
    for path, module in model.named_modules():
        if not (type(module).__name__.endswith("Attention") and hasattr(module, "q_proj")):
            continue
        if model_type in CAUSAL_TYPES:
            q_side = kv_side = "decoder"
        else:
            q_side = "encoder" if ".encoder." in f".{path}." else "decoder"
            kv_side = "encoder" if path.endswith("encoder_attn") or q_side == "encoder" else "decoder"
        attention.append(AttentionModule(path, module, q_side, kv_side))
    if not attention:
        raise ValueError(f"found no attention modules in {name}")

    if model_type in CAUSAL_TYPES:
        return ModelFamily("causal", attention, layer_stacks=[model.get_decoder()])
    encoder, decoder = model.get_encoder(), model.get_decoder()
    return ModelFamily("seq2seq", attention,
                       position_embeddings={"encoder": encoder.embed_positions, "decoder": decoder.embed_positions},
                       layer_stacks=[encoder, decoder])
