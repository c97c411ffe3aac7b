"""BLEU against training minutes for translation runs, from their own summaries (recipes/train_translation.py
writes <output_dir>/run_summary.json): validation BLEU of each periodic evaluation (greedy), and the test
BLEU (beam search) at the end of each run.

    python recipes/plot_bleu.py runs/default runs/sp2 runs/documents --out benchmarks/figures/translation_bleu.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

if __package__:  # imported as recipes.plot_bleu (tests)
    from .figures import pyplot, save
else:  # run as a script: its folder is on sys.path
    from figures import pyplot, save


def label(summary: dict, run_dir: Path) -> str:
    parts = [f"sp={summary.get('sp_size', 1)}"]
    if summary.get("document_sentences", 1) > 1:
        command = summary.get("command", [])
        fixed = "--mixed_documents" in command and command[command.index("--mixed_documents") + 1 :][:1] in (
            ["false"],
            ["False"],
        )
        parts.append(
            f"documents of {'' if fixed else 'up to '}{summary['document_sentences']} sentences (document BLEU)"
        )
    else:
        parts.append("sentences")
    if "precision" in summary:  # what the machine computed in (bf16 where the CPU has AVX512-BF16 or AMX)
        parts.append(summary["precision"])
    return f"{run_dir.name}: " + ", ".join(parts)


def plot(run_dirs: list[Path], out: Path) -> Path:
    """Validation BLEU (greedy) of each evaluation against training minutes, a line per run; the test BLEU
    (beam search) as a star at the end of training, with its value; a warm start on sentences shaded."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    warm_starts, stars = 0, []
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
    for run_dir, color in zip(run_dirs, colors):
        summary = json.loads((run_dir / "run_summary.json").read_text())
        curve = summary["eval_curve"]
        warm = summary.get("sentence_warmup_minutes", 0)
        start = [] if warm else [(0, 0)]  # after a warm start on sentences, the documents' first BLEU is unknown
        points = start + [(p["minutes"], p["eval_bleu"]) for p in curve]
        ax.plot(
            [m for m, _ in points], [b for _, b in points], marker="o", ms=3, color=color, label=label(summary, run_dir)
        )
        if warm:
            ax.axvspan(0, warm, color=color, alpha=0.08)
            ax.text(
                warm,
                1 + 4 * warm_starts,
                f"{run_dir.name}: sentences until {warm:g} min ",
                color=color,
                fontsize=7,
                ha="right",
                va="bottom",
            )
            warm_starts += 1
        end = curve[-1]["minutes"] if curve else 0
        ax.scatter([end], [summary["test_bleu"]], marker="*", s=140, color=color, zorder=3)
        stars.append((end, summary["test_bleu"], color))
    for end, bleu, color in stars:  # the value above its star, below where a higher star stands close by
        below = any(abs(end - x) < 3 and bleu < y < bleu + 3 for x, y, _ in stars)
        ax.annotate(
            f"{bleu:.2f}",
            (end, bleu),
            textcoords="offset points",
            xytext=(7, -10 if below else 2),
            color=color,
            fontsize=8,
        )
    ax.scatter([], [], marker="*", s=100, color="gray", label="test BLEU (beam 4, all test sentences / documents)")
    ax.set_xlabel("minutes of training (2 CPU cores); lines: validation BLEU, greedy")
    ax.set_ylabel("BLEU")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=7, ncol=1, frameon=False)
    ax.set_title("English -> French on Tatoeba: BLEU against training time")
    return save(fig, out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", type=Path, nargs="+", help="output_dir of each run (holds run_summary.json)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/figures/translation_bleu.png"))
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.run_dirs if not (d / "run_summary.json").is_file()]
    if missing:
        parser.error(
            f"no run_summary.json in {', '.join(missing)} (written at the end of recipes/train_translation.py)"
        )
    print(plot(args.run_dirs, args.out))


if __name__ == "__main__":
    main()
