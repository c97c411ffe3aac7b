"""PNG figures from the benchmark JSON records (each script also calls its function after a full run).

From the repository root:

    python -m benchmarks.plot                          # every benchmarks/results/<name>.json present
    python -m benchmarks.plot --results DIR --out DIR  # elsewhere
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from benchmarks.common import FIGURES, RESULTS, records_of

MIB, GIB = 2**20, 2**30


def _save(fig, out_dir, name: str) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _mode_label(r: dict) -> str:
    mode = r["mode"] + (f" r{r['ring_size']}" if r["mode"] == "hybrid" and r.get("ring_size") else "")
    return mode if mode in ("unpatched", "sp1") else f"{mode} sp={r['sp']}"


def plot_activation_memory(records: list[dict], out_dir=FIGURES) -> Path:
    """Saved-for-backward bytes per rank against sequence length, one line per (mode, sp), log-log."""
    models = sorted({r["model"] for r in records})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        lines = defaultdict(list)
        for r in records:
            if r["model"] == model:
                lines[_mode_label(r)].append((r["seq_len"], r["saved_bytes_per_rank"] / MIB))
        for label, pts in sorted(lines.items()):
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=label)
        for sp in sorted({r["sp"] for r in records}):  # Megatron without the s^2 term, for reference
            pts = sorted(
                {
                    (r["seq_len"], r["megatron_fp32_no_s2_bytes"] / MIB)
                    for r in records
                    if r["model"] == model and r["sp"] == sp
                }
            )
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, ls=":", color="gray", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("full sequence length (tokens)")
        ax.set_ylabel("saved for backward per rank (MiB)")
        ax.set_title(f"{model} (dotted: Megatron 34sbh/sp, fp32)")
        ax.legend(fontsize=7)
    return _save(fig, out_dir, "activation_memory")


def plot_comm_volume(records: list[dict], out_dir=FIGURES) -> Path:
    """Bytes sent per rank per step (all attention layers), measured next to the formula."""
    att = [r for r in records if r["part"] == "attention"]
    models = sorted({r["model"] for r in att})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        totals = defaultdict(lambda: [0.0, 0.0])
        for r in att:
            if r["model"] == model:
                key = _mode_label(r)
                totals[key][0] += r["sent_per_step"] / MIB
                totals[key][1] += r["formula_per_step"] / MIB
        labels = list(totals)
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], [totals[k][0] for k in labels], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [totals[k][1] for k in labels], 0.4, label="formula")
        ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("MiB sent per rank per step")
        ax.set_title(f"{model}: attention communication (fwd + bwd)")
        ax.legend()
    return _save(fig, out_dir, "comm_volume")


def _bars(ax, labels, medians, lows, highs, ylabel, title):
    xs = range(len(labels))
    err = [[m - lo for m, lo in zip(medians, lows)], [hi - m for m, hi in zip(medians, highs)]]
    ax.bar(list(xs), medians, yerr=err, capsize=4)
    ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def plot_throughput(records: list[dict], out_dir=FIGURES) -> Path:
    """Tokens per second, median with min-max bars, for the overhead and the long-sequence parts."""
    parts = [p for p in ("overhead", "long") if any(r["part"] == p for r in records)]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts):
        rs = [r for r in records if r["part"] == part]
        _bars(
            ax,
            [f"{r['variant']}\n{r['processes']}x{r['threads_per_process']}" for r in rs],
            [r["tokens_per_s"] for r in rs],
            [r["tokens_per_step"] / r["step_s"]["max"] for r in rs],
            [r["tokens_per_step"] / r["step_s"]["min"] for r in rs],
            "tokens / s",
            f"{rs[0]['model']}: "
            + (
                "patch overhead"
                if part == "overhead"
                else f"{max(r['seq_len'] for r in rs)} tokens (src + tgt per step)"
            ),
        )
    return _save(fig, out_dir, "throughput")


def plot_vs_deepspeed(records: list[dict], out_dir=FIGURES) -> Path:
    """Median time ratio ours / DeepSpeed per case, min-max bars; below 1 means ours is faster."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [
        (f"attn {r['seq_len']}" if r["part"] == "attention" else f"{r['model']} {r['seq_len']}")
        + (" causal" if r["causal"] else "")
        for r in records
    ]
    _bars(
        ax,
        labels,
        [r["ratio_median"] for r in records],
        [r["ratio"]["min"] for r in records],
        [r["ratio"]["max"] for r in records],
        "time ours / DeepSpeed",
        "Ulysses: seqpar_hf vs DeepSpeed (sp=2)",
    )
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    return _save(fig, out_dir, "vs_deepspeed")


def plot_vs_peers(records: list[dict], out_dir=FIGURES) -> Path:
    """Median time ratio ours / peer per case (min-max bars), one panel per peer, stacked; below 1: ours
    faster. The patched path as it runs (`seqpar_hf`); other variants of ours only without it."""
    pairs = sorted({p for r in records for p in r["ratios"]})
    pairs = [p for p in pairs if p.startswith("seqpar_hf/")] or pairs
    fig, axes = plt.subplots(len(pairs), 1, figsize=(14, 3.8 * len(pairs)), squeeze=False)
    for ax, pair in zip(axes[:, 0], pairs):
        rs = [r for r in records if pair in r["ratios"]]
        labels = [
            (
                f"attn kv={r['kv_heads']} {r['seq_len']}"
                if r["part"] == "attention"
                else f"step {r['layers']}L {r['seq_len']}"
            )
            + f" sp={r['sp']}"
            for r in rs
        ]
        _bars(
            ax,
            labels,
            [r["ratios"][pair]["median"] for r in rs],
            [r["ratios"][pair]["min"] for r in rs],
            [r["ratios"][pair]["max"] for r in rs],
            f"time {pair}",
            f"Ulysses, {pair.replace('/', ' / ')}",
        )
        ax.axhline(1.0, color="gray", ls="--", lw=1)
    return _save(fig, out_dir, "vs_peers")


def plot_gpu_rank(records: list[dict], out_dir=FIGURES) -> Path:
    """Peak memory and step time per rank against sequence length; rows: models, columns: ckpt off/on."""
    steps = [r for r in records if r["part"] == "step"]
    models = sorted({r["model"] for r in steps})
    panels = [(False, "time"), (True, "time")]
    if any("peak_bytes" in r for r in steps):  # no memory numbers from a CPU run
        panels = [(False, "mem"), (True, "mem")] + panels
    fig, axes = plt.subplots(
        max(len(models), 1), len(panels), figsize=(5 * len(panels), 4.5 * max(len(models), 1)), squeeze=False
    )
    for row, model in zip(axes, models):
        for col, (ckpt, what) in enumerate(panels):
            ax, lines = row[col], defaultdict(list)
            for r in steps:
                if r["model"] == model and r["checkpointing"] == ckpt:
                    y = r.get("peak_bytes", 0) / GIB if what == "mem" else r["step_s"]
                    lines[f"{r['mode']} sp={r['sp']}"].append((r["seq_len"], y))
            for label, pts in sorted(lines.items()):
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("full sequence length")
            ax.set_ylabel("peak GiB per rank" if what == "mem" else "step s per rank (no comm)")
            ax.set_title(f"{model}, checkpointing {'on' if ckpt else 'off'}")
            ax.legend(fontsize=7)
    return _save(fig, out_dir, "gpu_rank")


PLOTS = {
    "activation_memory": plot_activation_memory,
    "comm_volume": plot_comm_volume,
    "throughput": plot_throughput,
    "vs_deepspeed": plot_vs_deepspeed,
    "vs_peers": plot_vs_peers,
    "gpu_rank": plot_gpu_rank,
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(RESULTS), help="folder with <name>.json")
    p.add_argument("--out", default=str(FIGURES), help="folder for <name>.png")
    args = p.parse_args(argv)
    found = False
    for name, fn in PLOTS.items():
        path = Path(args.results) / f"{name}.json"
        if path.exists():
            found = True
            print(fn(records_of(path), args.out))
    if not found:
        print(f"no results in {args.results}")


if __name__ == "__main__":
    main()
