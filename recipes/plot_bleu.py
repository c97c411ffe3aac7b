"""BLEU against training minutes for translation runs, from their own summaries (recipes/train_translation.py
writes <output_dir>/run_summary.json): validation BLEU of each periodic evaluation (greedy), and the test
BLEU (beam search) at the end of each run. A run is its output_dir or a copy of its summary (NAME.json); the
tracked figure is drawn from the summaries kept in benchmarks/results/translation_runs/:

    python recipes/plot_bleu.py runs/default runs/sp2 runs/documents --out translation_bleu.png
    python recipes/plot_bleu.py benchmarks/results/translation_runs/documents-*.json --steps_panel \\
        --baseline 57.70 "the sentence model's translations of the test documents, joined (document BLEU)"
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

if __package__:  # imported as recipes.plot_bleu (tests)
    from .figures import pyplot, save
else:  # run as a script: its folder is on sys.path
    from figures import pyplot, save


def summary_file(run: Path) -> Path:
    """An output_dir holds run_summary.json; a kept copy is the file itself."""
    return run if run.suffix == ".json" else run / "run_summary.json"


def run_name(run: Path) -> str:
    return run.stem if run.suffix == ".json" else run.name


def label(summary: dict, run_dir: Path) -> str:
    parts = [f"sp={summary.get('sp_size', 1)}"]
    if summary.get("document_sentences", 1) > 1:
        command = summary.get("command", [])
        given = command[command.index("--mixed_documents") + 1 :][:1] if "--mixed_documents" in command else []
        # N sentences each: said so, or the default since 2026-12-05 (a summary with `mixed_documents` says which)
        fixed = not summary["mixed_documents"] if "mixed_documents" in summary else given in ([], ["false"], ["False"])
        parts.append(
            f"documents of {'' if fixed else 'up to '}{summary['document_sentences']} sentences (document BLEU)"
        )
    else:
        parts.append("sentences")
    if "precision" in summary:  # what the machine computed in (bf16 where the CPU has AVX512-BF16 or AMX)
        parts.append(summary["precision"])
    if "machine" in summary:  # the CPU and its instructions (recorded since 2026-12-06): speed differs 2.6x
        parts.append(f"on {summary['machine']}")
    return f"{run_name(run_dir)}: " + ", ".join(parts)


def plot(
    run_dirs: list[Path], out: Path, baselines: Sequence[tuple[float, str]] = (), steps_panel: bool = False
) -> Path:
    """Validation BLEU (greedy) of each evaluation against training minutes, a line per run; the test BLEU
    (beam search) as a star at the end of training, with its value; a warm start on sentences shaded; each
    baseline (a BLEU to reach) a dashed line across. With `steps_panel`, a second panel: each run's test BLEU
    against the steps it trained (after a warm start on sentences: its steps on documents), which is what
    tells runs apart when the machine's speed moves between them."""
    plt = pyplot()
    height = 5.5 + 0.15 * max(0, len(run_dirs) + len(baselines) - 6)
    if steps_panel:
        # wide: the steps panel's names stand in a column right of it
        fig, (ax, by_steps) = plt.subplots(1, 2, figsize=(17, height), gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(8, height))
    stars = []
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(run_dirs))]
    for value, text in baselines:
        ax.axhline(value, color="black", linestyle="--", linewidth=0.8, label=f"{value:.2f}: {text}")
    summaries = [json.loads(summary_file(run_dir).read_text()) for run_dir in run_dirs]
    for run_dir, summary, color in zip(run_dirs, summaries, colors):
        curve = summary["eval_curve"]
        warm = summary.get("sentence_warmup_minutes", 0)
        start = [] if warm else [(0, 0)]  # after a warm start on sentences, the documents' first BLEU is unknown
        points = start + [(p["minutes"], p["eval_bleu"]) for p in curve]
        ax.plot(
            [m for m, _ in points],
            [b for _, b in points],
            marker="o",
            ms=3,
            color=color,
            label=f"{label(summary, run_dir)}; test {summary['test_bleu']:.2f}",
        )
        end = curve[-1]["minutes"] if curve else 0
        ax.scatter([end], [summary["test_bleu"]], marker="*", s=140, color=color, zorder=3)
        stars.append((end, summary["test_bleu"], color))
    warm_runs: dict[float, list[int]] = {}  # one shade and one note per warm-start length
    for i, summary in enumerate(summaries):
        if summary.get("sentence_warmup_minutes", 0):
            warm_runs.setdefault(summary["sentence_warmup_minutes"], []).append(i)
    for row, (warm, runs) in enumerate(sorted(warm_runs.items())):
        color = colors[runs[0]] if len(runs) == 1 else "gray"
        who = run_name(run_dirs[runs[0]]) if len(runs) == 1 else f"{len(runs)} runs"
        ax.axvspan(0, warm, color=color, alpha=0.06)
        ax.text(warm, 1 + 4 * row, f"{who}: sentences until {warm:g} min ", color=color, fontsize=7, ha="right")
    for end, bleu, color in stars:  # the value above its star, below where a higher star stands close by
        crowded = sum(abs(end - x) < 3 and abs(bleu - y) < 1.5 for x, y, _ in stars) > 1
        if crowded:  # values too close to read apart: the legend gives each run's
            continue
        below = any(abs(end - x) < 3 and bleu < y < bleu + 3 for x, y, _ in stars)
        ax.annotate(
            f"{bleu:.2f}",
            (end, bleu),
            textcoords="offset points",
            xytext=(7, -10 if below else 2),
            color=color,
            fontsize=8,
        )
    beams = "/".join(str(b) for b in sorted({summary.get("test_beams", 4) for summary in summaries}))
    ax.scatter(
        [], [], marker="*", s=100, color="gray", label=f"test BLEU (beam {beams}, all test sentences / documents)"
    )
    ax.set_xlabel("minutes of training (2 CPU cores); lines: validation BLEU, greedy")
    ax.set_ylabel("BLEU")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=7, ncol=1, frameon=False)
    ax.set_title("English -> French on Tatoeba: BLEU against training time")
    if steps_panel:
        for value, _ in baselines:
            by_steps.axhline(value, color="black", linestyle="--", linewidth=0.8)
        # the names in one column right of the panel, in the order of their BLEU, each at its star's height
        # where the others leave room, a thin line to its star: none overlaps however close the runs are
        order = sorted(range(len(summaries)), key=lambda i: -summaries[i]["test_bleu"])
        bleus = [summaries[i]["test_bleu"] for i in order]
        gap = max(0.45, (max(bleus) - min(bleus)) / max(len(bleus), 1) * 0.9)
        heights: list[float] = []
        for bleu in bleus:  # down from the best, at least `gap` apart
            heights.append(min(bleu, heights[-1] - gap) if heights else bleu)
        for i, height in zip(order, heights):
            summary, color = summaries[i], colors[i]
            by_steps.scatter([summary["steps"]], [summary["test_bleu"]], marker="*", s=140, color=color, zorder=3)
            by_steps.annotate(
                f"{run_name(run_dirs[i])} {summary['test_bleu']:.2f}",
                (summary["steps"], summary["test_bleu"]),
                xytext=(1.03, height),
                textcoords=("axes fraction", "data"),
                va="center",
                color=color,
                fontsize=7,
                arrowprops={"arrowstyle": "-", "color": color, "alpha": 0.4, "linewidth": 0.6},
            )
        shown = [*heights, *bleus, *(value for value, _ in baselines)]
        by_steps.set_ylim(min(shown) - gap, max(shown) + gap)
        by_steps.margins(x=0.1)
        by_steps.set_xlabel("steps trained (after a warm start on sentences: steps on documents)")
        by_steps.set_ylabel(f"test BLEU (beam {beams})")
        by_steps.grid(alpha=0.3)
        by_steps.set_title("test BLEU against the steps each run trained")
    return save(fig, out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "run_dirs",
        type=Path,
        nargs="+",
        help="output_dir of each run (holds run_summary.json), or a copy of a run's summary (NAME.json)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/figures/translation_bleu.png"))
    parser.add_argument(
        "--baseline",
        nargs=2,
        action="append",
        default=[],
        metavar=("BLEU", "LABEL"),
        help="a BLEU to compare against, drawn as a dashed line (repeatable)",
    )
    parser.add_argument(
        "--steps_panel",
        action="store_true",
        help="a second panel: test BLEU against the steps each run trained (what the machine's speed changes)",
    )
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.run_dirs if not summary_file(d).is_file()]
    if missing:
        parser.error(
            f"no run_summary.json in {', '.join(missing)} (written at the end of recipes/train_translation.py)"
        )
    baselines = []
    for value, text in args.baseline:
        try:
            baselines.append((float(value), text))
        except ValueError:
            parser.error(f"--baseline {value!r} {text!r}: the first value is a BLEU score, a number")
    print(plot(args.run_dirs, args.out, baselines, args.steps_panel))


if __name__ == "__main__":
    main()
