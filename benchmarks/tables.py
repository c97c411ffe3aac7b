"""The README's result tables, rendered from the benchmark JSON records (no measuring here).

From the repository root:

    python -m benchmarks.tables                  # every benchmarks/results/<name>.json present
    python -m benchmarks.tables --results DIR
"""

from __future__ import annotations

import argparse
import importlib
from collections import defaultdict
from pathlib import Path

from benchmarks.common import RESULTS, fmt_bytes, records_of, table

LAYOUTS = [("unpatched", 1), ("sp1", 1), ("ulysses", 2), ("ring", 2), ("ulysses", 4), ("ring", 4), ("hybrid", 4)]


def activation_memory(records: list[dict]) -> str:
    cells = {(r["model"], r["seq_len"], r["mode"], r["sp"]): r for r in records}
    rows = []
    for model, seq_len in sorted({(r["model"], r["seq_len"]) for r in records}):
        row = {"m": model, "s": seq_len}
        worst = None
        for mode, sp in LAYOUTS:
            r = cells.get((model, seq_len, mode, sp))
            if r is None:
                continue
            text = fmt_bytes(r["saved_bytes_per_rank"])
            if sp > 1:
                text += f" ({r['ratio_to_sp1']:.3f})"
                slack = r["ratio_to_sp1"] * sp  # 1.0 = perfect 1/sp; target <= 1.10
                worst = slack if worst is None else max(worst, slack)
            row[f"{mode}{sp}"] = text
        meg = next((r for r in records if r["model"] == model and r["seq_len"] == seq_len and r["sp"] == 1), None)
        row["meg"] = fmt_bytes(meg["megatron_fp32_no_s2_bytes"]) if meg else "-"
        row["w"] = "-" if worst is None else f"{worst:.3f} x 1/N"
        rows.append(row)
    cols = [
        ("model", "m"),
        ("seq len", "s"),
        ("unpatched", "unpatched1"),
        ("sp=1", "sp11"),
        ("Ulysses sp=2", "ulysses2"),
        ("ring sp=2", "ring2"),
        ("Ulysses sp=4", "ulysses4"),
        ("ring sp=4", "ring4"),
        ("hybrid sp=4", "hybrid4"),
        ("Megatron sp=1 (no s^2)", "meg"),
        ("worst (target <= 1.10 x 1/N)", "w"),
    ]
    return table(rows, cols)


def comm_volume(records: list[dict]) -> str:
    per = defaultdict(lambda: {"sent": 0.0, "formula": 0.0, "extra": 0.0})
    for r in records:
        key = (r["model"], r["mode"], r["sp"], r.get("ring_size"), r["seq_len"], r.get("tgt_len"))
        if r["part"] == "attention":
            per[key]["sent"] += r["sent_per_step"]
            per[key]["formula"] += r["formula_per_step"]
        else:
            per[key]["extra"] += r["sent_per_step"]
    rows = []
    for (model, mode, sp, ring, s, t), v in per.items():
        err = abs(v["sent"] - v["formula"]) / v["formula"] if v["formula"] else 0.0
        rows.append(
            {
                "m": model,
                "len": f"{s} -> {t}" if t else s,
                "mode": mode + (f" (ring {ring})" if mode == "hybrid" else ""),
                "sp": sp,
                "sent": fmt_bytes(v["sent"]),
                "f": fmt_bytes(v["formula"]),
                "e": f"{100 * err:.2f}%",
                "x": fmt_bytes(v["extra"]),
            }
        )
    return table(
        rows,
        [
            ("model", "m"),
            ("tokens", "len"),
            ("mode", "mode"),
            ("sp", "sp"),
            ("sent per rank per step (attention, fwd+bwd)", "sent"),
            ("formula", "f"),
            ("error", "e"),
            ("extras (input check, loss)", "x"),
        ],
    )


def throughput(records: list[dict]) -> str:
    rows = []
    for r in records:
        s = r["step_s"]
        name = r["variant"] + (f" (overhead {100 * r['overhead']:+.1f}%)" if "overhead" in r else "")
        rows.append(
            {
                "run": name,
                "pt": f"{r['processes']} x {r['threads_per_process']}",
                "s": r["seq_len"],
                "t": f"{s['median']:.3f} (±{100 * s['spread']:.0f}%, n={s['n']})",
                "tok": f"{r['tokens_per_s']:.0f}",
            }
        )
    return table(
        rows,
        [
            ("run (marian-small)", "run"),
            ("processes x threads", "pt"),
            ("seq len / rank", "s"),
            ("step s (median, spread, rounds)", "t"),
            ("tokens/s", "tok"),
        ],
    )


TABLES = {"activation_memory": activation_memory, "comm_volume": comm_volume, "throughput": throughput}
OWN_REPORT = (
    "vs_deepspeed",
    "vs_peers",
    "attention_breakdown",
    "gpu_rank",
    "parallel_styles",
)  # scripts whose `report` renders them


def render(name: str, records: list[dict]) -> str:
    if name in OWN_REPORT:
        return importlib.import_module(f"benchmarks.{name}").report(records)
    return TABLES[name](records)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(RESULTS), help="folder with <name>.json")
    args = p.parse_args(argv)
    for name in (*TABLES, *OWN_REPORT):
        path = Path(args.results) / f"{name}.json"
        if path.exists():
            print(f"### {name}\n\n{render(name, records_of(path))}\n")


if __name__ == "__main__":
    main()
