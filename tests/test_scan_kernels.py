"""A fused kernel behind a scan's name (models/mixers/kernels.py): the split along the sequence runs it, proven with
the scan's reference in float64 and the kernel checked against the reference on the split's own calls in fp32.

On a GPU with flash-linear-attention or mamba_ssm installed, transformers binds a scan's name to a dispatcher that
runs the kernel on CUDA tensors; such a kernel takes no float64, so before this the proof failed and the mixer ran
split by heads (or whole). Here the kernels are stand-ins with a fused kernel's interface (their own leading
parameter names, no float64, another chunk size: another rounding), behind a dispatcher built as transformers
builds it; `tests/test_fla_interpreter.py` runs flash-linear-attention's own Triton kernels (interpreted, on CPU)."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

from conformance.tiny import build_tiny
from seqpar_hf.models.mixers import halo, kernels, scan, sequence
from seqpar_hf.parallel.sharding import ShardPlan

from .helpers.kernels import Calls, conv_kernel, dispatcher, gated_delta_rule_kernel, ssd_kernel, stand_in

MIXERS = {
    "qwen3_5": ("Qwen3_5ForCausalLM", "linear_attn", "torch_chunk_gated_delta_rule", gated_delta_rule_kernel),
    "qwen3_next": ("Qwen3NextForCausalLM", "linear_attn", "torch_chunk_gated_delta_rule", gated_delta_rule_kernel),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "mamba", "mamba2_chunk_scan", ssd_kernel),
}


def _mixer(model_type: str):
    class_name, child, name, _ = MIXERS[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny(model_type, class_name)[0].float()
    module = next(m for n, m in model.named_modules() if n.endswith(f"layers.0.{child}"))
    space = scan.global_space(module)
    return module, space, name, kernels.reference(space[name])


def _split_output(module, n: int, x, mask):
    """The shards' outputs in one process (ranks one by one, states and halos handed on), in fp32 as trained."""
    plans = [ShardPlan.build(x.shape[1], n, r, ring_size=n, zigzag=True) for r in range(n)]
    conv, scans = halo.depthwise_conv(module), scan.find(module)
    with torch.no_grad():
        want = module(x, attention_mask=mask)
        return sequence._split_error(module, module.forward, conv, scans, plans, 3, x, mask, want)


@pytest.mark.parametrize("model_type", list(MIXERS))
def test_a_fused_kernel_behind_the_scans_name_runs_the_split(model_type, monkeypatch):
    """The proof runs the reference in float64 (the kernel takes none) and checks the kernel on the split's calls
    (the widened value channels from the identity, and an incoming state) in fp32; the split then runs the kernel:
    the shards' outputs are the module's own, with the kernel, within fp32 rounding."""
    module, space, name, reference = _mixer(model_type)
    make = MIXERS[model_type][3]
    calls = Calls()
    monkeypatch.setitem(space, name, dispatcher(reference, make(reference, calls)))
    scans, conv = scan.find(module), halo.depthwise_conv(module)
    assert name in scans  # found by the reference's signature, through the dispatcher
    for n in (2, 4):
        assert sequence.prove(module, module.forward, conv, scans, n) is None, n
    width = max(w for w, _, _ in calls)
    assert calls and all(dtype == torch.float32 for _, _, dtype in calls)  # checked in fp32 only
    assert any(given for _, given, _ in calls) and width > min(w for w, _, _ in calls)  # an initial state, widened
    calls.clear()
    x = torch.randn(2, 13, sequence._width(module))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :3] = 0
    assert _split_output(module, 3, x, mask) < 1e-5
    assert any(given for _, given, _ in calls)  # the split ran the kernel from the states passed


@pytest.mark.parametrize(
    "flaw,why",
    [
        (dict(ignores_state=True), "is not its reference on the split's calls"),
        (dict(detaches_state=True), "is not its reference on the split's calls"),  # the backward drops the state
        (dict(widths=(8,)), "fails on the split's calls (ValueError: value head size 16 not supported)"),
    ],
)
def test_a_kernel_that_is_not_its_reference_on_the_splits_calls_is_not_used(flaw, why, monkeypatch):
    """A kernel that drops the initial state, or only its gradient, or cannot take the widened value channels, is
    not used: the split along the sequence is not proven, and the mixer runs as before (by heads, where proven)."""
    module, space, name, reference = _mixer("qwen3_5")
    assert module.head_v_dim == 8
    monkeypatch.setitem(space, name, dispatcher(reference, gated_delta_rule_kernel(reference, Calls(), **flaw)))
    got = sequence.prove(module, module.forward, halo.depthwise_conv(module), scan.find(module), 2)
    assert got is not None and why in got, got


def test_the_reference_is_behind_the_dispatcher_and_a_plain_function_is_its_own():
    module, space, name, reference = _mixer("qwen3_5")
    assert inspect.isfunction(reference) and reference.__name__ == name
    assert scan.kind_of(reference) == scan.kind_of(space[name]) is not None
    assert kernels.reference(reference) is reference
    refs = kernels.References(space, {name: scan.find(module)[name]})
    with refs:
        assert space[name] is not refs.kernels[name]
    assert space[name] is refs.kernels[name]  # put back


def test_calls_by_name_pass_the_required_parameters_by_position():
    """A dispatcher hands the reference's names to a kernel with other leading names: the required parameters go
    by position (query -> q), the others by name, and the kernel's dispatcher drops what it does not take."""
    module, space, name, reference = _mixer("qwen3_5")
    seen = {}

    def kernel(q, k, v, g, beta, initial_state=None, output_final_state=False):
        seen.update(q=q, initial_state=initial_state)
        return q, None

    fn = dispatcher(reference, kernel)
    q = torch.zeros(1)
    scan.call_by_name(fn, scan.signature(reference), dict(query=q, key=q, value=q, g=q, beta=q, chunk_size=64))
    assert seen["q"] is q and seen["initial_state"] is None


CONVOLUTIONS = {
    "qwen3_5": ("Qwen3_5ForCausalLM", "linear_attn"),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "mamba"),
    "mamba": ("MambaForCausalLM", "mixer"),
    "lfm2": ("Lfm2ForCausalLM", "conv"),
}


def _conv_mixer(model_type: str):
    class_name, child = CONVOLUTIONS[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny(model_type, class_name)[0].float()
    module = next(m for n, m in model.named_modules() if n.endswith(f"layers.0.{child}"))
    return model, module, scan.global_space(module)


@pytest.mark.parametrize("model_type", list(CONVOLUTIONS))
def test_a_fused_convolution_behind_its_dispatcher_runs_with_its_halo(model_type, monkeypatch):
    """causal-conv1d's kernel behind transformers' `causal_conv1d_fn` (it calls no F.conv1d, takes no float64):
    the proof runs the reference and checks the kernel on the halo-prepended calls; the split then runs the kernel
    on each run with its halo prepended, the shards the module's own outputs."""
    model, module, space = _conv_mixer(model_type)
    assert halo.conv_functions(module) == {"causal_conv1d_fn": "convolution"}
    reference = kernels.reference(space["causal_conv1d_fn"])
    calls = Calls()
    monkeypatch.setitem(space, "causal_conv1d_fn", dispatcher(reference, conv_kernel(calls)))
    conv, scans = halo.depthwise_conv(module), scan.find(module)
    for n in (2, 4):
        assert sequence.prove(module, module.forward, conv, scans, n) is None, n
    assert calls and all(dtype == torch.float32 for _, _, dtype in calls)
    calls.clear()
    x = torch.randn(2, 13, sequence._width(module))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :3] = 0
    assert _split_output(module, 3, x, mask) < 1e-5
    k = conv.kernel_size[0]
    assert calls and all(width > k - 1 for width, _, _ in calls)  # each run with its k - 1 halo columns


def test_a_convolution_kernel_that_is_not_its_reference_is_not_used(monkeypatch):
    _, module, space = _conv_mixer("qwen3_5")
    reference = kernels.reference(space["causal_conv1d_fn"])
    monkeypatch.setitem(space, "causal_conv1d_fn", dispatcher(reference, conv_kernel(Calls(), shifted=True)))
    got = sequence.prove(module, module.forward, halo.depthwise_conv(module), scan.find(module), 2)
    assert got is not None and "the kernel behind causal_conv1d_fn is not its reference" in got, got


def test_both_kernels_at_once(monkeypatch):
    """flash-linear-attention and causal-conv1d together (the fast path of a GPU install)."""
    model, module, _ = _conv_mixer("qwen3_5")
    with stand_in(model, ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")) as calls:
        assert sequence.prove(module, module.forward, halo.depthwise_conv(module), scan.find(module), 4) is None
        calls.clear()
        x = torch.randn(2, 13, sequence._width(module))
        assert _split_output(module, 2, x, torch.ones(2, 13, dtype=torch.long)) < 1e-5
        assert any(given for _, given, _ in calls)


PROMPT_KERNELS = [
    ("qwen3_5", ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")),
    ("granitemoehybrid", ("mamba2_chunk_scan", "causal_conv1d_fn")),
]


@pytest.mark.parametrize("model_type,names", PROMPT_KERNELS)
def test_the_prompt_forward_splits_with_the_kernels(model_type, names):
    """Generation's prompt forward with both kernels: proven with the references (each rank's cache layer ends with
    the whole prompt's states), the kernels checked on the prompt's calls too (a final state asked for)."""
    from seqpar_hf.models.generation import sharded_cache

    model, module, _ = _conv_mixer(model_type)
    index = module.layer_idx
    states = sharded_cache.unpatched_states(model)[0]
    make = lambda n, r: sharded_cache.SequenceShardedCache(n, r, None, {index: copy.deepcopy(states[index])})
    conv, scans = halo.depthwise_conv(module), scan.find(module)
    with stand_in(model, names) as calls:
        for n in (2, 4):
            assert sequence.prove_prefill(module, module.forward, conv, scans, n, make) is None, n
        assert calls and all(dtype == torch.float32 for _, _, dtype in calls)
