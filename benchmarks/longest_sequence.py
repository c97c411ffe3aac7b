"""The longest sequence that trains in a fixed per-rank memory budget, per sp: the headline figure.

Model (Llama-like): "bench-44m", 4 layers, hidden 512, 8 query / 2 kv heads of 64 (so kv heads < sp
at sp 4 and 8), SwiGLU 1408, vocabulary 32000 with an untied head (44.4M parameters); or with
--size bench-155m, 8 layers, hidden 1024, 16 / 4 heads, SwiGLU 2816 (155.0M; for the GPU). fp32
weights and activations, AdamW, SDPA attention, Ulysses, batch 1 of unpadded tokens, labels on
every token. For sp > 1 the weights, gradients and optimizer states are sharded with FSDP2 over the
sp ranks (the layout's dp x sp dim, seqpar_hf.training.fsdp.shard_model); sp = 1 is one plain
process. Options: gradient checkpointing (every decoder layer) and the tiled logits loss, off and on.

Per-rank memory is counted exactly on CPU: one rank of an sp-way group runs in one process joined to
a single-process "fake" process group of world size sp (collectives return at once, received buffers
are zeroed; only memory is meaningful here), and torch's MemTracker
(torch.distributed._tools.mem_tracker) follows every storage the step allocates and frees: parameters,
gradients, optimizer states, activations saved for backward, temporaries (logits, FSDP all-gather
buffers, all-to-all buffers). The step measured is a full training step (forward, backward, AdamW
step) after a first one, so the optimizer states exist. On GPU (--device cuda) the same step reads
torch.cuda.max_memory_allocated instead.

The step is extrapolated to long sequences segment by segment: MemTracker's live bytes are recorded
after every op and grouped into segments (a run of ops inside the same module, forward or backward;
the same sequence of segments at every length). Within a segment the peak is affine in the local
length (SDPA keeps no [s, s] tensor; the tiled loss's chunks are of fixed size), so two lengths give
each segment's line, the step's peak at any length is the largest of them (or the optimizer step's,
which does not grow), and a third, longer length checks the prediction. The longest sequence for a
budget is the longest full length (a multiple of 64 x sp) whose predicted peak fits. Target: at
sp = N the longest sequence is at least 0.9 N times the sp = 1 length, per option.

    python -m benchmarks.longest_sequence                    # CPU: bench-44m, ~10 min on 2 cores
    python -m benchmarks.longest_sequence --sp 1 2 --options plain --budget-gib 8
    python -m benchmarks.longest_sequence --device cuda --size bench-155m --budget-gib 80   # GPU

Writes benchmarks/results/longest_sequence.json and .md (and the figure with --plot); the memory
planner (python -m seqpar_hf.plan) is validated against the json (tests/test_plan.py).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks import fake_group

RESULTS = Path(__file__).resolve().parent / "results"
FIGURES = Path(__file__).resolve().parent / "figures"

COMMON = dict(
    vocab_size=32000,
    head_dim=64,
    max_position_embeddings=1 << 20,
    tie_word_embeddings=False,
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
SIZES = {  # the planner knows both (python -m seqpar_hf.plan --model bench-44m)
    "bench-44m": dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2
    ),
    "bench-155m": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4
    ),
}
CONFIG = {**COMMON, **SIZES["bench-44m"]}
OPTIONS = {
    "plain": dict(checkpointing=False, tiled=False),
    "tiled loss": dict(checkpointing=False, tiled=True),
    "checkpointing": dict(checkpointing=True, tiled=False),
    "checkpointing + tiled loss": dict(checkpointing=True, tiled=True),
}


def init_group(sp: int) -> None:
    if sp > 1:
        fake_group.join(sp)
    elif dist.is_initialized():
        dist.destroy_process_group()


def build(sp: int, checkpointing: bool, tiled: bool, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    import seqpar_hf
    from seqpar_hf.training.fsdp import shard_model

    config = LlamaConfig(**CONFIG, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).train()
    model.to(device)  # transformers 5.17 builds on the CPU whatever the default device
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layout = fake_group.layout(sp_size=sp)
    # check_inputs off: its all-gather would compare the fake group's zeros
    seqpar_hf.patch_model(model, layout, check_inputs=False, tiled_loss=tiled)
    if sp > 1:
        shard_model(model, layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
    return model, optimizer


def batch(length: int, device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, CONFIG["vocab_size"], (1, length), generator=g).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def step(model, optimizer, inputs):
    forward_backward(model, inputs)
    optimizer_step(optimizer)


def forward_backward(model, inputs):
    model(**inputs).loss.backward()


def optimizer_step(optimizer):
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class Timeline:
    """Peak live bytes per segment of the step (a run of ops in the same module, forward or backward),
    from torch's MemTracker, which follows every storage the step allocates and frees."""

    def __init__(self):
        from torch.distributed._tools.mem_tracker import MemTracker

        segments = self.segments = []

        class Tracker(MemTracker):
            def _update_peak_stats(self, peak_state):
                total = sum(snap.get("Total", 0) for snap in self._curr_mem_snap.values())
                key = (tuple(sorted(self._mod_tracker.parents)), self._mod_tracker.is_bw)
                if segments and segments[-1][0] == key:
                    segments[-1][1] = max(segments[-1][1], total)
                else:
                    segments.append([key, total])
                super()._update_peak_stats(peak_state)

        self.tracker = Tracker()

    def run(self, fn, model, optimizer) -> dict:
        self.tracker.track_external(model, optimizer)
        with self.tracker:
            fn()
        snapshot = next(iter(self.tracker.get_tracker_snapshot("peak").values()))
        return {str(k.value if hasattr(k, "value") else k).lower(): int(v) for k, v in snapshot.items()}


def measure(sp: int, lengths: list[int], option: dict, device: str) -> list[dict]:
    """Rank 0's forward + backward at each local length: the peak, its parts, and the peak per segment
    of the step (for the extrapolation); the optimizer step's peak after each."""
    model, optimizer = build(sp, option["checkpointing"], option["tiled"], device)
    step(model, optimizer, batch(lengths[0] * sp, device))  # creates the optimizer states
    records = []
    for local in lengths:
        inputs = batch(local * sp, device)
        gc.collect()
        start = time.perf_counter()
        record = {"sp": sp, "local": local, "length": local * sp}
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            forward_backward(model, inputs)
            torch.cuda.synchronize()
            record["total"] = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            optimizer_step(optimizer)
            record["optimizer_total"] = torch.cuda.max_memory_allocated()
        else:
            timeline = Timeline()
            record.update(timeline.run(functools.partial(forward_backward, model, inputs), model, optimizer))
            record["segments"] = [total for _, total in timeline.segments]
            record["segment_keys"] = [
                f"{'bw' if bw else 'fw'} {parents[-1] if parents else '-'}" for (parents, bw), _ in timeline.segments
            ]
            optimizer_record = Timeline().run(functools.partial(optimizer_step, optimizer), model, optimizer)
            record["optimizer_total"] = optimizer_record["total"]
        record["seconds"] = time.perf_counter() - start
        records.append(record)
    del model, optimizer
    gc.collect()
    return records


def fit(points: list[dict]):
    """Peak as a function of the local length: per segment, a line through the first two lengths;
    the step's peak is the largest segment (plus the optimizer step's, which does not grow)."""
    a, b = points[0], points[1]
    if "segments" not in a or a["segment_keys"] != b["segment_keys"]:  # GPU: the step's peak alone
        lines = [(a["total"], b["total"])]
    else:
        lines = list(zip(a["segments"], b["segments"]))
    la, lb = a["local"], b["local"]
    lines = [((pb - pa) / (lb - la), pa - (pb - pa) / (lb - la) * la) for pa, pb in lines]
    floor = max(p["optimizer_total"] for p in points)

    def peak(local: float) -> float:
        return max(floor, max(slope * local + icept for slope, icept in lines))

    return peak, lines


def longest(peak, sp: int, budget: float) -> int:
    """The longest full length (a multiple of 64 x sp) whose predicted peak fits in the budget."""
    unit = 64
    lo, hi = 0, 1
    while peak(hi * unit) <= budget and hi < 1 << 24:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid * unit) <= budget else (lo, mid)
    return lo * unit * sp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument(
        "--lengths",
        type=int,
        nargs=3,
        default=[768, 1280, 2048],
        help="local tokens per rank: two for the fit, a third to check it (at least the "
        "tiled loss's chunk, 524 tokens of a 32K vocabulary, so that chunks are full)",
    )
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    parser.add_argument("--budget-gib", type=float, default=16.0, help="per-rank memory budget")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--size",
        choices=list(SIZES),
        default="bench-44m",
        help="bench-44m on CPU (minutes); bench-155m (8 layers, hidden 1024) on GPU",
    )
    parser.add_argument("--out", default=str(RESULTS / "longest_sequence"))
    parser.add_argument("--plot", action="store_true")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other sp values' results already in --out (re-measure some sp only)",
    )
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    CONFIG.update(SIZES[args.size])
    budget = args.budget_gib * 2**30
    records, rows = [], []
    for sp in args.sp:
        init_group(sp)
        for name in args.options:
            points = measure(sp, args.lengths, OPTIONS[name], args.device)
            for p in points:
                p["option"] = name
            records += points
            peak, lines = fit(points)
            check = points[2]
            row = {
                "sp": sp,
                "option": name,
                "slope": max(sl for sl, _ in lines),
                "lengths": args.lengths,
                "peaks": [p["total"] for p in points],
                "optimizer_peak": max(p["optimizer_total"] for p in points),
                "predicted_third": peak(check["local"]),
                "fit_error": abs(peak(check["local"]) - max(check["total"], check["optimizer_total"]))
                / max(check["total"], check["optimizer_total"]),
                "longest": longest(peak, sp, budget),
            }
            row["peak_at_longest"] = peak(row["longest"] / sp)
            rows.append(row)
            print(
                f"sp={sp} {name:28s} peak "
                + " / ".join(f"{p['total'] / 2**20:.1f}" for p in points)
                + f" MiB at {args.lengths} local tokens; third predicted {row['predicted_third'] / 2**20:.1f}; "
                f"longest {row['longest']}",
                flush=True,
            )
    previous = Path(args.out + ".json")
    if args.merge and previous.exists():
        old = json.loads(previous.read_text())
        records = [r for r in old["records"] if r["sp"] not in args.sp] + records
        rows = sorted([r for r in old["rows"] if r["sp"] not in args.sp] + rows, key=lambda r: r["sp"])
    first = min(r["sp"] for r in rows)
    for row in rows:
        base = next(r for r in rows if r["option"] == row["option"] and r["sp"] == first)
        row["vs_sp1"] = row["longest"] / base["longest"] if base["longest"] else float("nan")
        row["target_met"] = row["vs_sp1"] >= 0.9 * row["sp"] / base["sp"]
    out = {
        "size": args.size,
        "config": CONFIG,
        "budget_bytes": budget,
        "device": args.device,
        "lengths": args.lengths,
        "records": records,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    Path(args.out + ".md").write_text(markdown(out))
    print(markdown(out))
    if args.plot:
        plot(out, FIGURES / "longest_sequence.png")


def markdown(out: dict) -> str:
    rows = out["rows"]
    options = list(dict.fromkeys(r["option"] for r in rows))
    sps = sorted({r["sp"] for r in rows})
    lines = [
        f"Longest sequence per rank budget {out['budget_bytes'] / 2**30:g} GiB ({out['device']}; "
        "in tokens, x = ratio to sp=1; target >= 0.9 sp)",
        "",
        "| option | " + " | ".join(f"sp={s}" for s in sps) + " |",
        "|---" * (len(sps) + 1) + "|",
    ]
    for o in options:
        cells = []
        for s in sps:
            r = next(r for r in rows if r["option"] == o and r["sp"] == s)
            cells.append(f"{r['longest']:,} ({r['vs_sp1']:.2f}x)")
        lines.append(f"| {o} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per-rank peak (MiB) at the measured local lengths; the third predicted from the first two:",
        "",
        "| sp | option | local tokens | measured peaks | optimizer step | third predicted | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['sp']} | {r['option']} | {', '.join(map(str, r['lengths']))} | "
            + ", ".join(f"{p / 2**20:.0f}" for p in r["peaks"])
            + f" | {r['optimizer_peak'] / 2**20:.0f} | "
            f"{r['predicted_third'] / 2**20:.0f} | {100 * r['fit_error']:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sps = sorted({r["sp"] for r in out["rows"]})
    for o in dict.fromkeys(r["option"] for r in out["rows"]):
        ax.plot(
            sps,
            [next(r for r in out["rows"] if r["option"] == o and r["sp"] == s)["longest"] for s in sps],
            marker="o",
            label=o,
        )
    ax.set_xscale("log", base=2), ax.set_yscale("log", base=2)
    ax.set_xlabel("sp (ranks per sequence)"), ax.set_ylabel("longest sequence (tokens)")
    ax.set_title(f"Llama-like {out['size']}, fp32 AdamW, {out['budget_bytes'] / 2**30:g} GiB per rank")
    ax.grid(alpha=0.3), ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout(), fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
