"""Tier 1: the weights' checksum that every forward compares across its replica
(seqpar_hf/models/forward/replica_weights.py): equal for equal weights, different when a trained parameter moves,
and compared only where ranks hold the same shards. The gloo cases (a plain Trainer, per-rank learning rates, a TP
norm) are in tests/test_robustness_gloo.py."""

from __future__ import annotations

import torch

from seqpar_hf.models.forward import replica_weights

from .helpers.models import build_model


def _values(model) -> list[int]:
    return [int(v) for v in replica_weights.checksums(model, torch.device("cpu"))]


def test_equal_weights_give_equal_checksums_and_a_step_changes_them():
    a, b = build_model("llama"), build_model("llama")  # same seed: the same weights
    assert _values(a) == _values(b)
    assert _values(a)[3] == len(list(a.parameters())) and _values(a)[1:3] == [0, 0]  # no DTensor: nothing sharded
    with torch.no_grad():
        b.model.layers[1].mlp.down_proj.weight.mul_(1 + 1e-6)  # one parameter, by a rounding-sized step
    assert _values(a)[0] != _values(b)[0]
    assert _values(build_model("llama").to(torch.bfloat16))[0] != _values(a)[0]  # another dtype: other bits


def test_sharded_checksums_are_compared_among_ranks_holding_the_same_shards():
    # [replicated, sharded, shard key, parameters] per rank: ranks 0 / 2 hold one shard, ranks 1 / 3 the other
    same = [[7, 10, 1, 5], [7, 20, 2, 5], [7, 10, 1, 5], [7, 20, 2, 5]]
    assert replica_weights.problems(same) == []
    apart = [[7, 10, 1, 5], [7, 20, 2, 5], [7, 11, 1, 5], [7, 20, 2, 5]]
    assert replica_weights.problems(apart) == [
        "a checksum of the sharded parameters differs among ranks holding the "
        "same shards: rank 0: 0000000a, rank 2: 0000000b"
    ]
    assert "number of parameters" in replica_weights.problems([[7, 0, 0, 5], [7, 0, 0, 6]])[0]
