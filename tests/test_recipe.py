"""End to end: the translation recipe on a small slice, 2 CPU processes with sp_size=2 launched by
accelerate with the shipped config; the saved model translates with plain transformers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes" / "accelerate_cpu_2proc.yaml"), str(ROOT / "recipes" / "train_translation.py"),
           "--sp_size", "2", "--max_pairs", "3000", "--vocab_size", "1000", "--max_steps", "16", "--eval_steps", "8",
           "--logging_steps", "4", "--warmup_steps", "4", "--per_device_train_batch_size", "32",
           "--max_eval_samples", "16", "--max_test_samples", "16", "--test_num_beams", "2",
           "--max_source_length", "24", "--max_target_length", "24", "--num_examples_to_print", "2",
           "--data_cache_dir", str(out / "cache"), "--output_dir", str(out / "model")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr, out / "model"


def test_recipe_logs_bleu_and_eval_speed(recipe_run):
    log, _ = recipe_run
    assert re.search(r"'eval_bleu': '[0-9.]+'", log), log[-3000:]
    assert re.search(r"'eval_steps_per_second': '[0-9.]+'", log)
    assert "sp_size=2" in log and "test BLEU" in log and "saved model:" in log


def test_saved_model_translates_with_plain_transformers(recipe_run):
    log, model_dir = recipe_run
    script = f"""
import sys; sys.path.insert(0, {str(ROOT / 'recipes')!r})
import translation_data
from transformers import AutoTokenizer, MarianMTModel
tokenizer = AutoTokenizer.from_pretrained({str(model_dir)!r})
model = MarianMTModel.from_pretrained({str(model_dir)!r}).eval()
batch = tokenizer([translation_data.tokenize_en("I am here.")], return_tensors="pt")
out = model.generate(**batch, num_beams=2, max_length=24)
print("TRANSLATION", repr(translation_data.decode_french(tokenizer, out.tolist())[0]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and "TRANSLATION" in proc.stdout, proc.stderr[-3000:]
    assert "seqpar" not in (model_dir / "config.json").read_text()
