"""Tier 1: the GRPO recipe's task and rewards (recipes/grpo_long_context.py) and its reward plot, without a
process group or the Tatoeba data. Skipped without trl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from recipes import grpo_long_context as recipe
from recipes import plot_rewards

from .runs.trl_trainers import tokenizer

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_prompts_hold_consecutive_sentences_and_the_first_as_reference():
    tok = tokenizer()
    sentences = [[5, 6, 2], [7, 2], [8, 9, 10, 2], [11, 2], [12, 2]]
    data = recipe.prompts(sentences, per_prompt=2, limit=10, tokenizer=tok)
    assert len(data) == 2  # the fifth sentence does not fill a prompt
    assert data[0]["reference"] == [5, 6]  # without its </s>
    assert data[1]["prompt"] == tok.decode([8, 9, 10, 2, 11, 2])


def test_rewards():
    first_sentence, first_words = recipe.make_rewards(tokenizer())
    reference = [[5, 6, 7, 8, 9]]
    assert first_sentence([[5, 6, 7, 8, 9, 2]], reference) == [1.0]  # </s> is not scored
    assert first_sentence([[9, 8, 40, 41]], reference) == [pytest.approx(2 * 2 / 9)]  # bags: order does not count
    assert first_sentence([[40, 41]], reference) == [0.0]
    assert first_sentence([[5, 5, 5, 5, 5]], reference) == [pytest.approx(2 * 1 / 10)]  # repeating does not pay
    assert first_words([[5, 6, 7, 8, 9]], reference) == [1.0]  # the first 4 tokens, in order
    assert first_words([[5, 6, 40, 8]], reference) == [0.5]
    assert first_words([[6, 5]], reference) == [0.0]


def test_plot_reads_the_log(tmp_path):
    rows = [
        {
            "step": i,
            "time": 60.0 * i,
            "reward": 0.1 * i,
            "rewards/first_sentence/mean": 0.1 * i,
            "rewards/first_words/mean": 0.0,
        }
        for i in range(1, 6)
    ]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + [{"step": 5, "eval_reward": 1}]))
    out = plot_rewards.plot(plot_rewards.load(tmp_path), tmp_path / "reward.png", window=2, title="t")
    assert out.stat().st_size > 0
    assert plot_rewards.smooth([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_pairs", "0"], "--max_pairs 0: must be >= 1 (pairs read from the data file; leave it out for all)"),
        (["--vocab_size", "3"], "--vocab_size 3: must be >= 4 (BPE vocabulary size)"),
        (["--num_kv_heads", "3"], "--num_kv_heads 3: must divide --num_heads"),
        (["--sft_minutes", "-1"], "--sft_minutes -1.0: must be >= 0"),
    ],
)
def test_recipe_flags_checked_before_any_work(argv, message, tmp_path, capsys):
    """A bad flag is argparse's error (exit code 2) naming the value and what is allowed, before any work."""
    base = ["--output_dir", str(tmp_path / "out"), "--data_cache_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        recipe.parse_args(base + argv)
    assert exit_.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_recipe_end_to_end(tmp_path):
    """The recipe as launched (accelerate, 2 CPU processes, sp_size=2) on a small slice: warm-up, GRPO steps,
    the eval reward, a plain checkpoint, and the closing generation (a collective under SP) on every rank."""
    import os
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(RECIPES / "accelerate_cpu_2proc.yaml"),
        str(RECIPES / "grpo_long_context.py"),
        "--sp_size",
        "2",
        "--max_pairs",
        "3000",
        "--vocab_size",
        "500",
        "--sentences_per_prompt",
        "4",
        "--max_prompts",
        "16",
        "--eval_prompts",
        "2",
        "--hidden_size",
        "32",
        "--num_layers",
        "1",
        "--num_heads",
        "2",
        "--num_kv_heads",
        "1",
        "--sft_minutes",
        "0.05",
        "--max_steps",
        "3",
        "--eval_steps",
        "2",
        "--max_completion_length",
        "4",
        "--data_cache_dir",
        str(tmp_path / "cache"),
        "--output_dir",
        str(tmp_path / "out"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=RECIPES.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "3 steps; mean reward of the first tenth" in proc.stdout and "eval at step 2" in proc.stdout, proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2, 3]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert proc.stdout.count("OUT:") == 2
