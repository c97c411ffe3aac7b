"""The planner against measurements: benchmarks/longest_sequence.py's exact per-rank peaks
(`python -m seqpar_hf.plan --validate benchmarks/results/longest_sequence.json`)."""

from __future__ import annotations

from pathlib import Path

from .checks import GIB
from .configs import from_config, read_json
from .memory import Layout, plan
from .search import longest

# the benchmark's options: (gradient checkpointing, tiled loss)
OPTIONS = {
    "plain": (False, False),
    "tiled loss": (False, True),
    "checkpointing": (True, False),
    "checkpointing + tiled loss": (True, True),
}


def validate(path: str) -> list[dict]:
    """Predicted against measured per-rank peaks, for every record of a benchmarks/longest_sequence.py
    json (fp32, Ulysses, FSDP over sp); prints a markdown table and returns the rows. ValueError when
    the file is missing or is not such a json."""
    results = read_json(Path(path))
    what = f"{path}: not a benchmarks/longest_sequence.py result"
    missing = [k for k in ("config", "records", "rows", "budget_bytes") if k not in results]
    if missing or not isinstance(results["config"], dict) or not results["records"]:
        raise ValueError(f"{what} (" + (f"no {', '.join(missing)}" if missing else "no records") + ")")
    model = from_config(results["config"], f"{path} (config)")
    try:
        rows = [_compare(model, record) for record in results["records"]]
        table = {
            option: [
                _longest_cell(model, row, results["budget_bytes"]) for row in results["rows"] if row["option"] == option
            ]
            for option in OPTIONS
        }
    except KeyError as e:
        raise ValueError(f"{what} (a record or row has no {e})") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ValueError(f"{what} ({type(e).__name__}: {e})") from None
    print("| sp | option | tokens per rank | measured MiB | predicted MiB | error | peak at (predicted) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['sp']} | {r['option']} | {r['local']} | {r['measured'] / 2**20:.0f} | {r['predicted'] / 2**20:.0f} "
            f"| {100 * r['error']:+.1f}% | {r['moment']} |"
        )
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(
        f"\nworst: {100 * worst['error']:+.1f}% (sp={worst['sp']}, {worst['option']}, {worst['local']} tokens per rank)"
    )
    print(
        f"\nLongest sequence in {results['budget_bytes'] / GIB:g} GiB per rank, benchmark (extrapolated from its "
        "measurements) / planner:\n"
    )
    print("| option | " + " | ".join(f"sp={r['sp']}" for r in results["rows"] if r["option"] == "plain") + " |")
    print("|---" * (1 + len(table["plain"])) + "|")
    for option, cells in table.items():
        if cells:
            print(f"| {option} | " + " | ".join(cells) + " |")
    return rows


def _compare(model, record: dict) -> dict:
    checkpointing, tiled = OPTIONS[record["option"]]
    layout = Layout(sp=record["sp"], checkpointing=checkpointing, tiled=tiled)
    predicted = plan(model, layout, record["length"], gpus=record["sp"], act_bytes=4)
    measured = max(record["total"], record["optimizer_total"])
    return dict(
        sp=record["sp"],
        option=record["option"],
        local=record["local"],
        measured=measured,
        predicted=predicted.peak,
        moment=predicted.moment,
        error=(predicted.peak - measured) / measured,
    )


def _longest_cell(model, row: dict, budget: float) -> str:
    """'benchmark / planner (difference)' for one row of the benchmark's longest-sequence table."""
    checkpointing, tiled = OPTIONS[row["option"]]
    mine = longest(model, Layout(sp=row["sp"], checkpointing=checkpointing, tiled=tiled), budget, row["sp"])
    return f"{row['longest']:,} / {mine:,} ({100 * (mine - row['longest']) / row['longest']:+.1f}%)"
