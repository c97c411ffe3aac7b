"""In-rank bodies of tests/test_ulysses_gloo.py: the fused Ulysses exchange at the function level
(worlds 2 and 4, in the parity group), and mode="auto"'s refusals."""

from __future__ import annotations

import torch
import torch.distributed as dist

import seqpar_hf
from seqpar_hf.attention import kernels
from seqpar_hf.attention.heads import max_chunks
from seqpar_hf.attention.ulysses import ulysses_attention, ulysses_attention_separate

from ..helpers.models import build_model, relative_error

# (heads, kv heads, local q length, local kv length): GQA, kv heads < ranks, uneven heads, s_q != s_k
SHAPES = [(8, 2, 6, 6), (6, 2, 5, 3), (4, 1, 4, 4), (5, 5, 3, 3), (12, 4, 4, 7), (10, 2, 3, 3)]
V_WIDTHS = (4, 6)  # v's head width: q/k's, and its own (multi-head latent attention; narrower: the parity cases)


class _Count:
    """all_to_all_single calls, forward and backward."""

    def __init__(self):
        self.calls, self.original = 0, dist.all_to_all_single

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self.original


def _exchanges() -> list[dict]:
    n, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    out = []
    for (h, g, s_q, s_k), d_v in ((s, w) for s in SHAPES if s[0] >= n for w in V_WIDTHS):
        gen = torch.Generator().manual_seed(h * 100 + g)
        b, d = 2, 4
        full = [
            torch.randn(b, m, s * n, w, generator=gen)
            for m, s, w in ((h, s_q, d), (g, s_k, d), (g, s_k, d_v), (h, s_q, d_v))
        ]  # q, k, v, dO
        local = [x[:, :, rank * x.shape[2] // n : (rank + 1) * x.shape[2] // n] for x in full]
        causal = s_q == s_k

        def inner(q, k, v, kv_for_q, heads=None):
            return kernels.unmasked(q, k, v, causal, d**-0.5, kv_for_q)

        def run(fn):
            q, k, v = (x.clone().requires_grad_() for x in local[:3])
            with _Count() as forward:
                o = fn(q, k, v, group, rank, inner)
            with _Count() as backward:
                o.backward(local[3])
            return [o.detach(), q.grad, k.grad, v.grad], (forward.calls, backward.calls)

        reference, ref_calls = run(ulysses_attention_separate)
        for chunks in range(1, max_chunks(h, n) + 1):
            got, calls = run(lambda *a, c=chunks: ulysses_attention(*a, chunks=c))
            out.append(
                {
                    "shape": (h, g, s_q, s_k, d_v),
                    "chunks": chunks,
                    "calls": calls,
                    "reference_calls": ref_calls,
                    "equal": all(torch.equal(x, y) for x, y in zip(got, reference)),
                    "error": max(relative_error(x, y) for x, y in zip(got, reference)),
                }
            )
    return out


def _auto_refusals() -> dict:
    """Ranks that patch different models under mode="auto" are refused on every rank; an auto layout has no
    groups of its own: each model it patches gets the layout chosen for its heads."""
    layout = seqpar_hf.ParallelLayout(sp_size=dist.get_world_size(), mode="auto")
    out = {}
    try:
        _ = layout.ulysses_group
    except AttributeError as exc:
        out["before"] = str(exc)
    # one auto layout patches models of different heads, each resolved on its own; the layout stays as built
    models = [build_model("llama", heads=h, kv_heads=h) for h in (4, 1, 4)]
    for model in models:
        seqpar_hf.patch_model(model, layout)
    chosen = [seqpar_hf.layout_of(m) for m in models]
    out["per_model"] = {
        "modes": [c.mode for c in chosen],
        "shared": chosen[0] is chosen[2],
        "layout": repr(layout),
        "reason": chosen[1].auto_choice.reason,
        "repatch_noop": seqpar_hf.patch_model(models[0], layout) is models[0],
    }
    heads = 4 if dist.get_rank() == 0 else 8
    try:
        seqpar_hf.patch_model(build_model("llama", heads=heads, kv_heads=2), layout)
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def all_checks() -> dict:
    return {"exchanges": _exchanges(), "auto": _auto_refusals()}
