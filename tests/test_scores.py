"""Tier 1 (no process group): attention logit soft-capping and learned sinks (seqpar_hf/attention/scores.py).
The block kernels with a cap and the sink correction after the merge, forward and backward (q, k, v and the
sinks' gradient), equal plain softmax attention over the sink-augmented, capped scores; so does the decode
step over key shards merged by log-sum-exp; and a model whose own attention function reads the keyword
otherwise is refused at patch time, naming the module."""

from __future__ import annotations

import pytest
import torch

import seqpar_hf
from seqpar_hf.attention import decode, kernels
from seqpar_hf.attention.ring import Block, RingPlan, ring_attention
from seqpar_hf.attention.scores import ScoreMods, reference

from .helpers.models import build_model, relative_error


def _inputs(g, b=2, h=4, h_kv=2, s=9, d=16, d_v=16):
    q = torch.randn(b, h, s, d, generator=g) * 2  # scores of a few units: a cap of 1 bites
    k = torch.randn(b, h_kv, s, d, generator=g) * 2
    v = torch.randn(b, h_kv, s, d_v, generator=g)
    return q, k, v


def _one_block(s, allowed):
    """The ring plan of a ring of one (Ulysses with score modifiers): one block, the whole sequence."""
    block = Block(
        slice(0, s),
        slice(0, s),
        False,
        allowed,
        None if allowed is None else allowed.any(-1),
        torch.arange(s),
        torch.arange(s),
    )
    return RingPlan(None, (0,), 0, [block])


@pytest.mark.parametrize(
    "softcap,sinks,relative", [(1.0, False, False), (None, True, False), (0.5, True, False), (None, False, True)]
)
def test_block_kernels_with_cap_sinks_and_bias_equal_plain_attention(softcap, sinks, relative):
    g = torch.Generator().manual_seed(0)
    b, h, h_kv, s = 2, 4, 2, 9
    q, k, v = _inputs(g, b, h, h_kv, s)
    sink = torch.randn(h, generator=g) if sinks else None
    table = torch.randn(h, 2 * s - 1, generator=g) if relative else None  # by distance, center s - 1
    allowed = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).clone()
    allowed[1, :, :, :3] = False  # row 1: three padding keys
    allowed[1, :, :3, :] = False  # ... and three queries that see no key (padding): output 0
    dout = torch.randn(b, h, s, 16, generator=g)
    extra = sink if sinks else table
    leaves = [x.clone().requires_grad_() for x in (q, k, v)] + (
        [extra.clone().requires_grad_()] if sinks or relative else []
    )
    mods = ScoreMods(softcap, leaves[3] if sinks else None, leaves[3] if relative else None, s - 1)
    got = ring_attention(*leaves[:3], _one_block(s, allowed), 16**-0.5, tuple(i // 2 for i in range(h)), mods)
    got.backward(dout)
    ref = [x.detach().double().requires_grad_() for x in leaves]
    index = torch.arange(h) // 2
    ref_mods = ScoreMods(softcap, ref[3] if sinks else None, ref[3] if relative else None, s - 1)
    want = reference(ref[0], ref[1][:, index], ref[2][:, index], allowed, 16**-0.5, ref_mods)
    want.backward(dout.double())
    assert relative_error(got, want) < 1e-5
    for a, e in zip(leaves, ref):
        assert relative_error(a.grad, e.grad) < 1e-5
    # the modifiers bite: without them the result is another one
    plain = reference(*(x.detach().double() for x in (q, k[:, index], v[:, index])), allowed, 16**-0.5, ScoreMods())
    assert relative_error(plain, want) > 1e-2


def test_decode_over_key_shards_with_cap_and_sinks_equals_one_softmax():
    g = torch.Generator().manual_seed(1)
    b, h, h_kv, n = 2, 4, 2, 13
    q = torch.randn(b, h, 1, 16, generator=g) * 2
    _, k, v = _inputs(g, b, h, h_kv, n)
    mods = ScoreMods(0.7, torch.randn(h, generator=g))
    out = lse = None
    for cols in (slice(0, 5), slice(5, 6), slice(6, 13)):  # uneven shards, merged in order as across ranks
        o, s = decode.local_attention(q, k[:, :, cols], v[:, :, cols], None, 16**-0.5, mods.softcap)
        out, lse = (o, s) if out is None else kernels.merge(out, lse, o, s)
    from seqpar_hf.attention.scores import with_sinks

    got, _ = with_sinks(out, lse, mods.sinks)
    index = torch.arange(h) // 2
    want = reference(q, k[:, index], v[:, index], None, 16**-0.5, mods)
    assert relative_error(got, want) < 1e-5


def test_a_cap_the_attention_function_reads_otherwise_is_refused(monkeypatch):
    import transformers.models.gemma2.modeling_gemma2 as gemma2

    original = gemma2.eager_attention_forward
    # an implementation that drops the cap, as SDPA drops sinks: the unpatched model computes without it
    monkeypatch.setattr(
        gemma2, "eager_attention_forward", lambda *a, softcap=None, **kw: original(*a, softcap=None, **kw)
    )
    model = build_model("gemma2", attn_logit_softcapping=0.5)
    with pytest.raises(ValueError, match=r"layers.0.self_attn \(Gemma2Attention\) passes softcap=0.5 to its attention"):
        seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))


def test_math_kernels_over_row_chunks_with_the_causal_flag(monkeypatch):
    """A ring of one under Ulysses takes the kernel's causal flag (no [S, S] mask) and the math path goes over
    query rows in chunks (here one row each): the same result and gradients as one softmax."""
    monkeypatch.setattr(kernels, "MATH_CHUNK_ELEMENTS", 1)
    g = torch.Generator().manual_seed(2)
    b, h, s = 2, 4, 9
    q, k, v = _inputs(g, b, h, h, s)
    dout = torch.randn(b, h, s, 16, generator=g)
    sink = torch.randn(h, generator=g)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    plan = RingPlan(None, (0,), 0, [Block(slice(0, s), slice(0, s), True, None)])
    got = ring_attention(*leaves[:3], plan, 16**-0.5, None, ScoreMods(0.7, leaves[3]))
    got.backward(dout)
    ref = [x.detach().double().requires_grad_() for x in leaves]
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    want = reference(*ref[:3], causal, 16**-0.5, ScoreMods(0.7, ref[3]))
    want.backward(dout.double())
    assert relative_error(got, want) < 1e-5
    for a, e in zip(leaves, ref):
        assert relative_error(a.grad, e.grad) < 1e-5
