"""Tier 2: vision-language models under SP on gloo (bodies in tests/runs/vlm.py, run in the `parity` groups).

A multimodal model's text model is its backbone: the vision tower and projector run before it on the full
batch on every rank, the merged embeddings, M-RoPE positions ([3, b, s]) and per-token visual features are
sharded. Rows hold one, two and no images; everything within 1e-5 of the unpatched model in one process."""

from __future__ import annotations

import pytest

from .runs.vlm import CASES

TOL = 1e-5


@pytest.fixture(scope="module")
def results(spawned):
    cache: dict = {}

    def get(size):
        if size not in cache:
            cases: dict = {}
            for rank in spawned("parity", size):
                for case in rank["vlm"]:
                    cases.setdefault(case["name"], []).append(case)
            cache[size] = cases
        return cache[size]

    return get


@pytest.mark.parametrize(
    "size,name", [pytest.param(w, c["name"], id=f"w{w}-{c['name']}") for w in CASES for c in CASES[w]]
)
def test_images_train_and_generate_as_the_unpatched_model(results, size, name):
    per_rank = results(size)[name]
    assert len(per_rank) == size
    for r in per_rank:
        assert r["backbone"].endswith(("TextModel", "LlamaModel", "Qwen2Model")) and r["front"], r  # the text model
        assert r["loss_err"] < TOL and r["grad_err"] < TOL and r["logits_err"] < TOL, r
        if "tokens_err" in r:
            assert r["tokens_err"] == 0 and r["scores_err"] < TOL, r


def _trainer_logs(sp: int) -> list[dict]:
    """examples/vlm_images.py's trainer (sp 0: the plain transformers Trainer), 6 steps; its logs."""
    import tempfile

    from transformers import TrainerCallback

    from examples.vlm_images import make_trainer

    seen: list[dict] = []

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs or {}))

    make_trainer(sp, max_steps=6, output_dir=tempfile.mkdtemp(), callbacks=[Recorder()]).train()
    return seen


def test_trainer_with_images_logs_one_process_numbers():
    """examples/vlm_images.py (a tiny Qwen2.5-VL, rows of 0-2 images, the collator a user writes) under
    SequenceParallelTrainer at sp=2 logs the plain Trainer's loss and gradient norm in one process."""
    from .helpers.spawn import spawn

    reference = spawn(_trainer_logs, 1, 0)[0]
    ranks = spawn(_trainer_logs, 2, 2)
    steps = [r for r in reference if "loss" in r]
    assert len(steps) == 3
    for got in ranks:
        got = [r for r in got if "loss" in r]
        assert len(got) == len(steps)
        for a, b in zip(got, steps):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)
