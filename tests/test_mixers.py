"""Token mixers outside attention (models/mixers/): the split along the sequence (a convolution's halo, a scan's
state passed) and the split by heads, proven in one process.

The parity of whole models under SP (every mixer kind, every layout) is the zoo sample's
(conformance/sample.py: LFM2, Jamba, Nemotron-H, Qwen3-Next, Qwen3.5); here the pieces it rests on."""

from __future__ import annotations

import warnings

import pytest
import torch

from conformance.tiny import build_tiny
from seqpar_hf.models.mixers import halo, heads, scan, sequence


def _mixer(model_type: str, class_name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny(model_type, class_name)[0].float()
    return next(m for n, m in model.named_modules() if n.endswith("layers.0.linear_attn"))


@pytest.mark.parametrize(
    "model_type,class_name,fused",
    [("qwen3_next", "Qwen3NextForCausalLM", True), ("qwen3_5", "Qwen3_5ForCausalLM", False)],
)
def test_gated_deltanet_head_slices_sum_to_the_module(model_type, class_name, fused):
    """Each rank's slice (its key heads, their value heads, gates, decay, conv channels and output columns)
    runs the module's own forward; the slices' outputs sum to the module's, and their gradients land on the
    slices' rows of the module's parameters, summing to the module's gradients."""
    module = _mixer(model_type, class_name)
    layout = heads.head_layout(module)
    assert layout is not None and layout.fused is fused and layout.ratio == 2
    assert heads.prove(module, module.forward, layout, 2) is None
    x = torch.randn(2, 13, module.out_proj.out_features)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, :4] = 0
    module(x, attention_mask=mask).square().sum().backward()
    want = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    parts = [
        heads._call(module, module.forward, layout, k0, k1, (x,), {"attention_mask": mask})
        for k0, k1 in heads.ranges(layout.k_heads, 2)
    ]
    total = parts[0] + parts[1]
    total.square().sum().backward()
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=name)
    assert module.num_k_heads == 2 and module.conv1d.weight.shape[0] == module.conv_dim  # restored after the slices


class _Misplaced(heads.HeadLayout):
    """A layout that pairs each rank's value heads with the other rank's output-projection columns."""

    def rows(self, name, k0, k1):
        if name == "out_proj.weight":
            k0, k1 = self.k_heads - k1, self.k_heads - k0
        return super().rows(name, k0, k1)


def test_a_head_split_that_is_not_the_module_is_not_used():
    """The proof, not the layout, decides: a layout that misplaces rows, one whose shapes do not fit, or
    fewer key heads than ranks leaves the module to run whole, saying why."""
    module = _mixer("qwen3_5", "Qwen3_5ForCausalLM")
    layout = heads.head_layout(module)
    misplaced = _Misplaced(layout.fused, layout.k_heads, layout.ratio, layout.dk, layout.dv)
    assert "summed, are not its output" in heads.prove(module, module.forward, misplaced, 2)
    assert "fewer than the 4 ranks" in heads.prove(module, module.forward, layout, 4)
    fused = heads.HeadLayout(True, layout.k_heads, layout.ratio, layout.dk, layout.dv)
    assert "head slices fail" in heads.prove(module, module.forward, fused, 2)


def test_mamba2_group_slices_sum_to_the_module():
    """A Mamba2 (SSD) mixer splits by head groups: each rank's heads with their group's B / C, conv channels,
    decay, skip, gated-norm channels and output columns; one group of heads cannot be split (its gated norm
    normalises over the whole group), and says so."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny("nemotron_h:two_groups", "NemotronHForCausalLM")[0].float()
    module = model.model.layers[0].mixer
    layout = heads.head_layout(module)
    assert isinstance(layout, heads.SsdLayout) and layout.units == 2
    assert heads.prove(module, module.forward, layout, 2) is None
    one = heads.SsdLayout(1, 2 * layout.per_group, layout.dim, layout.state)
    assert "1 head groups, fewer than the 2 ranks" in heads.prove(module, module.forward, one, 2)


@pytest.mark.parametrize(
    "model_type,class_name", [("granitemoehybrid", "GraniteMoeHybridForCausalLM"), ("bamba", "BambaForCausalLM")]
)
def test_mamba2_of_one_group_splits_by_heads_with_the_norm_summed(model_type, class_name):
    """Fewer groups than ranks: each rank some heads of one group, its B / C, and the gated norm over the
    group's channels from the ranks' sums of squares (an all-reduce; in the proof, the slices' sums). Heads
    that would span two groups are not a split."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny(model_type, class_name)[0].float()
    module = model.model.layers[0].mamba
    layout = heads.head_layout(module)
    assert isinstance(layout, heads.SsdLayout) and layout.groups == 1
    by_heads = heads.SsdLayout(layout.groups, layout.per_group, layout.dim, layout.state, by_heads=True)
    for n in (2, 4):
        assert heads.prove(module, module.forward, by_heads, n) is None
    two = heads.SsdLayout(2, layout.per_group // 2, layout.dim, layout.state, by_heads=True)
    assert heads.prove(module, module.forward, two, 3) is not None


def test_short_convolution_channel_slices_sum_to_the_module():
    """LFM2's gated short convolution splits by channels (B, C, x rows, filter, output column each); an output
    bias is added by the first range only, so the sum stays the module's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny("lfm2", "Lfm2ForCausalLM")[0].float()
    module = model.model.layers[0].conv
    layout = heads.head_layout(module)
    assert isinstance(layout, heads.ChannelLayout) and layout.units == model.config.hidden_size
    assert heads.prove(module, module.forward, layout, 4) is None
    module.out_proj.bias = torch.nn.Parameter(torch.randn(layout.units))
    assert heads.prove(module, module.forward, heads.head_layout(module), 3) is None


def test_olmo_hybrid_deltanet_splits_by_heads():
    """One projection per input (q / k / v / a / b / g, o_proj, o_norm shared): the same head split."""
    module = _mixer("olmo_hybrid", "OlmoHybridForCausalLM")
    layout = heads.head_layout(module)
    assert isinstance(layout, heads.HeadLayout) and layout.projections
    assert heads.prove(module, module.forward, layout, 4) is None


def test_modules_of_other_structures_have_no_head_layout():
    assert heads.head_layout(torch.nn.Linear(4, 4)) is None
    assert heads.ranges(5, 2) == [(0, 3), (3, 5)]


def test_short_convolution_splits_along_the_sequence_with_a_halo():
    """LFM2's gated short convolution reaches along the sequence only through its convolution: each shard, given
    the k - 1 convolution inputs before each of its runs, gives the module's output at its tokens (contiguous and
    zigzag shards, a left-padded row)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny("lfm2", "Lfm2ForCausalLM")[0].float()
    module = model.model.layers[0].conv
    conv = halo.depthwise_conv(module)
    assert conv is module.conv and scan.find(module) == {}
    for n in (2, 3, 4):
        assert sequence.prove(module, module.forward, conv, {}, n) is None
    # the halo columns: zigzag shards of 2 ranks over 12 tokens (rank 0: 0-2 and 9-11, rank 1: 3-8), kernel 3
    plan = halo.ShardPlan.build(12, 2, 0, ring_size=2, zigzag=True)
    h = halo.Halos(plan, 0, 3, None)
    assert h.runs == [(0, 3, 0), (3, 3, 9)] and h.send.tolist() == [1, 2, 4, 5]  # sends globals 1, 2, 10, 11
    # run 0 starts the sequence (zeros: column 8, after the 2 x 4 gathered); run 1 takes globals 7, 8 (rank 1's)
    assert h.take.tolist() == [[8, 8], [4, 5]]
    assert sequence.order(plan) == [(0, 0, 0), (1, 0, 3), (0, 1, 9)]


def _ssd(model_type: str, class_name: str, child: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny(model_type, class_name)[0].float()
    return next(m for n, m in model.named_modules() if n.endswith(f"layers.0.{child}"))


@pytest.mark.parametrize(
    "model_type,class_name,child,found",
    [
        ("qwen3_5", "Qwen3_5ForCausalLM", "linear_attn", "torch_chunk_gated_delta_rule"),
        ("qwen3_next", "Qwen3NextForCausalLM", "linear_attn", "torch_chunk_gated_delta_rule"),
        ("granitemoehybrid", "GraniteMoeHybridForCausalLM", "mamba", "mamba2_chunk_scan"),
        ("nemotron_h", "NemotronHForCausalLM", "mixer", "mamba2_chunk_scan"),
        ("zamba", "ZambaForCausalLM", "mamba", "mamba_selective_scan"),  # no initial state; a call per head group
    ],
)
def test_scans_split_along_the_sequence_by_passing_their_state(model_type, class_name, child, found):
    """A gated DeltaNet (Qwen3.5, Qwen3-Next), a Mamba2 mixer (Granite 4, Nemotron-H) and Mamba's selective scan
    (Zamba's, two calls a forward): the scan function is found in the module's code (through `mamba2_scan_forward`
    / `mamba_scan_forward`), and each shard, its convolution given its halo and its scan the state of the tokens
    before it, gives the module's output in float64 (within 1e-9), for sp beyond the key heads (2) too; without
    the convolution's halo, or (in fp32, as trained) with the states dropped, it does not."""
    module = _ssd(model_type, class_name, child)
    scans, conv = scan.find(module), halo.depthwise_conv(module)
    assert found in scans and conv is not None
    for n in (2, 3, 4, 8):  # at 8 the proof's 35 tokens leave a rank only padding (an H200 run found it failing)
        assert sequence.prove(module, module.forward, conv, scans, n) is None
    assert "not its output" in sequence.prove(module, module.forward, conv, {}, 2)
    from seqpar_hf.parallel.sharding import ShardPlan

    x = torch.randn(2, 11, sequence._width(module), dtype=torch.float64)
    mask = torch.ones(2, 11, dtype=torch.long)
    copy = __import__("copy").deepcopy(module).double()
    with torch.no_grad():
        want = copy(x, attention_mask=mask)
        plans = [ShardPlan.build(11, 2, r, ring_size=2, zigzag=True) for r in range(2)]
        passed = sequence._split_error(copy, copy.forward, halo.depthwise_conv(copy), scans, plans, 3, x, mask, want)
        dropped = sequence._split_error(
            copy, copy.forward, halo.depthwise_conv(copy), scans, plans, 3, x, mask, want, drop=True
        )
    assert passed < 1e-6 and dropped > 1e3 * passed, (passed, dropped)


def toy_scan(query, key, value, g, beta, initial_state=None, output_final_state=False, nonlinear=False):
    """A delta-rule-shaped recurrence written out token by token: S_t = exp(g_t) S_{t-1} + beta_t k_t v_t^T,
    o_t = S_t^T q_t; `nonlinear` squashes the carried state (not affine in the initial state)."""
    b, s, h, dk = key.shape
    state = initial_state if initial_state is not None else key.new_zeros(b, h, dk, value.shape[-1])
    outs = []
    for t in range(s):
        carried = torch.tanh(state) if nonlinear else state
        state = carried * g[:, t, :, None, None].exp() + beta[:, t, :, None, None] * (
            key[:, t, :, :, None] * value[:, t, :, None, :]
        )
        outs.append(torch.einsum("bhkv,bhk->bhv", state, query[:, t]))
    return torch.stack(outs, 1), (state if output_final_state else None)


class _ToyMixer(torch.nn.Module):
    def __init__(self, nonlinear: bool):
        super().__init__()
        self.nonlinear = nonlinear
        self.in_proj = torch.nn.Linear(8, 3 * 8 + 2)
        self.out_proj = torch.nn.Linear(8, 8)

    def forward(self, hidden_states, attention_mask=None):
        b, s, _ = hidden_states.shape
        q, k, v, a = self.in_proj(hidden_states).split([8, 8, 8, 2], -1)
        q, k, v = (t.reshape(b, s, 2, 4) for t in (q, k, v))
        out, _ = toy_scan(q, k, v, -torch.nn.functional.softplus(a), a.sigmoid(), nonlinear=self.nonlinear)
        return self.out_proj(out.reshape(b, s, 8))


def test_a_scan_is_split_only_where_the_split_is_its_output():
    """Decided by what the code does: a recurrence affine in its state splits along the sequence; the same code
    with its carried state squashed (not affine) fails the proof, so the mixer runs as before."""
    for nonlinear, ok in ((False, True), (True, False)):
        module = _ToyMixer(nonlinear)
        scans = scan.find(module)
        assert list(scans) == ["toy_scan"]
        why = sequence.prove(module, module.forward, None, scans, 2)
        assert (why is None) == ok, why
        if not ok:
            assert "not its output" in why


@pytest.mark.parametrize(
    "model_type,class_name,child",
    [
        ("lfm2", "Lfm2ForCausalLM", "conv"),  # a convolution only
        ("qwen3_5", "Qwen3_5ForCausalLM", "linear_attn"),  # gated delta rule
        ("granitemoehybrid", "GraniteMoeHybridForCausalLM", "mamba"),  # SSD
        ("mamba", "MambaForCausalLM", "mixer"),  # the selective scan, no initial state
    ],
)
def test_the_prompt_forward_splits_leaving_the_unpatched_cache_states(model_type, class_name, child, monkeypatch):
    """Generation's prompt forward split along the sequence: each shard's outputs are the module's, and every
    rank's cache layer (a fresh copy of the one the model's own cache gives the mixer) ends with the states of the
    module's forward over the whole prompt: its convolution's last inputs (gathered from the ranks holding them,
    the padding that makes the prompt divisible by sp left out) and its scan's final state (from the rank holding
    the last real token). Without the gathered convolution inputs, or with each rank's own run's final state, not."""
    from seqpar_hf.models.generation import sharded_cache

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny(model_type, class_name)[0].float()
    module = next(m for n, m in model.named_modules() if n.endswith(f"layers.0.{child}"))
    states = sharded_cache.unpatched_states(model)[0]
    index = module.layer_idx
    fresh = lambda: __import__("copy").deepcopy(states[index])
    make = lambda n, r: sharded_cache.SequenceShardedCache(n, r, None, {index: fresh()})
    conv, scans = halo.depthwise_conv(module), scan.find(module)
    for n in (2, 3, 4):
        assert sequence.prove_prefill(module, module.forward, conv, scans, n, make) is None, n
    with monkeypatch.context() as m:  # each rank keeps its own last convolution inputs
        m.setattr(halo.ConvTail, "__call__", lambda self, x, k=None: (x[..., -(k or self.k) :], self.plan.length))
        assert "whole prompt's states" in sequence.prove_prefill(module, module.forward, conv, scans, 2, make)
    if scans:  # each rank keeps the final state of its own runs
        m = monkeypatch
        m.setattr(scan.StatePassing, "_final", lambda self, kind, call: self.last[1] if self.last[1] is not None
                  else torch.zeros(scan.final_shape(kind, call), dtype=self.last[0]))  # fmt: skip
        assert "whole prompt's states" in sequence.prove_prefill(module, module.forward, conv, scans, 2, make)


def test_keep_float64_keeps_float64_and_with_every_casts_everything_to_it():
    """The proof's `KeepFloat64` keeps float64 tensors float64 through `.float()` / `.to(float32)`, and leaves
    others alone; the sweep's float64 re-run (`every`) casts any tensor's `.float()` to float64 (transformers 5.17's
    M-RoPE multiplies `position_ids.float()` by a float64 frequency table); both put the methods back."""
    ints, half = torch.arange(3), torch.ones(2, dtype=torch.float64)
    with sequence.KeepFloat64():
        assert half.float().dtype == half.to(torch.float32).dtype == torch.float64
        assert ints.float().dtype == ints.to(torch.float32).dtype == torch.float32
    with sequence.KeepFloat64(every=True):
        assert ints.float().dtype == ints.to(torch.float32).dtype == torch.float64
    assert ints.float().dtype == half.float().dtype == torch.float32
