"""Memory planner: per-rank memory of a training step for each layout, and the one to use.

    python -m seqpar_hf.plan --model llama-3-8b --seq-len 131072 --gpus 8 --gpu-memory 80
    python -m seqpar_hf.plan --model path/to/config.json --seq-len 32768 --gpus 4 --gpu-memory 24 --dtype bf16
    python -m seqpar_hf.plan --model llama-3-8b --seq-len 65536 --gpus 8 --gpu-memory 80 --all
    python -m seqpar_hf.plan --validate benchmarks/results/longest_sequence.json

For a decoder-only transformer (Llama-like: RMSNorm, rotary, SwiGLU MLP, grouped-query attention,
an LM head over the vocabulary), one sequence of `--seq-len` tokens per SP group, AdamW with fp32
states, it counts per rank:

- states: parameters, gradients and the two AdamW moments (16 bytes per parameter in fp32, or bf16
  weights with fp32 master copy, gradients and moments: 16 as well), divided by the ranks that hold
  the same weights (FSDP2 over dp x sp) and by tp; plus what FSDP gathers while it runs (the root's
  embeddings, head and final norm stay whole through forward and backward; one layer in flight);
- activations: what autograd saves for backward per local token per layer (counted tensor by tensor
  for the Llama layer in transformers: norms, projections, rotary q/k, SDPA output and log-sum-exp,
  the SwiGLU MLP; Ulysses keeps the attention output in both layouts and gives each rank at least one
  kv head; checkpointing keeps one layer input per layer and recomputes one layer at a time);
- logits: cross-entropy's log-softmax and the logits' gradient ([tokens, vocab] fp32, twice), or with
  the tiled loss a fixed chunk (seqpar_hf.models.loss.TILED_LOSS_CHUNK_ELEMENTS) and a copy of the
  head's input;
- communication buffers: Ulysses all-to-all (q, k, v in and out), ring k/v blocks in flight, TP
  all-gathered [s, h] inputs.

The peak is the largest of three moments of the step: the start of backward (all activations, the
loss's gradients), the end of backward (all gradients), the optimizer step. Validated against the
exact per-rank counts of benchmarks/longest_sequence.py (tests/test_plan.py: within 10%).
The recommendation is the fitting layout that should run fastest: no checkpointing before
checkpointing, the fewest ranks per sequence (least communication), Ulysses before ring, TP last.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

# Sizes of models people train long contexts with (no download needed).
KNOWN = {
    "llama-3-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256, tied=False),
    "llama-3.2-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256, tied=True),
    "llama-3.2-3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, ffn=8192, vocab=128256, tied=True),
    "qwen3-8b": dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=12288, vocab=151936, tied=False),
    "mistral-7b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=32768, tied=False),
    # benchmarks/longest_sequence.py: bench-44m on CPU, bench-155m on GPU
    "bench-44m": dict(hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, ffn=1408, vocab=32000, tied=False),
    "bench-155m": dict(hidden=1024, layers=8, heads=16, kv_heads=4, head_dim=64, ffn=2816, vocab=32000, tied=False),
}
GIB = 2**30
TILED_MIN_ELEMENTS = 1 << 26  # = seqpar_hf.models.loss.TILED_LOSS_MIN_ELEMENTS
TILED_CHUNK_ELEMENTS = 1 << 24  # = seqpar_hf.models.loss.TILED_LOSS_CHUNK_ELEMENTS


@dataclass(frozen=True)
class Model:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h = self.hidden
        return h * (2 * self.q_dim + 2 * self.kv_dim) + 3 * h * self.ffn + 2 * h

    @property
    def root_params(self) -> int:
        """Embeddings, head and final norm: FSDP's root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    @classmethod
    def from_config(cls, config: dict) -> "Model":
        config = config.get("text_config", config)
        heads = config["num_attention_heads"]
        return cls(hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   ffn=config["intermediate_size"], vocab=config["vocab_size"],
                   tied=bool(config.get("tie_word_embeddings", False)))


@dataclass(frozen=True)
class Layout:
    sp: int = 1
    tp: int = 1
    mode: str = "ulysses"
    checkpointing: bool = False
    tiled: bool = False
    fsdp: bool = True  # over dp x sp when more than one rank holds the weights

    def describe(self) -> str:
        parts = [f"sp={self.sp}" + (f" {self.mode}" if self.sp > 1 else ""), f"tp={self.tp}"]
        parts += ["checkpointing"] if self.checkpointing else []
        parts += ["tiled loss"] if self.tiled else []
        return ", ".join(parts)


@dataclass
class Breakdown:
    layout: Layout
    parts: dict = field(default_factory=dict)  # at the peak moment
    moment: str = ""
    peak: float = 0.0


def plan(model: Model, layout: Layout, seq_len: int, gpus: int, act_bytes: int = 4, batch: int = 1) -> Breakdown:
    """Per-rank bytes at the peak of one training step (forward, backward, AdamW step)."""
    m, sp, tp = model, layout.sp, layout.tp
    dp = max(1, gpus // (sp * tp))
    shards = dp * sp if layout.fsdp else 1
    h, e = m.hidden, act_bytes
    local = batch * math.ceil(seq_len / sp)  # tokens per rank

    # -- states: weights (fp32 or bf16 + fp32 master), gradients, AdamW moments -----------------------
    P = m.params / tp
    weights = P * 4 / shards + (P * 2 / shards if e == 2 else 0)
    moments = P * 8 / shards
    grads = P * 4 / shards
    gathered = 0.0  # FSDP all-gathers into new buffers: the root's stay through forward and backward; a layer's
    if shards > 1:
        gathered = (m.root_params + m.layer_params) / tp * 4
    root_grads = (m.root_params / tp) * 4 if shards > 1 else 0.0  # whole until backward's end

    # -- activations saved per local token ----------------------------------------------------------
    q_loc, kv_loc = m.heads / tp, m.kv_heads / tp
    if sp > 1 and layout.mode == "ulysses":
        kv_eff = max(kv_loc, min(sp, q_loc)) * m.head_dim  # each rank needs at least one kv head
        lse, extra = q_loc, q_loc * m.head_dim  # attention output kept head- and sequence-sharded
    else:
        kv_eff, lse, extra = kv_loc * m.head_dim, q_loc, 0.0
    q_dim, ffn = q_loc * m.head_dim, m.ffn / tp
    # Llama layer, elements per token: 2 RMSNorms (input, normed x rsqrt: 2h + 1 each), q/k/v
    # projections' shared input (h), rotary q and k, v, SDPA output and log-sum-exp, o_proj input,
    # gate/up outputs, SiLU output and product (4 ffn)
    per_layer = (2 * (2 * h + 1) + h + (q_dim + 2 * kv_eff) + q_dim + lse + extra + 4 * ffn)
    if tp > 1:  # TP+SP: norms sharded by tp, the all-gathered inputs of q and gate kept whole
        per_layer = (2 * (2 * h + 1)) / tp + 2 * h + (q_dim + 2 * kv_eff) + q_dim + lse + extra + 4 * ffn
    final = 2 * h + 1  # final norm
    saved = (m.layers * h if layout.checkpointing else m.layers * per_layer) + final
    tiled = layout.tiled and tp == 1
    if tiled:
        chunk = min(local, max(1, TILED_CHUNK_ELEMENTS // m.vocab)) * m.vocab
        # one chunk: logits, log-softmax, their gradients; a copy of the head's input (labelled tokens),
        # its gradient, the kept tokens' indices and targets (int64)
        logits_bytes = 4 * chunk * 4 + 2 * local * h * e + 2 * local * 8
    else:  # cross-entropy's log-softmax saved (fp32), then in backward its gradient and the logits'
        logits_bytes = 3 * local * m.vocab * 4
    activations = local * saved * e

    # -- communication buffers --------------------------------------------------------------------
    if sp > 1 and layout.mode == "ulysses":
        comm = local * (q_dim + 2 * kv_eff + q_dim) * e  # all-to-all of q, k, v and the output
    elif sp > 1:
        comm = 4 * local * kv_eff * e  # k, v of the block in hand and the one arriving
    else:
        comm = 0.0
    if tp > 1:
        comm += local * h * e  # the all-gathered [s, h] input in flight

    # start of backward: every saved activation and the loss's [tokens, vocab] tensors
    early = dict(states=weights + moments, fsdp_gathered=gathered, activations=activations, logits=logits_bytes,
                 communication=comm)
    # with checkpointing, the backward of the last layer: its recomputed activations and the gradients
    # of its SwiGLU intermediates and hidden state; the head's gradient
    head_grad = m.vocab * h / tp * 4
    recompute = dict(states=weights + moments + head_grad, fsdp_gathered=gathered,
                     activations=local * (m.layers * h + per_layer + 2 * ffn + h) * e, logits=0.0,
                     communication=0.0)  # the recomputed forward's all-to-all buffers are freed by then
    # end of backward: every gradient (FSDP: sharded, but the root's whole until reduce-scattered)
    end = dict(states=weights + moments + (grads + root_grads if shards > 1 else P * 4), fsdp_gathered=gathered,
               activations=0.0, logits=0.0, communication=0.0)
    largest_param = max(m.vocab * h, h * m.ffn) / tp / shards * 4
    optimizer = dict(states=weights + moments + grads, fsdp_gathered=0.0, activations=0.0, logits=0.0,
                     communication=0.0, optimizer_temporaries=2 * largest_param)
    moments_ = {"start of backward": early, "end of backward": end, "optimizer step": optimizer}
    if layout.checkpointing:
        moments_["recompute in backward"] = recompute
    name, parts = max(moments_.items(), key=lambda kv: sum(kv[1].values()))
    return Breakdown(layout, parts, name, sum(parts.values()))


def layouts(model: Model, gpus: int) -> list[Layout]:
    out = []
    for tp in (1, 2, 4, 8):
        if gpus % tp or model.kv_heads % tp or model.heads % tp:
            continue
        for sp in (1, 2, 4, 8, 16, 32, 64):
            if sp * tp > gpus or gpus % (sp * tp):
                continue
            modes = ["ulysses", "ring"] if sp > 1 else ["ulysses"]
            for mode in modes:
                if mode == "ulysses" and (model.heads // tp) < sp:
                    continue  # Ulysses splits the heads: no more ranks than heads
                for checkpointing in (False, True):
                    for tiled in (False, True):
                        out.append(Layout(sp, tp, mode, checkpointing, tiled))
    return out


def recommend(rows: list[Breakdown], budget: float) -> Breakdown | None:
    fitting = [r for r in rows if r.peak <= budget]
    if not fitting:
        return None
    # fastest first: no recompute, fewest ranks per sequence, Ulysses (fewest bytes), no TP, then memory
    return min(fitting, key=lambda r: (r.layout.checkpointing, r.layout.sp * r.layout.tp, r.layout.mode != "ulysses",
                                       r.layout.tp, r.peak))


def load_model(name: str) -> Model:
    if name in KNOWN:
        return Model(**KNOWN[name])
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.exists():
        return Model.from_config(json.loads(path.read_text()))
    raise SystemExit(f"--model {name!r}: not a config.json (or a folder with one) and not one of {', '.join(KNOWN)}; "
                     "pass a transformers config file, or --hidden/--layers/... to spell the sizes out")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m seqpar_hf.plan", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="llama-3-8b",
                        help=f"a transformers config.json (or its folder), or one of: {', '.join(KNOWN)}")
    for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
        parser.add_argument(f"--{name}", type=int, help=f"override the model's {name}")
    parser.add_argument("--validate", metavar="JSON",
                        help="compare with benchmarks/results/longest_sequence.json (measured peaks) and exit")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per SP group and step")
    parser.add_argument("--gpus", type=int, help="ranks in all (dp x sp x tp)")
    parser.add_argument("--gpu-memory", type=float, help="GiB per rank")
    parser.add_argument("--reserve", type=float, default=0.1,
                        help="fraction of each rank's memory kept free (allocator fragmentation, kernels' workspace)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16",
                        help="activations' precision (bf16: bf16 weights with fp32 master weights, gradients, moments)")
    parser.add_argument("--all", action="store_true", help="print every layout, not only the best per sp x tp")
    args = parser.parse_args(argv)
    if args.validate:
        return validate(args.validate)
    missing = [f"--{n.replace('_', '-')}" for n in ("seq_len", "gpus", "gpu_memory") if getattr(args, n) is None]
    if missing:
        parser.error(f"{', '.join(missing)} required")
    model = load_model(args.model)
    overrides = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "vocab")
                 if getattr(args, k) is not None}
    model = replace(model, **overrides)
    budget = args.gpu_memory * GIB * (1 - args.reserve)
    e = 2 if args.dtype == "bf16" else 4
    rows = [plan(model, layout, args.seq_len, args.gpus, e, args.batch) for layout in layouts(model, args.gpus)]
    print(f"model: {model.params / 1e9:.2f}B parameters ({model.layers} layers, hidden {model.hidden}, "
          f"{model.heads}/{model.kv_heads} heads, ffn {model.ffn}, vocab {model.vocab}); {args.seq_len} tokens x "
          f"{args.batch}; {args.gpus} ranks of {args.gpu_memory:g} GiB ({budget / GIB:.1f} usable); {args.dtype}")
    shown = rows if args.all else _best_per_group(rows, budget)
    header = (f"{'layout':44s} {'states':>8s} {'fsdp':>7s} {'activ.':>8s} {'logits':>8s} {'comm':>7s} "
              f"{'peak GiB':>9s}  at")
    print(header)
    for r in shown:
        p = r.parts
        print(f"{r.layout.describe():44s} {p['states'] / GIB:8.2f} {p['fsdp_gathered'] / GIB:7.2f} "
              f"{p['activations'] / GIB:8.2f} {p['logits'] / GIB:8.2f} {p['communication'] / GIB:7.2f} "
              f"{r.peak / GIB:9.2f}  {r.moment}{'' if r.peak <= budget else '  (does not fit)'}")
    best = recommend(rows, budget)
    if best is None:
        print("nothing fits: more ranks, a shorter sequence, or bf16")
    else:
        dp = args.gpus // (best.layout.sp * best.layout.tp)
        print(f"recommended: {best.layout.describe()}, dp={dp}, FSDP over {dp * best.layout.sp} ranks; "
              f"peak {best.peak / GIB:.1f} GiB of {budget / GIB:.1f}")
    return best


OPTIONS = {"plain": (False, False), "tiled loss": (False, True), "checkpointing": (True, False),
           "checkpointing + tiled loss": (True, True)}


def validate(path: str) -> list[dict]:
    """Predicted against measured per-rank peaks, for every record of a benchmarks/longest_sequence.py
    json (fp32, Ulysses, FSDP over sp); prints a markdown table and returns the rows."""
    results = json.loads(Path(path).read_text())
    config = results["config"]
    model = Model.from_config(config)
    rows = []
    for record in results["records"]:
        checkpointing, tiled = OPTIONS[record["option"]]
        layout = Layout(sp=record["sp"], checkpointing=checkpointing, tiled=tiled)
        predicted = plan(model, layout, record["length"], gpus=record["sp"], act_bytes=4)
        measured = max(record["total"], record["optimizer_total"])
        rows.append(dict(sp=record["sp"], option=record["option"], local=record["local"], measured=measured,
                         predicted=predicted.peak, moment=predicted.moment,
                         error=(predicted.peak - measured) / measured))
    print("| sp | option | tokens per rank | measured MiB | predicted MiB | error | peak at (predicted) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['sp']} | {r['option']} | {r['local']} | {r['measured'] / 2**20:.0f} | {r['predicted'] / 2**20:.0f} "
              f"| {100 * r['error']:+.1f}% | {r['moment']} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"\nworst: {100 * worst['error']:+.1f}% (sp={worst['sp']}, {worst['option']}, {worst['local']} tokens per rank)")
    print(f"\nLongest sequence in {results['budget_bytes'] / GIB:g} GiB per rank, benchmark (extrapolated from its "
          "measurements) / planner:\n")
    print("| option | " + " | ".join(f"sp={r['sp']}" for r in results["rows"] if r["option"] == "plain") + " |")
    print("|---" * (1 + sum(r["option"] == "plain" for r in results["rows"])) + "|")
    for option in OPTIONS:
        cells = []
        for row in (r for r in results["rows"] if r["option"] == option):
            layout = Layout(sp=row["sp"], checkpointing=OPTIONS[option][0], tiled=OPTIONS[option][1])
            mine = longest(model, layout, results["budget_bytes"], row["sp"])
            cells.append(f"{row['longest']:,} / {mine:,} ({100 * (mine - row['longest']) / row['longest']:+.1f}%)")
        if cells:
            print(f"| {option} | " + " | ".join(cells) + " |")
    return rows


def longest(model: Model, layout: Layout, budget: float, gpus: int, act_bytes: int = 4) -> int:
    """The longest sequence (a multiple of 64 x sp) whose predicted peak fits in `budget` bytes."""
    unit = 64 * layout.sp
    lo, hi = 0, 1
    while plan(model, layout, hi * unit, gpus, act_bytes).peak <= budget and hi < 1 << 24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(model, layout, mid * unit, gpus, act_bytes).peak <= budget else (lo, mid)
    return lo * unit


def _best_per_group(rows, budget):
    out = []
    for key in dict.fromkeys((r.layout.sp, r.layout.tp, r.layout.mode) for r in rows):
        group = [r for r in rows if (r.layout.sp, r.layout.tp, r.layout.mode) == key]
        fitting = [r for r in group if r.peak <= budget]
        out.append(min(fitting, key=lambda r: (r.layout.checkpointing, r.peak)) if fitting
                   else min(group, key=lambda r: r.peak))
    return out


if __name__ == "__main__":
    main()
