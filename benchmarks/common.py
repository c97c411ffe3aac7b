"""Shared pieces of the benchmark scripts: model presets, batches, timing statistics, tables, JSON.

Vocabulary: *seq_len* is the full (unsharded) sequence length; for encoder-decoder models it is the
length of the source AND of the target (a Marian step at seq_len 2048 sees 2048 + 2048 tokens).
*per rank* means one process of an SP group.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "benchmarks" / "figures"


# ---------------------------------------------------------------------------------------------
# models


@dataclass(frozen=True)
class ModelSpec:
    """A model built from a config (no download). `layers` is per stack for encoder-decoders."""

    name: str
    kind: str  # "seq2seq" (Marian) or "causal" (Llama)
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 8000

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def attention_layers(self) -> int:
        """Transformer blocks in the Megatron sense (encoder + decoder for Marian)."""
        return 2 * self.layers if self.kind == "seq2seq" else self.layers


MODELS = {
    # Marian-base (Helsinki-NLP opus-mt shapes): what a translation model needs at long sequences
    "marian-base": ModelSpec("marian-base", "seq2seq", d_model=512, layers=6, heads=8, kv_heads=8, ffn=2048),
    # the recipe's model (recipes/train_translation.py): small enough for CPU step timing
    "marian-small": ModelSpec("marian-small", "seq2seq", d_model=256, layers=3, heads=4, kv_heads=4, ffn=1024),
    # a small Llama with grouped-query attention: 2 kv heads, so kv < sp at sp=4 and 8
    "llama-gqa": ModelSpec("llama-gqa", "causal", d_model=512, layers=8, heads=8, kv_heads=2, ffn=1408),
}


def _sinusoidal(n_pos: int, dim: int, dtype, device, rows: int = 1 << 16) -> torch.Tensor:
    """MarianSinusoidalPositionalEmbedding.create_weight, vectorised (in float64, `rows` positions at a
    time): transformers builds the table with a Python double loop, which takes minutes for the
    10^5-10^6 positions of the GPU runs."""
    inv = torch.pow(10000.0, (2 * (torch.arange(dim, device=device) // 2) / dim).double())  # [dim]
    out = torch.empty(n_pos, dim, dtype=dtype, device=device)
    sentinel = (dim + 1) // 2
    for start in range(0, n_pos, rows):
        pos = torch.arange(start, min(start + rows, n_pos), dtype=torch.float64, device=device)[:, None]
        enc = pos / inv  # [rows, dim]
        out[start : start + rows, :sentinel] = torch.sin(enc[:, 0::2])
        out[start : start + rows, sentinel:] = torch.cos(enc[:, 1::2])
    return out


@contextlib.contextmanager
def _fast_marian_positions():
    from transformers.models.marian import modeling_marian as mm

    original = mm.MarianSinusoidalPositionalEmbedding.create_weight
    mm.MarianSinusoidalPositionalEmbedding.create_weight = lambda self: _sinusoidal(
        *self.weight.shape, self.weight.dtype, self.weight.device
    )
    try:
        yield
    finally:
        mm.MarianSinusoidalPositionalEmbedding.create_weight = original


def build_model(spec: ModelSpec, max_len: int, seed: int = 0, dtype=torch.float32, device="cpu"):
    """The model of `spec` with random weights, dropout off (ring attention refuses attention
    dropout, and timings should not depend on it), SDPA attention, train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, MarianConfig, MarianMTModel

    torch.manual_seed(seed)
    if spec.kind == "seq2seq":
        config = MarianConfig(
            vocab_size=spec.vocab,
            d_model=spec.d_model,
            encoder_layers=spec.layers,
            decoder_layers=spec.layers,
            encoder_attention_heads=spec.heads,
            decoder_attention_heads=spec.heads,
            encoder_ffn_dim=spec.ffn,
            decoder_ffn_dim=spec.ffn,
            max_position_embeddings=max_len,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=0,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        )
        cls = MarianMTModel
    else:
        config = LlamaConfig(
            vocab_size=spec.vocab,
            hidden_size=spec.d_model,
            intermediate_size=spec.ffn,
            num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=max_len,
            pad_token_id=0,
            attention_dropout=0.0,
        )
        cls = LlamaForCausalLM
    with _fast_marian_positions(), torch.device(device):
        model = cls(config)
    model.set_attn_implementation("sdpa")
    return model.to(dtype).train()


def make_batch(spec: ModelSpec, seq_len: int, batch: int = 1, seed: int = 0, device="cpu") -> dict:
    """Random tokens, no padding (the fast path of every kernel); Marian: source and target of seq_len."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, spec.vocab, (batch, seq_len), generator=g)
    if spec.kind == "seq2seq":
        labels = torch.randint(3, spec.vocab, (batch, seq_len), generator=g)
        out = {"input_ids": ids, "labels": labels}
    else:
        out = {"input_ids": ids, "labels": ids.clone()}
    return {k: v.to(device) for k, v in out.items()}


def enable_checkpointing(model) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x name
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def disable_checkpointing(model) -> None:
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def attention_modules(model) -> list[tuple[str, str, torch.nn.Module]]:
    """(path, kind, module) of every attention module; kind: encoder self / decoder self / cross / self."""
    found = []
    for path, module in model.named_modules():
        if not (type(module).__name__.endswith("Attention") and hasattr(module, "q_proj")):
            continue
        if ".encoder." in f".{path}.":
            kind = "encoder self"
        elif path.endswith("encoder_attn"):
            kind = "cross"
        elif ".decoder." in f".{path}." and getattr(model.config, "is_encoder_decoder", False):
            kind = "decoder self"
        else:
            kind = "self"
        found.append((path, kind, module))
    return found


# ---------------------------------------------------------------------------------------------
# statistics, tables, files


def summary(values: list[float]) -> dict:
    """Median and spread of repeated measurements (spread = (max - min) / 2 / median)."""
    med = statistics.median(values)
    return {
        "median": med,
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "spread": (max(values) - min(values)) / 2 / med if med else 0.0,
    }


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A markdown table: `columns` is [(header, key)], values already formatted or str()-able."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for _, k in columns) + " |")
    return "\n".join(lines)


def write_json(path: str | Path | None, records: list[dict], quiet: bool = False) -> None:
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1, default=str) + "\n")
    if not quiet:
        print(f"\nwrote {len(records)} records to {path}")


def environment() -> str:
    import transformers

    return (
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} CPU cores, torch threads {torch.get_num_threads()}"
    )


def ceil_to(n: int, m: int) -> int:
    return math.ceil(n / m) * m


def records_of(path: str | Path) -> list[dict]:
    return json.loads(Path(path).read_text())


__all__ = [
    "ModelSpec",
    "MODELS",
    "build_model",
    "make_batch",
    "enable_checkpointing",
    "disable_checkpointing",
    "attention_modules",
    "summary",
    "fmt_bytes",
    "table",
    "write_json",
    "environment",
    "ceil_to",
    "RESULTS",
    "FIGURES",
    "records_of",
]
