"""The Ulysses implementations vs_peers.py races: ours and the peers', each one entry of `IMPLS`.

An entry gives `attention(group, case) -> attend(q, k, v)` (q [b, s/n, h, d], k/v [b, s/n, h_kv, d] per
rank, as the projections produce them; returns [b, s/n, h, d]) and `model(model, layout)`, which makes an
unpatched transformers model train with it. A new variant of our attention (a fused q/k/v exchange,
chunked heads overlapping the all-to-all) is one more `Impl(..., ours=True)`.

- seqpar_hf: `seqpar_hf.attention.ulysses.ulysses_attention` (q/k/v in one all-to-all; head chunks
  overlapping the exchanges by `auto_chunks`, as the patched model does) around the local SDPA
  kernel; the model patched by `seqpar_hf.patch_model`.
- seqpar_hf-chunks2: the same with the exchange forced into 2 head chunks (the overlap, at every size).
- seqpar_hf-previous: the exchange before the fused one (`ulysses_attention_separate`: q, k, v and the
  output one by one, 4 all-to-alls forward and 4 backward), in the model at the same attention sites.
- DeepSpeed 0.19.8: `deepspeed.sequence.layer.DistributedAttention` around the same SDPA call; in the
  model it replaces our exchange at our attention sites (vs_deepspeed.py).
- axolotl-ringmaster 0.2.7: its Ulysses (`rm.setup(..., device_type="cpu", inner_attn="sdpa")`), whose
  inner kernel is transformers' SDPA function (the same `scaled_dot_product_attention` call with
  `enable_gqa`); in the model, its registered attention and `ContextParallelContextManager`.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import seqpar_hf
from benchmarks.common import attention_modules
from benchmarks.vs_deepspeed import ds_local_attention, load_deepspeed, use_deepspeed_attention
from seqpar_hf.attention import kernels
from seqpar_hf.attention.ulysses import auto_chunks, ulysses_attention, ulysses_attention_separate
from seqpar_hf.models.forward.sites import site_of

INSTALL = {
    "deepspeed": "DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install deepspeed==0.19.8",
    "ringmaster": "pip install axolotl-ringmaster==0.2.7",
}


class Unavailable(Exception):
    """This implementation cannot run here (not installed)."""


REFUSALS = (Unavailable, AssertionError, ValueError, NotImplementedError)  # how the peers say no to a shape


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise Unavailable(f"not installed: {INSTALL[module]}")


@functools.cache
def ringmaster_runtime(world: int):
    """ringmaster's process-wide runtime: Ulysses over all `world` ranks, HF's SDPA as the inner kernel."""
    need("ringmaster")
    import ringmaster as rm

    return rm.setup(rm.RingmasterConfig(size=world, backend=rm.Backend.ULYSSES), device_type="cpu", inner_attn="sdpa")


# ---------------------------------------------------------------------------------------------
# seqpar_hf


def _exchange(chunks):
    """Our Ulysses with `chunks` head chunks ("auto": by size, as the patched model; "previous": the
    one-by-one exchange): (q, k, v, group, rank, inner) -> out."""
    if chunks == "previous":
        return ulysses_attention_separate

    def run(q, k, v, group, rank, inner):
        n = dist.get_world_size(group)
        c = auto_chunks(q, k, n) if chunks == "auto" else min(chunks, max(q.shape[1] // n, 1))
        return ulysses_attention(q, k, v, group, rank, inner, c)

    return run


def ours_attention(chunks="auto"):
    def make(group, case):
        rank, exchange = dist.get_rank(group), _exchange(chunks)

        def inner(q, k, v, kv_for_q, heads=None):  # [b, h_r, s, d]: the full sequence for this rank's heads
            return kernels.unmasked(q, k, v, case["causal"], case["scale"], kv_for_q)

        def attend(q, k, v):  # HF's [b, s/n, h, d] seen as [b, h, s/n, d], and the result back
            return exchange(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group, rank, inner).transpose(1, 2)

        return attend

    return make


def ours_model(chunks="auto"):
    def make(model, layout) -> None:
        seqpar_hf.patch_model(model, layout)
        if chunks != "auto":  # the same patched model; its attention sites call this exchange instead
            use_exchange(model, layout, _exchange(chunks))

    return make


def use_exchange(model, layout, exchange) -> None:
    """Make every attention site of a model patched with a Ulysses layout run `exchange` around the
    same kernel the package runs (`kernels.attention`, with the forward's pattern)."""
    for _, _, module in attention_modules(model):
        site = site_of(module)

        def attend(ctx, q, k, v, causal, window, scale, dropout, site=site):
            pattern = ctx.pattern(site.q_side, site.kv_side, causal, window)
            scale = q.shape[-1] ** -0.5 if scale is None else scale

            def inner(q_, k_, v_, kv_for_q, heads=None):
                return kernels.attention(q_, k_, v_, pattern, scale, dropout, kv_for_q)

            return exchange(q, k, v, layout.ulysses_group, layout.ulysses_rank, inner)

        site.attend = attend  # instance attribute: only this model's sites


# ---------------------------------------------------------------------------------------------
# DeepSpeed


def deepspeed_attention(group, case):
    need("deepspeed")
    ds = load_deepspeed()(ds_local_attention, group, scatter_idx=2, gather_idx=1)
    return lambda q, k, v: ds(q, k, v, 0, None, case["causal"], case["scale"])  # batch dim 0, no rotary


def deepspeed_model(model, layout) -> None:
    need("deepspeed")
    seqpar_hf.patch_model(model, layout)  # our sharding, loss and kernel; DeepSpeed's exchange
    use_deepspeed_attention(model, load_deepspeed(), layout.sp_group)


# ---------------------------------------------------------------------------------------------
# ringmaster


def ringmaster_attention(group, case):
    ringmaster_runtime(dist.get_world_size(group))
    from ringmaster.strategies.ulysses import make_ulysses_attention

    forward = make_ulysses_attention("sdpa")
    module = torch.nn.Module()  # what transformers' SDPA function reads off the attention module
    module.num_key_value_groups, module.is_causal = case["heads"] // case["kv_heads"], case["causal"]

    def attend(q, k, v):  # ringmaster takes HF's [b, h, s/n, d] and returns [b, s/n, h, d]
        return forward(
            module,
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            scaling=case["scale"],
            is_causal=case["causal"],
        )[0]

    return attend


def ringmaster_model(model, layout) -> None:
    runtime = ringmaster_runtime(layout.sp_size)
    from ringmaster.sp_context import ContextParallelContextManager

    model.set_attn_implementation(runtime.attn_implementation)
    ContextParallelContextManager([model], runtime.cp_group).install()  # shards the batch in each forward


@dataclass(frozen=True)
class Impl:
    name: str
    ours: bool  # ratios are ours / peer
    attention: Callable
    model: Callable


IMPLS = [
    Impl("seqpar_hf", True, ours_attention(), ours_model()),
    Impl("seqpar_hf-chunks2", True, ours_attention(2), ours_model(2)),
    Impl("deepspeed", False, deepspeed_attention, deepspeed_model),
    Impl("ringmaster", False, ringmaster_attention, ringmaster_model),
    Impl("seqpar_hf-previous", False, ours_attention("previous"), ours_model("previous")),
]
