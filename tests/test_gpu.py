"""Tier 3 (CUDA only; skipped elsewhere): the CUDA kernels of the ring blocks and the patched model
on a GPU. One GPU suffices: block kernels need no process group, the model runs at sp_size=1."""

from __future__ import annotations

import copy

import pytest
import torch

import seqpar_hf
from seqpar_hf.attention.kernels import block_backward, block_forward
from seqpar_hf.attention.kernels import math_backward as _math_backward
from seqpar_hf.attention.kernels import math_forward as _math_forward

from .helpers.models import build_model, make_batch, relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize(
    "causal,masked,s_k,d_v",
    [
        (False, False, 64, 32),
        (True, False, 64, 32),
        (False, True, 61, 32),
        (True, True, 64, 32),
        (True, True, 64, 16),
        (False, True, 61, 48),
    ],
)
def test_cuda_block_kernels_match_the_math(causal, masked, s_k, d_v):  # d_v != 32: latent attention's own v width
    torch.manual_seed(0)
    q = torch.randn(2, 4, 64, 32, device="cuda")
    k, v = torch.randn(2, 4, s_k, 32, device="cuda"), torch.randn(2, 4, s_k, d_v, device="cuda")
    bias = None
    if masked:
        allowed = torch.rand(2, 1, 64, s_k, device="cuda") > 0.3
        bias = torch.zeros(allowed.shape, device="cuda").masked_fill(~allowed, float("-inf"))
    out, lse = block_forward(q, k, v, bias, causal, 32**-0.5)
    ref_out, ref_lse = _math_forward(q, k, v, bias, causal, 32**-0.5)
    assert relative_error(out, ref_out) < 1e-5 and relative_error(lse, ref_lse) < 1e-5
    dout = torch.randn_like(out)
    grads = block_backward(dout, q, k, v, out, lse, bias, causal, 32**-0.5)
    ref = _math_backward(dout, q, k, v, ref_out, ref_lse, bias, causal, 32**-0.5)
    for g, r in zip(grads, ref):
        assert relative_error(g, r) < 1e-4


@pytest.mark.parametrize("family", ["marian", "llama"])
def test_patched_model_on_cuda_bf16(family):
    model = build_model(family).cuda().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    batch = {k: v.cuda() for k, v in make_batch(family, seed=0).items()}
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    assert relative_error(model(**batch).loss.float(), reference(**batch).loss.float()) < 1e-2


def _packed_attention(device, dtype, doc, window, q, k, v):
    """(outputs and input gradients, the forward's pattern with what it built) of whole-sequence packed attention."""
    from seqpar_hf.attention import kernels
    from seqpar_hf.attention.masks import MaskSpec, SeqMeta
    from seqpar_hf.attention.pattern import Pattern
    from seqpar_hf.parallel.sharding import ShardPlan

    meta = SeqMeta(ShardPlan.build(doc.shape[1], 1, 0), None, doc.to(device))
    spec = MaskSpec(meta, meta, causal=True, window=window)
    pattern = Pattern(spec)
    leaves = [t.detach().to(device, dtype).requires_grad_() for t in (q, k, v)]
    out = kernels.attention(*leaves, pattern, 0.25, 0.0, None)
    out.backward(torch.ones_like(out))
    return [out.detach().float().cpu()] + [t.grad.float().cpu() for t in leaves], pattern


@pytest.mark.parametrize(
    "dtype,lengths,window,path,tol",
    [
        (torch.bfloat16, (5, 9, 3, 15), None, "segments", 2e-2),  # the varlen flash kernel
        (torch.bfloat16, (5, 9, 3, 15), 3, "segments", 2e-2),  # ... with a sliding window
        (torch.float32, (32,) * 16, None, "documents", 1e-5),  # no fp32 flash kernel: document by document
    ],
)
def test_packed_attention_on_cuda_builds_no_row_long_mask_and_matches_the_cpu(dtype, lengths, window, path, tol):
    """Packed (and windowed) whole-sequence attention on CUDA builds no [s, s] mask: bf16 takes the varlen
    flash kernel over documents, fp32 (long rows of short documents) goes document by document; both equal
    the dense-mask CPU path (fp32), forward and backward."""
    from seqpar_hf import _compat

    assert _compat.varlen_attention() is not None, f"torch {torch.__version__}: varlen_attn lacks scale/window_size"
    torch.manual_seed(0)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    q, k, v = (torch.randn(1, 4, doc.shape[1], 16) for _ in range(3))
    want, _ = _packed_attention("cpu", torch.float32, doc, window, q, k, v)
    from seqpar_hf.attention.pattern import MISSING

    got, pattern = _packed_attention("cuda", dtype, doc, window, q, k, v)
    assert getattr(pattern, path) not in (MISSING, None) and pattern.full is MISSING
    for g, w in zip(got, want):
        assert relative_error(g, w) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_llama_on_cuda_equals_the_unpatched_model(dtype):
    from transformers import DataCollatorWithFlattening

    model = build_model("llama").cuda()
    reference = copy.deepcopy(model)
    docs = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    batch = DataCollatorWithFlattening()([{"input_ids": d, "labels": d} for d in docs])
    batch = {k: v.cuda() for k, v in batch.items()}
    seqpar_hf.patch_model(model.to(dtype), seqpar_hf.ParallelLayout(sp_size=1))
    got = model(**batch, use_cache=False).loss.float()
    want = reference(**batch, use_cache=False).loss  # fp32
    assert relative_error(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_longest_sequence_benchmark_runs_on_cuda(tmp_path):
    """benchmarks/longest_sequence.py --device cuda: the allocator's peaks, short lengths."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "longest"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.longest_sequence",
            "--device",
            "cuda",
            "--sp",
            "1",
            "2",
            "--options",
            "plain",
            "checkpointing + tiled loss",
            "--lengths",
            "768",
            "1280",
            "2048",
            "--out",
            str(out),
        ],
        check=True,
        cwd=root,
        timeout=600,
    )
    rows = json.loads(Path(str(out) + ".json").read_text())["rows"]
    assert all(r["longest"] > 0 for r in rows)


@pytest.mark.parametrize(
    "model_type,class_name,child",
    [
        ("qwen3_5", "Qwen3_5ForCausalLM", "linear_attn"),
        ("qwen3_next", "Qwen3NextForCausalLM", "linear_attn"),
        ("granitemoehybrid", "GraniteMoeHybridForCausalLM", "mamba"),
        ("nemotron_h", "NemotronHForCausalLM", "mixer"),
        ("zamba", "ZambaForCausalLM", "mamba"),
    ],
)
def test_mixers_split_along_the_sequence_on_cuda(model_type, class_name, child):
    """The state passing and the convolution halo (models/mixers/) on CUDA, the models' torch paths there: the
    proof `patch_model` runs (float64, contiguous and zigzag shards, within 1e-9) holds for 2 and 4 ranks, and in
    fp32 the shards with their states passed are the module's output within rounding, with the states dropped
    further from it."""
    import warnings

    from conformance.tiny import build_tiny
    from seqpar_hf.models.mixers import halo, scan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny(model_type, class_name)[0].float().cuda()
    module = next(m for n, m in model.named_modules() if n.endswith(f"layers.0.{child}"))
    scans, conv = scan.find(module), halo.depthwise_conv(module)
    assert scans and conv is not None
    passed, dropped = _proven_and_split_on_cuda(module)
    assert passed < 1e-4 and dropped > 2 * passed, (passed, dropped)  # Zamba's scan reaches little at init


def _proven_and_split_on_cuda(module) -> tuple[float, float]:
    """The split along the sequence proven for 2 and 4 ranks; the largest relative error of 4 zigzag shards (the
    ranks run one by one, fp32) against the module's output, with the states passed and with them dropped."""
    from seqpar_hf.models.mixers import halo, scan, sequence
    from seqpar_hf.parallel.sharding import ShardPlan

    scans, conv = scan.find(module), halo.depthwise_conv(module)
    for n in (2, 4):
        assert sequence.prove(module, module.forward, conv, scans, n) is None
    x = torch.randn(2, 37, sequence._width(module), device="cuda")
    mask = torch.ones(2, 37, dtype=torch.long, device="cuda")
    mask[1, :5] = 0
    with torch.no_grad():
        want = module(x, attention_mask=mask)
        plans = [ShardPlan.build(37, 4, r, ring_size=4, zigzag=True) for r in range(4)]
        passed = sequence._split_error(module, module.forward, conv, scans, plans, 3, x, mask, want)
        dropped = sequence._split_error(module, module.forward, conv, scans, plans, 3, x, mask, want, drop=True)
    return passed, dropped


@pytest.mark.parametrize("package", ["fla", "causal_conv1d"])
def test_fused_kernels_run_the_split_on_cuda(package):
    """Where flash-linear-attention or causal-conv1d is installed, transformers dispatches Qwen3.5's scan or
    convolution to it on CUDA: the proof (the reference in float64, the kernel checked on the split's calls in fp32,
    `mixers/kernels.py`) holds, and the shards, the kernel run from the states passed and the halos, are the module's
    output with the kernel within fp32 (TF32) rounding."""
    import importlib.util
    import warnings

    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    from conformance.tiny import build_tiny
    from seqpar_hf.models.mixers import halo, kernels, scan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_tiny("qwen3_5", "Qwen3_5ForCausalLM")[0].float().cuda()
    module = next(m for n, m in model.named_modules() if n.endswith("layers.0.linear_attn"))
    names = {**scan.find(module), **halo.conv_functions(module)}
    space = scan.global_space(module)
    assert any(kernels.reference(space[n]) is not space[n] for n in names)  # dispatchers
    passed, dropped = _proven_and_split_on_cuda(module)
    assert passed < 1e-3 and dropped > 2 * passed, (passed, dropped)


def test_activation_offload_on_cuda_is_bit_identical():
    """The CUDA path of `offload_activations` (pinned host buffers, a side stream, the next layer's input
    prefetched): loss and every gradient bit-identical, every checkpointed layer's input moved and brought back."""
    batch = {k: v.cuda() for k, v in make_batch("llama", seed=3).items()}
    plain, offloaded = build_model("llama").cuda(), build_model("llama").cuda()
    seqpar_hf.patch_model(plain, seqpar_hf.ParallelLayout(sp_size=1))
    seqpar_hf.patch_model(offloaded, seqpar_hf.ParallelLayout(sp_size=1), offload_activations=True)
    losses = []
    for model in (plain, offloaded):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        out = model(**batch)
        out.loss.backward()
        losses.append(out.loss.detach())
    offload = offloaded._seqpar_state.offload
    layers = offloaded.config.num_hidden_layers
    assert (offload.moved, offload.restored) == (layers, layers)
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(plain.named_parameters(), offloaded.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name
