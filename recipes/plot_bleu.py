"""BLEU against training minutes for translation runs, from their own summaries (recipes/train_translation.py
writes <output_dir>/run_summary.json): validation BLEU of each periodic evaluation (greedy), and the test
BLEU (beam search) at the end of each run.

    python recipes/plot_bleu.py runs/default runs/sp2 runs/documents --out benchmarks/figures/translation_bleu.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def pyplot():
    """matplotlib, imported when drawing only (an optional extra: `pip install -e ".[bench]"`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def label(summary: dict, run_dir: Path) -> str:
    parts = [f"sp={summary.get('sp_size', 1)}"]
    if summary.get("document_sentences", 1) > 1:
        parts.append(f"documents of up to {summary['document_sentences']} sentences (document BLEU)")
    else:
        parts.append("sentences")
    return f"{run_dir.name}: " + ", ".join(parts)


def plot(run_dirs: list[Path], out: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for run_dir, color in zip(run_dirs, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")):
        summary = json.loads((run_dir / "run_summary.json").read_text())
        curve = summary["eval_curve"]
        warm = summary.get("sentence_warmup_minutes", 0)
        start = [] if warm else [(0, 0)]  # after a warm start on sentences, the documents' first BLEU is unknown
        points = start + [(p["minutes"], p["eval_bleu"]) for p in curve]
        ax.plot([m for m, _ in points], [b for _, b in points], marker="o", ms=3, color=color,
                label=label(summary, run_dir) + " - validation, greedy")
        if warm:
            ax.axvspan(0, warm, color=color, alpha=0.08, label=f"{run_dir.name}: sentence-level warm start")
        end = curve[-1]["minutes"] if curve else 0
        ax.scatter([end], [summary["test_bleu"]], marker="*", s=140, color=color, zorder=3,
                   label=f"{run_dir.name}: test, beam {summary.get('test_beams', 4)}: {summary['test_bleu']:.2f}")
    ax.set_xlabel("minutes of training (2 CPU cores)")
    ax.set_ylabel("BLEU")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    ax.set_title("English -> French on Tatoeba: BLEU against training time")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", type=Path, nargs="+", help="output_dir of each run (holds run_summary.json)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/figures/translation_bleu.png"))
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.run_dirs if not (d / "run_summary.json").is_file()]
    if missing:
        parser.error(f"no run_summary.json in {', '.join(missing)} (written at the end of recipes/train_translation.py)")
    print(plot(args.run_dirs, args.out))


if __name__ == "__main__":
    main()
