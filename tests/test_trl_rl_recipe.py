"""Tier 1: the GRPO recipe's task and rewards (recipes/grpo_long_context.py) and its reward plot, without a
process group or the Tatoeba data. Skipped without trl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
sys.path.insert(0, str(RECIPES))

import grpo_long_context as recipe  # noqa: E402
import plot_rewards  # noqa: E402

from .runs.trl_trainers import tokenizer  # noqa: E402


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
    rows = [{"step": i, "time": 60.0 * i, "reward": 0.1 * i, "rewards/first_sentence/mean": 0.1 * i,
             "rewards/first_words/mean": 0.0} for i in range(1, 6)]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + [{"step": 5, "eval_reward": 1}]))
    out = plot_rewards.plot(plot_rewards.load(tmp_path), tmp_path / "reward.png", window=2, title="t")
    assert out.stat().st_size > 0
    assert plot_rewards.smooth([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
