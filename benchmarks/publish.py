"""Where a benchmark's records go: its options `--json`, `--figures`, `--no-plot`, and `publish()`,
which writes the records and, after a full run, draws the figure (benchmarks/plot.py).

A `--quick` run writes nothing unless `--json FILE` is given, so validating a script never
overwrites the results of a full run.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import FIGURES, RESULTS, write_json


def output_options(parser, name: str, figure: bool = True) -> None:
    """Add `--json` (and, for a script with a figure, `--figures` and `--no-plot`) to `parser`."""
    parser.add_argument("--json", default=None, help=f"records file (default {RESULTS}/{name}.json; none with --quick)")
    if figure:
        parser.add_argument("--figures", default=str(FIGURES), help=f"folder for {name}.png")
        parser.add_argument("--no-plot", action="store_true")


def json_path(args, name: str) -> Path | None:
    """`--json`, else results/<name>.json after a full run, else nothing."""
    return Path(args.json) if args.json else (None if args.quick else RESULTS / f"{name}.json")


def publish(name: str, records: list[dict], args) -> None:
    """Write the records to `json_path(args, name)` and, when written and plotting is on, the figure."""
    path = json_path(args, name)
    write_json(path, records)
    if path and hasattr(args, "figures") and not args.no_plot:
        try:
            from benchmarks.plot import PLOTS  # matplotlib only when drawing
        except ImportError as exc:  # the records are written: a missing plotting library costs no run
            print(f"no figure ({exc}); pip install matplotlib, then python -m benchmarks.plot")
            return
        print("figure:", PLOTS[name](records, args.figures))
