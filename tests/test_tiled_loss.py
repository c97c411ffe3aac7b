"""Tier 1 (one process, no process group): the tiled logits loss against the plain loss, and when it
is on. Multi-rank parity of the tiled loss (ulysses, ring, DDP, checkpointing): test_parity_gloo.py."""

from __future__ import annotations

import copy

import pytest
import torch

import seqpar_hf

from .helpers.models import VOCAB, build_model, make_batch, relative_error
from .runs.parity import grad_errors

TOL = 1e-5


def _pair(family: str, tiled, patch=None, **model_kwargs):
    model = build_model(family, **model_kwargs)
    reference = copy.deepcopy(model)
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1), tiled_loss=tiled, **(patch or {}))
    return model, reference


@pytest.mark.parametrize(
    "family,smoothing",
    [("marian", 0.0), ("marian", 0.1), ("llama", 0.0), ("llama", 0.1), ("gemma2", 0.0), ("m2m100", 0.0)],
)
def test_tiled_loss_equals_plain_loss_and_gradients(family, smoothing):
    model, reference = _pair(family, True, dict(tiled_chunk_elements=VOCAB * 4))  # several chunks
    batch = make_batch(family, seed=3, **(dict(left_pad=False) if family == "gemma2" else {}))
    out = model(**batch, label_smoothing=smoothing)
    assert out.logits is None  # never materialised
    expected_logits = reference(**batch).logits
    labels = batch["labels"]
    if model.config.is_encoder_decoder:
        logits, targets = expected_logits, labels
    else:
        logits, targets = expected_logits[:, :-1], labels[:, 1:]
    expected = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=-100, label_smoothing=smoothing
    )
    out.loss.backward()
    expected.backward()
    assert relative_error(out.loss.detach(), expected.detach()) < TOL
    err, name = grad_errors(model, reference)
    assert err < TOL, name


def test_auto_tiles_training_above_the_threshold_only():
    batch = make_batch("llama", seed=3)
    rows, length = batch["input_ids"].shape
    model, _ = _pair("llama", "auto")
    assert model(**batch).logits is not None  # small: plain loss
    model, _ = _pair("llama", "auto", dict(tiled_min_elements=rows * length * VOCAB))
    assert model(**batch).logits is None  # at the threshold: tiled
    model.eval()
    assert model(**batch).logits is not None  # evaluation returns logits


def test_tiled_loss_false_and_tp_refusal():
    model, _ = _pair("marian", False)
    assert model(**make_batch("marian", seed=1)).logits is not None
    with pytest.raises(ValueError, match="tiled_loss"):
        seqpar_hf.patch_model(build_model("marian"), seqpar_hf.ParallelLayout(sp_size=1), tiled_loss="yes")
    with pytest.raises(ValueError, match="tiled_chunk_elements must be a positive integer, got 0"):
        seqpar_hf.patch_model(build_model("marian"), seqpar_hf.ParallelLayout(sp_size=1), tiled_chunk_elements=0)


def test_tiled_loss_never_holds_the_logits():
    """Saved-for-backward bytes: the plain loss keeps [tokens, vocab] tensors, the tiled loss none."""
    vocab = 4096
    saved = {}
    for tiled in (False, True):
        model = build_model("llama", vocab_size=vocab)
        seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1), tiled_loss=tiled)
        batch = make_batch("llama", seed=3, length=64, pad=False)
        largest = [0]

        def pack(t):
            largest[0] = max(largest[0], t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**batch).loss.backward()
        saved[tiled] = largest[0]
    tokens = 3 * 64
    assert saved[False] >= tokens * vocab // 2
    assert saved[True] < tokens * vocab // 8
