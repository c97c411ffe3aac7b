"""In-rank bodies of tests/test_randomness_gloo.py: dropout streams and masks per shard, LayerDrop
decisions across the group."""

from __future__ import annotations

import torch
import torch.distributed as dist

import seqpar_hf
from seqpar_hf.models.forward.rng import per_rank_stream

from ..helpers.models import build_model, make_batch


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


def all_checks():
    return {"streams": _streams(), "dropout": _dropout_masks(), "layerdrop": _layerdrop(6)}


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
