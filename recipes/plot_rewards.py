"""Reward against step from a GRPO run's log (recipes/grpo_long_context.py writes <output_dir>/log.jsonl).

From the repository root:

    python recipes/plot_rewards.py runs/grpo_long_context                      # -> runs/grpo_long_context/reward.png
    python recipes/plot_rewards.py runs/grpo_long_context --out benchmarks/figures/grpo_reward.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

if __package__:  # imported as recipes.plot_rewards (tests)
    from .figures import pyplot, save
else:  # run as a script: its folder is on sys.path
    from figures import pyplot, save

CURVES = (
    ("reward", "reward (sum)"),
    ("rewards/first_sentence/mean", "first_sentence (F1)"),
    ("rewards/first_words/mean", "first_words (prefix)"),
)


def load(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line.strip()]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` steps (the rewards of one step are one prompt's group: noisy)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(rows: list[dict], out: Path, window: int, title: str) -> Path:
    rows = [r for r in rows if "reward" in r]
    steps = [r["step"] for r in rows]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (key, label), color in zip(CURVES, ("black", "tab:blue", "tab:orange")):
        if all(key in r for r in rows):
            values = [r[key] for r in rows]
            total = key == "reward"  # the sum, dashed and on top: it equals a part whenever the others are 0
            ax.plot(steps, values, color=color, alpha=0.2, lw=0.8)
            ax.plot(
                steps,
                smooth(values, window),
                color=color,
                lw=1.4 if total else 1.8,
                ls="--" if total else "-",
                zorder=3 if total else 2,
                label=f"{label}, mean of {window} steps",
            )
    minutes = (rows[-1]["time"] - rows[0]["time"]) / 60 if rows and "time" in rows[0] else None
    ax.set_xlabel("optimizer step" + (f" ({minutes:.0f} minutes)" if minutes else ""))
    ax.set_ylabel("reward per completion")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return save(fig, out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's output_dir (holds log.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: <run_dir>/reward.png)")
    parser.add_argument("--window", type=int, default=20, help="steps in the trailing mean")
    parser.add_argument("--title", default="GRPO under SP: repeat the first sentence of a long prompt")
    args = parser.parse_args(argv)
    print(plot(load(args.run_dir), args.out or args.run_dir / "reward.png", max(1, args.window), args.title))


if __name__ == "__main__":
    main()
