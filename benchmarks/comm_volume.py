"""Communication volume per rank: bytes each rank sends and receives per attention layer and per
training step, measured by wrapping the torch.distributed collectives, against the formulas.

One forward + backward of the patched model (no DDP: its gradient all-reduce is the same with or
without SP and runs in C++, out of the wrappers' sight). Per attention call, fp32 (e bytes/element),
b batch, d head dim, h query heads, g kv heads, local lengths s_q, s_k = padded length / sp:

- Ulysses over n ranks (Jacobs et al. 2023): one all-to-all forward carrying q, k and v packed by
  destination rank and one for the output, each sending (n-1)/n of what it carries, and the 2 mirror
  ones backward (the one-by-one exchange, DeepSpeed's, takes 4 and 4 for the same bytes; with c head
  chunks each becomes c all-to-alls, again the same bytes):
      forward = backward = (n-1)/n * b * d * e * (2 h s_q + 2 g' s_k),  g' = max(g, n)
  (with fewer kv heads than ranks every rank receives one kv head: kv heads are replicated).
- Ring over r ranks (seqpar_hf/ring.py): forward passes the stacked K/V block r-1 times; backward
  passes it r-1 times more plus the fp32 dK/dV accumulator r times (it travels a full turn home):
      forward = (r-1) * 2 b g s_k d e,   backward = (r-1) * 2 b g s_k d e + r * 2 b g s_k d * 4
- Hybrid (ulysses_size u = sp / r): the Ulysses part over u ranks, then a ring over r ranks whose
  blocks hold g/u kv heads (at least 1) and the Ulysses group's s_k * u keys.

Marian counts encoder self-, decoder self- and cross-attention separately (cross: queries from the
target, keys from the source). The small extras, outside attention (the per-forward input
fingerprint all-gather of seqpar_hf/checks.py, the loss all-reduces), are listed on their own.
All-to-all and ring bytes count only what leaves / reaches the rank (a rank's own chunk is a local
copy); all-gather: its chunk to each of n-1 ranks; all-reduce: 2 (n-1)/n x payload (ring algorithm).

    python -m benchmarks.comm_volume            # Marian-base 1024 -> 768 tokens, Llama-GQA 1024, ~1-2 min
    python -m benchmarks.comm_volume --quick    # 64 -> 48 tokens, < 1 min
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torch.distributed as dist

import seqpar_hf
from benchmarks.common import MODELS, attention_modules, build_model, ceil_to, environment, fmt_bytes, make_batch, table
from benchmarks.instruments import CollectiveTap, CommMeter
from benchmarks.publish import output_options, publish

TOLERANCE = 0.05  # measured within 5% of the formula


# ---------------------------------------------------------------------------------------------
# formulas (bytes this rank sends per attention call; receives are the same for these patterns)


def ulysses_call_bytes(b, h, g, s_q, s_k, d, n, elt) -> float:
    if n == 1:
        return 0.0
    g_sent = max(g, n)  # kv heads leave the rank once each, or replicated up to one per rank
    return (n - 1) / n * b * d * elt * (2 * h * s_q + 2 * g_sent * s_k)


def ring_call_bytes(b, g, s_k, d, r, elt) -> tuple[float, float]:
    if r == 1:
        return 0.0, 0.0
    block = 2 * b * g * s_k * d  # elements of the stacked [2, b, g, s_k, d] K/V block
    return (r - 1) * block * elt, (r - 1) * block * elt + r * block * 4  # accumulators are fp32


def formula(
    spec,
    mode: str,
    sp: int,
    ring: int | None,
    s_q_full: int,
    s_k_full: int,
    q_causal: bool,
    k_causal: bool,
    b: int = 1,
    elt: int = 4,
) -> dict:
    """{"forward": bytes, "backward": bytes} one rank sends in one attention call."""
    r = {"ulysses": 1, "ring": sp, "hybrid": ring}[mode]
    u = sp // r
    zig = r > 1  # ring modes shard causal sequences in zigzag order: padded to 2 * sp
    s_q = ceil_to(s_q_full, 2 * sp if (zig and q_causal) else sp) // sp
    s_k = ceil_to(s_k_full, 2 * sp if (zig and k_causal) else sp) // sp
    d, h, g = spec.head_dim, spec.heads, spec.kv_heads
    uly = ulysses_call_bytes(b, h, g, s_q, s_k, d, u, elt)
    g_ring = max(g // u, 1)  # kv heads a rank holds after the Ulysses exchange
    ring_f, ring_b = ring_call_bytes(b, g_ring, s_k * u, d, r, elt)
    return {"forward": uly + ring_f, "backward": uly + ring_b}


def attention_shapes(spec, seq_len: int, tgt_len: int) -> dict:
    """kind -> (s_q, s_k, q side causal, k side causal)."""
    if spec.kind == "causal":
        return {"self": (seq_len, seq_len, True, True)}
    return {
        "encoder self": (seq_len, seq_len, False, False),
        "decoder self": (tgt_len, tgt_len, True, True),
        "cross": (tgt_len, seq_len, True, False),
    }


# ---------------------------------------------------------------------------------------------
# measurement


class _EnterBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, meter, label):
        ctx.meter, ctx.label = meter, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.meter.label = ctx.label  # autograd reaches this module's backward from here on
        return grad, None, None


def label_attention(model, meter: CommMeter) -> list:
    """Set `meter.label` to the attention kind while an attention module runs: forward through module
    hooks, backward through an identity autograd node on the module's output ("other" elsewhere)."""
    handles = []
    for _, kind, module in attention_modules(model):

        def pre(module, args, kwargs, kind=kind):
            meter.label = kind

        def post(module, args, kwargs, output, kind=kind):
            meter.label = "other"
            return (_EnterBackward.apply(output[0], meter, kind), *output[1:])

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return handles


def measure_step(model, batch) -> dict:
    meter = CommMeter()
    handles = label_attention(model, meter)
    try:
        with CollectiveTap(meter.record):
            out = model(**batch)
            meter.phase, meter.label = "backward", "other"
            out.loss.backward()
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return {k: list(v) for k, v in meter.totals.items()}


def _worker(models, seq_len, tgt_len, layouts) -> list[dict]:
    rank = dist.get_rank()
    built = [(sp, mode, ring, seqpar_hf.ParallelLayout(sp, mode=mode, ring_size=ring)) for sp, mode, ring in layouts]
    out = []
    for name in models:
        spec = MODELS[name]
        model = build_model(spec, max_len=max(seq_len, tgt_len))
        counts = defaultdict(int)
        for _, kind, _ in attention_modules(model):
            counts[kind] += 1
        batch = make_batch(spec, seq_len)
        if spec.kind == "seq2seq":
            batch["labels"] = make_batch(spec, tgt_len, seed=1)["labels"]
        for sp, mode, ring, layout in built:
            if rank < sp:
                seqpar_hf.patch_model(model, layout)
                totals = measure_step(model, batch)
                seqpar_hf.unpatch_model(model)
                per_rank = [None] * sp
                dist.all_gather_object(per_rank, totals, group=layout.sp_group)
                if rank == 0:
                    out.append(
                        {
                            "model": name,
                            "mode": mode,
                            "sp": sp,
                            "ring_size": ring,
                            "seq_len": seq_len,
                            "tgt_len": tgt_len if spec.kind == "seq2seq" else None,
                            "layers": dict(counts),
                            "per_rank": per_rank,
                        }
                    )
            dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------
# analysis


def analyse(raw: list[dict]) -> list[dict]:
    """One record per (model, mode, sp, kind, phase) for attention, and per (phase, collective) for extras."""
    records = []
    for run in raw:
        spec = MODELS[run["model"]]
        shapes = attention_shapes(spec, run["seq_len"], run["tgt_len"] or run["seq_len"])
        base = {k: run[k] for k in ("model", "mode", "sp", "ring_size", "seq_len", "tgt_len")}
        ranks = run["per_rank"]  # per SP rank: {(phase, label, collective): [sent, received, payload, calls]}
        for kind, (s_q, s_k, q_causal, k_causal) in shapes.items():
            expected = formula(spec, run["mode"], run["sp"], run["ring_size"], s_q, s_k, q_causal, k_causal)
            layers = run["layers"][kind]
            for phase in ("forward", "backward"):
                sent = [sum(v[0] for (p, lbl, _), v in r.items() if p == phase and lbl == kind) for r in ranks]
                recv = [sum(v[1] for (p, lbl, _), v in r.items() if p == phase and lbl == kind) for r in ranks]
                calls = sum(v[3] for (p, lbl, _), v in ranks[0].items() if p == phase and lbl == kind)
                per_layer = max(sent) / layers
                err = per_layer / expected[phase] - 1 if expected[phase] else (0.0 if per_layer == 0 else float("inf"))
                records.append(
                    {
                        **base,
                        "part": "attention",
                        "kind": kind,
                        "phase": phase,
                        "layers": layers,
                        "sent_per_layer": per_layer,
                        "recv_per_layer": max(recv) / layers,
                        "formula_per_layer": expected[phase],
                        "sent_per_step": max(sent),
                        "formula_per_step": expected[phase] * layers,
                        "calls_per_layer": calls / layers,
                        "rel_error": err,
                        "within_tolerance": abs(err) <= TOLERANCE,
                        "sent_ranks": sent,
                    }
                )
        for (phase, label, name), v in sorted(ranks[0].items()):
            if label == "other":
                records.append(
                    {
                        **base,
                        "part": "extra",
                        "kind": name,
                        "phase": phase,
                        "calls": v[3],
                        "payload_bytes": v[2],
                        "sent_per_step": v[0],
                        "recv_per_step": v[1],
                    }
                )
    return records


def report(records: list[dict]) -> str:
    att = [r for r in records if r["part"] == "attention"]
    rows = [
        {
            **r,
            "mode_s": r["mode"] + (f" (ring {r['ring_size']})" if r["mode"] == "hybrid" else ""),
            "m": fmt_bytes(r["sent_per_layer"]),
            "rv": fmt_bytes(r["recv_per_layer"]),
            "f": fmt_bytes(r["formula_per_layer"]),
            "st": fmt_bytes(r["sent_per_step"]),
            "c": f"{r['calls_per_layer']:g}",
            "e": f"{100 * r['rel_error']:+.2f}%",
            "ok": "yes" if r["within_tolerance"] else "NO",
        }
        for r in att
    ]
    out = table(
        rows,
        [
            ("model", "model"),
            ("mode", "mode_s"),
            ("sp", "sp"),
            ("attention", "kind"),
            ("phase", "phase"),
            ("calls / layer", "c"),
            ("sent / layer", "m"),
            ("received / layer", "rv"),
            ("formula / layer", "f"),
            ("error", "e"),
            ("within 5%", "ok"),
            ("layers", "layers"),
            ("sent / step", "st"),
        ],
    )
    totals = defaultdict(lambda: [0.0, 0.0])
    for r in att:
        key = (r["model"], r["mode"], r["sp"], r["ring_size"])
        totals[key][0] += r["sent_per_step"]
        totals[key][1] += r["formula_per_step"]
    trows = [
        {
            "model": k[0],
            "mode": k[1] + (f" (ring {k[3]})" if k[1] == "hybrid" else ""),
            "sp": k[2],
            "m": fmt_bytes(v[0]),
            "f": fmt_bytes(v[1]),
            "e": f"{100 * (v[0] / v[1] - 1):+.2f}%" if v[1] else "-",
        }
        for k, v in totals.items()
    ]
    out += "\n\nPer step (all attention layers, forward + backward, bytes sent by the busiest rank):\n\n"
    out += table(
        trows,
        [
            ("model", "model"),
            ("mode", "mode"),
            ("sp", "sp"),
            ("sent / step", "m"),
            ("formula / step", "f"),
            ("error", "e"),
        ],
    )
    extra = [
        {**r, "mode_s": r["mode"], "p": fmt_bytes(r["payload_bytes"]), "s": fmt_bytes(r["sent_per_step"])}
        for r in records
        if r["part"] == "extra"
    ]
    out += "\n\nExtras outside attention (rank 0, per step):\n\n"
    out += table(
        extra,
        [
            ("model", "model"),
            ("mode", "mode_s"),
            ("sp", "sp"),
            ("phase", "phase"),
            ("collective", "kind"),
            ("calls", "calls"),
            ("payload", "p"),
            ("sent", "s"),
        ],
    )
    return out


def layouts_for(sps, modes):
    out = []
    for sp in sorted(s for s in sps if s > 1):
        for mode in modes:
            if mode != "hybrid":
                out.append((sp, mode, None))
            elif sp >= 4:
                out.append((sp, "hybrid", 2))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["marian-base", "llama-gqa"], choices=sorted(MODELS))
    p.add_argument("--seq-len", type=int, default=1024, help="source length (Llama: sequence length)")
    p.add_argument(
        "--tgt-len",
        type=int,
        default=768,
        help="Marian target length (differs from the source so cross-attention's shapes are visible)",
    )
    p.add_argument("--sp", nargs="+", type=int, default=[2, 4])
    p.add_argument("--modes", nargs="+", default=["ulysses", "ring", "hybrid"], choices=["ulysses", "ring", "hybrid"])
    p.add_argument("--quick", action="store_true", help="64 -> 48 tokens (validation, < 1 min)")
    output_options(p, "comm_volume")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_len, args.tgt_len = 64, 48

    from tests.helpers.spawn import spawn

    layouts = layouts_for(args.sp, args.modes)
    world = max(sp for sp, _, _ in layouts)
    print(
        f"# communication volume per rank, fp32, batch 1, one forward + backward\n{environment()}; "
        f"{world} gloo processes, 1 torch thread each\n"
    )
    raw = spawn(_worker, world, args.models, args.seq_len, args.tgt_len, layouts, timeout=1800)[0]
    records = analyse(raw)
    print(report(records))
    publish("comm_volume", records, args)


if __name__ == "__main__":
    main()
