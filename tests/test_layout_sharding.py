"""Tier 1 (no process group): sizes, sharding plans and head splits."""

from __future__ import annotations

import pytest
import torch

from seqpar_hf.attention.ulysses import split_heads
from seqpar_hf.parallel.layout import ParallelLayout, validate_sizes
from seqpar_hf.parallel.sharding import ShardPlan


@pytest.mark.parametrize(
    "world,sp,mode,ring,match",
    [
        (4, 3, "ulysses", None, "world size 4 is not divisible by sp_size=3"),
        (4, 4, "hybrid", 3, "ring_size=3 does not divide sp_size=4"),
        (4, 4, "hybrid", None, "needs ring_size"),
        (4, 2, "stripes", None, "unknown sequence-parallel mode 'stripes'"),
        (4, 0, "ulysses", None, "sp_size must be a positive integer"),
        (4, 2, "ulysses", 2, "takes no ring_size"),
        (4, 4, "ring", 2, "ring_size=sp_size=4"),
    ],
)
def test_validate_sizes_errors_name_the_values(world, sp, mode, ring, match):
    with pytest.raises(ValueError, match=match):
        validate_sizes(world, sp, mode, ring)


@pytest.mark.parametrize(
    "world,sp,mode,ring,expect",
    [
        (4, 2, "ulysses", None, (1, 2, 2)),
        (4, 4, "ring", None, (4, 1, 1)),
        (8, 4, "hybrid", 2, (2, 2, 2)),
        (1, 1, "ulysses", None, (1, 1, 1)),
    ],
)
def test_validate_sizes(world, sp, mode, ring, expect):
    s = validate_sizes(world, sp, mode, ring)
    assert (s.ring_size, s.ulysses_size, s.dp_size) == expect


def test_sp1_layout_needs_no_process_group():
    layout = ParallelLayout(sp_size=1)
    assert (layout.sp_rank, layout.sp_size, layout.dp_size, layout.enabled) == (0, 1, 1, False)


def test_a_built_layout_is_never_changed():
    """mode="auto" resolves into a new layout per model (`resolved`); nothing changes a layout once built: the model
    patched with it, its groups and its forward's fingerprint all read these values."""
    from seqpar_hf.parallel.auto import Choice

    layout = ParallelLayout(sp_size=1, mode="auto")  # nothing to choose without SP: Ulysses over one rank
    assert layout.mode == "ulysses" and layout.auto_choice is None
    with pytest.raises(
        AttributeError,
        match="ParallelLayout.mode cannot be changed once the layout is built; build another ParallelLayout",
    ):
        layout.mode = "ring"
    with pytest.raises(AttributeError, match="ParallelLayout.auto_choice cannot be changed"):
        layout.auto_choice = Choice("ring", None, "")
    with pytest.raises(ValueError, match="is not mode='auto': there is nothing to resolve"):
        layout.resolved(Choice("ring", None, ""))
    assert layout.mode == "ulysses"


def test_sp2_without_process_group_says_how_to_fix():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ParallelLayout(sp_size=2)


def test_mesh_device_type_from_the_backend_or_given(tmp_path):
    """The mesh's device type: "cpu" on gloo, or the one given (a backend that runs on both, e.g. the
    benchmarks' fake group); anything else is refused by name. A gloo group of one process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert ParallelLayout(sp_size=1).device_type == "cpu"
        assert ParallelLayout(sp_size=1, device_type="cpu").mesh.device_type == "cpu"
        with pytest.raises(ValueError, match="device_type='gpu': pass 'cpu' or 'cuda'"):
            ParallelLayout(sp_size=1, device_type="gpu")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("length", [1, 2, 7, 8, 13, 16])
@pytest.mark.parametrize(
    "sp,ring,zigzag", [(2, 1, False), (4, 1, False), (2, 2, True), (4, 4, True), (4, 2, True), (4, 2, False)]
)
def test_plans_cover_every_token_once(length, sp, ring, zigzag):
    plans = [ShardPlan.build(length, sp, r, ring, zigzag) for r in range(sp)]
    index = torch.cat([p.global_index() for p in plans])
    assert sorted(index.tolist()) == list(range(plans[0].padded))  # a partition of the padded sequence
    assert plans[0].padded % sp == 0 and plans[0].padded >= length
    x = torch.arange(length)[None].float() + 1
    shards = [p.pad_and_shard(x, 0.0) for p in plans]
    assert all(s.shape[1] == plans[0].local_length for s in shards)
    assert torch.equal(plans[0].unshard(torch.cat(shards, dim=1)), x)  # gather + unshard round-trips


def test_zigzag_balances_causal_work():
    sp, length = 4, 64
    work = []
    for r in range(sp):
        idx = ShardPlan.build(length, sp, r, sp, True).global_index()
        work.append(int((idx + 1).sum()))  # causal attention: token t attends t+1 keys
    assert max(work) == min(work)


def test_padded_positions_stay_inside_the_position_table():
    plan = ShardPlan.build(5, 4, 3, 1, False)  # padded to 8; rank 3 holds 6, 7 (padding)
    assert plan.positions().tolist() == [0, 0]


@pytest.mark.parametrize(
    "heads,kv,n", [(4, 4, 2), (3, 3, 2), (6, 6, 4), (4, 1, 2), (4, 2, 4), (6, 2, 4), (8, 2, 8), (6, 3, 4), (5, 5, 5)]
)
def test_head_split_gives_each_rank_the_kv_heads_its_queries_use(heads, kv, n):
    split = split_heads(heads, kv, n)
    assert sum(split.q_sizes) == heads and max(split.q_sizes) - min(split.q_sizes) <= 1
    send = list(split.kv_send) if split.kv_send is not None else list(range(kv))
    rep, start, kv_start = heads // kv, 0, 0
    for r in range(n):
        received = send[kv_start : kv_start + split.kv_sizes[r]]
        local = split.kv_for_q[r] or list(range(split.q_sizes[r]))
        for i in range(split.q_sizes[r]):
            assert received[local[i]] == (start + i) // rep  # global q head -> its kv head
        start += split.q_sizes[r]
        kv_start += split.kv_sizes[r]
    if heads % n == 0 and kv % n == 0:
        assert split.kv_send is None  # even split: no replication, no copy


def test_too_few_heads_for_ulysses_names_the_fix():
    with pytest.raises(ValueError, match="needs at least 4 attention heads.*hybrid"):
        split_heads(2, 2, 4)


def test_rotary_given_mrope_axes_the_backbone_spread_gets_the_full_sequence_spread_alike():
    """transformers 5.17's Qwen3.5 text model spreads 2D position_ids over M-RoPE's axes before its rotary: the
    rotary pre-hook hands it the full sequence's positions spread the same way ([axes, b, S]), never the 2D ones
    (an IndexError in that rotary, which refused Qwen3.5 on 5.17)."""
    from types import SimpleNamespace

    from seqpar_hf.models.forward.positions import RotaryHook

    class Rotary(torch.nn.Module):
        def forward(self, x, position_ids):
            return position_ids

    full = torch.arange(8).view(1, 8)
    state = SimpleNamespace(active=SimpleNamespace(full_positions={"decoder": full}))
    hook = RotaryHook(state, "decoder", Rotary())
    given = torch.arange(4).view(1, 1, 4).expand(3, 2, 4)  # rank 0's 4 tokens, 2 rows, 3 axes
    _, kwargs = hook.pre(None, (torch.zeros(2, 4, 8),), {"position_ids": given})
    assert kwargs["position_ids"].shape == (3, 2, 8) and torch.equal(kwargs["position_ids"][2, 1], full[0])
    _, kwargs = hook.pre(None, (torch.zeros(2, 4, 8),), {"position_ids": given[0]})  # 2D stays 2D
    assert torch.equal(kwargs["position_ids"], full)


def test_mixer_split_is_checked_and_named():
    """`mixer_split` takes "auto" or "heads"; another value fails at once, naming the flag and the choices."""
    from seqpar_hf.parallel.layout import check_mixer_split

    assert check_mixer_split("heads") == "heads" and ParallelLayout(mixer_split="heads").mixer_split == "heads"
    with pytest.raises(ValueError, match=r"^mixer_split='sequence' \(--sp_mixer_split\): use 'auto' \(token mixers"):
        ParallelLayout(mixer_split="sequence")
