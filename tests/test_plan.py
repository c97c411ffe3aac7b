"""Tier 1: the memory planner (python -m seqpar_hf.plan) against the exact per-rank counts of
benchmarks/longest_sequence.py (benchmarks/results/longest_sequence.json): within 10% for every
configuration and length the benchmark ran, and the longest sequences it implies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seqpar_hf import plan

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "longest_sequence.json"
OPTIONS = {"plain": (False, False), "tiled loss": (False, True), "checkpointing": (True, False),
           "checkpointing + tiled loss": (True, True)}


def _results():
    return json.loads(RESULTS.read_text())


def _model(results):
    config = results["config"]
    return plan.Model(hidden=config["hidden_size"], layers=config["num_hidden_layers"],
                      heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
                      head_dim=config["head_dim"], ffn=config["intermediate_size"], vocab=config["vocab_size"],
                      tied=config["tie_word_embeddings"])


def _predict(model, record):
    checkpointing, tiled = OPTIONS[record["option"]]
    layout = plan.Layout(sp=record["sp"], checkpointing=checkpointing, tiled=tiled)
    return plan.plan(model, layout, record["length"], gpus=record["sp"], act_bytes=4).peak


def test_planner_within_10_percent_of_the_measured_peaks():
    results = _results()
    model = _model(results)
    errors = []
    for record in results["records"]:
        measured = max(record["total"], record["optimizer_total"])
        predicted = _predict(model, record)
        errors.append((abs(predicted - measured) / measured, record["sp"], record["option"], record["local"]))
    worst = max(errors)
    assert worst[0] < 0.10, worst


def test_planner_longest_sequence_within_10_percent():
    results = _results()
    model = _model(results)
    for row in results["rows"]:
        checkpointing, tiled = OPTIONS[row["option"]]
        layout = plan.Layout(sp=row["sp"], checkpointing=checkpointing, tiled=tiled)
        budget = results["budget_bytes"]
        lo, hi = 0, 1 << 26
        while hi - lo > 64:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if plan.plan(model, layout, mid, gpus=row["sp"]).peak <= budget else (lo, mid)
        assert abs(lo - row["longest"]) <= 0.10 * row["longest"], (row, lo)


def test_known_model_sizes_and_the_command_line(capsys):
    assert abs(plan.Model(**plan.KNOWN["llama-3-8b"]).params / 1e9 - 8.03) < 0.01
    assert abs(plan.Model(**plan.KNOWN["bench-44m"]).params / 1e6 - 44.04) < 0.01
    best = plan.main(["--model", "llama-3-8b", "--seq-len", "131072", "--gpus", "8", "--gpu-memory", "80"])
    out = capsys.readouterr().out
    assert "recommended:" in out and best is not None and best.layout.sp > 1
    with pytest.raises(SystemExit, match="not a config.json"):
        plan.main(["--model", "no-such-model", "--seq-len", "1024", "--gpus", "1", "--gpu-memory", "80"])


def test_config_file(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, head_dim=64, vocab_size=32000).save_pretrained(tmp_path)
    assert plan.load_model(str(tmp_path)) == plan.Model(**plan.KNOWN["bench-44m"])
