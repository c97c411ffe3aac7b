"""Tier 2: dropout differs between the shards of an SP group; LayerDrop decisions agree."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import seqpar_hf
from seqpar_hf.models.rng import per_rank_stream

from .models import build_model, make_batch


def _gather(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def _streams():
    torch.manual_seed(0)
    with per_rank_stream(dist.get_rank(), torch.device("cpu")):
        inside = torch.rand(4).tolist()
    after = torch.rand(4).tolist()
    return _gather(inside), _gather(after)


def _all():
    return {"streams": _streams(), "dropout": _dropout_masks(), "layerdrop": _layerdrop(6)}


@pytest.fixture(scope="module")
def results(misc_world2):
    return misc_world2[0]["randomness"]


def test_per_rank_stream_differs_inside_and_agrees_after(results):
    inside, after = results["streams"]
    assert inside[0] != inside[1]
    assert after[0] == after[1]


def _dropout_masks():
    torch.manual_seed(0)  # the Trainer seeds every rank the same
    model = build_model("marian", dropout=0.0, activation_dropout=0.5)
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=2))
    model.train()
    seen = []
    model.model.encoder.layers[0].fc2.register_forward_pre_hook(lambda m, args: seen.append(args[0] == 0))
    batch = make_batch("marian", seed=0, src_len=12, pad=False)
    model(**batch)
    model(**batch)
    masks = _gather([m.tolist() for m in seen])
    return masks


def test_dropout_masks_differ_between_shards_and_steps(results):
    rank0, rank1 = results["dropout"]
    assert rank0[0] != rank1[0]  # the two shards of one step
    assert rank0[0] != rank0[1]  # two steps on one rank


def _layerdrop(steps):
    torch.manual_seed(0)
    model = build_model("marian", layers=4, encoder_layerdrop=0.5, decoder_layerdrop=0.5)
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=2))
    model.train()
    counts, losses, calls = [], [], []
    for layer in list(model.model.encoder.layers) + list(model.model.decoder.layers):
        layer.fc1.register_forward_pre_hook(lambda m, args: calls.append(1))
    for step in range(steps):
        calls.clear()
        loss = model(**make_batch("marian", seed=step)).loss
        loss.backward()  # would hang if ranks had run different layers
        losses.append(loss.item())
        counts.append(len(calls))
    return _gather((counts, losses)), model.model.encoder.layerdrop


def test_layerdrop_decisions_agree_across_the_group(results):
    gathered, layerdrop = results["layerdrop"]
    (counts0, losses0), (counts1, losses1) = gathered
    assert counts0 == counts1 and losses0 == losses1
    assert len(set(counts0)) > 1  # layers really were dropped, differently per step
    assert layerdrop == 0.5  # the model's own setting is restored after each forward
