"""Token mixers outside attention (models/mixers/): the head split of a gated DeltaNet, proven in one process.

The parity of whole models under SP (every mixer kind, every layout) is the zoo sample's
(conformance/sample.py: LFM2, Jamba, Nemotron-H, Qwen3-Next, Qwen3.5); here the pieces it rests on."""

from __future__ import annotations

import warnings

import pytest
import torch

from conformance.tiny import build_tiny
from seqpar_hf.models.mixers import heads


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
    zigzag shards, a left-padded row). A scan (a gated DeltaNet, Mamba2) reaches further: not proven."""
    from seqpar_hf.models.mixers import halo

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny("lfm2", "Lfm2ForCausalLM")[0].float()
    module = model.model.layers[0].conv
    conv = halo.depthwise_conv(module)
    assert conv is module.conv
    for n in (2, 3, 4):
        assert halo.prove(module, module.forward, conv, n) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        granite = build_tiny("granitemoehybrid", "GraniteMoeHybridForCausalLM")[0].float()
    for mixer in (_mixer("qwen3_next", "Qwen3NextForCausalLM"), granite.model.layers[0].mamba):
        assert "not its output" in halo.prove(mixer, mixer.forward, halo.depthwise_conv(mixer), 2)
    # the halo columns: zigzag shards of 2 ranks over 12 tokens (rank 0: 0-2 and 9-11, rank 1: 3-8), kernel 3
    plan = halo.ShardPlan.build(12, 2, 0, ring_size=2, zigzag=True)
    h = halo.Halos(plan, 0, 3, None)
    assert h.runs == [(0, 3, 0), (3, 3, 9)] and h.send.tolist() == [1, 2, 4, 5]  # sends globals 1, 2, 10, 11
    # run 0 starts the sequence (zeros: column 8, after the 2 x 4 gathered); run 1 takes globals 7, 8 (rank 1's)
    assert h.take.tolist() == [[8, 8], [4, 5]]
