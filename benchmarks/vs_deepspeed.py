"""Our Ulysses attention against DeepSpeed's `deepspeed.sequence.layer.DistributedAttention`, side by
side in the same 2 gloo processes (1 torch thread each), alternating runs.

(a) Attention only: the same q, k, v ([b, s/2, h, d] per rank, as a projection produces them), the
    same local kernel (seqpar_hf.attention.kernels.unmasked, i.e. SDPA), forward + backward, at
    --seq-lens full tokens, causal and not. Ours: `seqpar_hf.attention.ulysses.ulysses_attention`; DeepSpeed:
    `DistributedAttention(local, group, scatter_idx=2, gather_idx=1)` with batch_dim_idx=0.
(b) Whole model: one training step (forward + backward) of the Llama-GQA model patched by seqpar_hf
    at sp=2, and of a copy whose attention sites call DeepSpeed's DistributedAttention instead of our
    all-to-alls (everything else - sharding, loss, the local kernel - identical).

Reported: the median of the per-round ratios time(ours) / time(DeepSpeed) and their spread
((max - min) / 2 / median), plus each side's median time. Target: ratio <= 1.0. A step's time is the
slower rank's. Outputs of the two are compared once (max abs difference) as a sanity check.

Needs DeepSpeed (CPU is enough):  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install deepspeed==0.19.8

    python -m benchmarks.vs_deepspeed           # 2048 / 8192 tokens + model at 2048, ~4-6 min
    python -m benchmarks.vs_deepspeed --quick   # 128 / 256 tokens, < 1 min
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import seqpar_hf
from benchmarks.common import MODELS, attention_modules, build_model, environment, make_batch, summary, table
from benchmarks.publish import output_options, publish
from seqpar_hf.attention import kernels
from seqpar_hf.attention.ulysses import ulysses_attention
from seqpar_hf.models.forward.sites import site_of  # the per-module AttentionSite; swapped in (b)


def load_deepspeed():
    """Import DeepSpeed and let deepspeed.comm wrap the already initialised torch process group."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.comm as ds_comm
    from deepspeed.sequence.layer import DistributedAttention

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    return DistributedAttention


def ds_local_attention(q, k, v, causal: bool, scale: float):
    """DeepSpeed hands the local kernel [b, s, h/n, d]; run the same SDPA call as ours."""
    rep = q.shape[2] // k.shape[2]
    kv_for_q = None if rep == 1 else tuple(i // rep for i in range(q.shape[2]))  # same GQA path as ours
    out = kernels.unmasked(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale, kv_for_q
    )  # [b, h/n, s, d]
    return out.transpose(1, 2)  # -> [b, s, h/n, d]


def _slowest(t: float) -> float:
    t = torch.tensor(t, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def compare(ours, theirs, warmup: int, reps: int) -> dict:
    """Alternate (order flips each round); paired ratios ours / theirs."""
    t_ours, t_ds = [], []
    for i in range(warmup + reps):
        if i % 2 == 0:
            a, b = timed(ours), timed(theirs)
        else:
            b, a = timed(theirs), timed(ours)
        if i >= warmup:
            t_ours.append(a)
            t_ds.append(b)
    ratios = [a / b for a, b in zip(t_ours, t_ds)]
    return {
        "ours_s": summary(t_ours),
        "deepspeed_s": summary(t_ds),
        "ratio": summary(ratios),
        "ratio_median": statistics.median(ratios),
    }


def _attention_case(DistributedAttention, group, seq_len, causal, heads, kv_heads, head_dim, warmup, reps) -> dict:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(0)  # same full tensors on every rank; each takes its sequence shard
    s_loc, scale = seq_len // n, head_dim**-0.5

    def shard(h):
        full = torch.randn(1, seq_len, h, head_dim, generator=g)  # [b, s, h, d]
        return full[:, rank * s_loc : (rank + 1) * s_loc].contiguous().requires_grad_()  # [b, s/n, h, d]

    q, k, v, grad = shard(heads), shard(kv_heads), shard(kv_heads), shard(heads).detach()

    def inner(q_, k_, v_, kv_for_q, heads=None):
        return kernels.unmasked(q_, k_, v_, causal, scale, kv_for_q)

    ds_attn = DistributedAttention(ds_local_attention, group, scatter_idx=2, gather_idx=1)

    def ours_out():
        # HF layout: [b, s/n, h, d] seen as [b, h, s/n, d]; the result back to [b, s/n, h, d]
        return ulysses_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group, rank, inner).transpose(
            1, 2
        )

    def theirs_out():
        return ds_attn(q, k, v, 0, None, causal, scale)  # batch_dim_idx=0, no rotary

    def step(out_fn):
        def run():
            out_fn().backward(grad)
            for t in (q, k, v):
                t.grad = None

        return run

    a, b = ours_out(), theirs_out()
    a.backward(grad)
    ga = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    b.backward(grad)
    diff = max((a - b).abs().max().item(), *[(x - t.grad).abs().max().item() for x, t in zip(ga, (q, k, v))])
    for t in (q, k, v):
        t.grad = None
    result = compare(step(ours_out), step(theirs_out), warmup, reps)
    return {
        "part": "attention",
        "seq_len": seq_len,
        "causal": causal,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "sp": n,
        "max_abs_diff": diff,
        **result,
    }


def use_deepspeed_attention(model, DistributedAttention, group) -> None:
    """Make every attention site of a patched model call DeepSpeed's Ulysses instead of ours."""
    for _, _, module in attention_modules(model):
        site = site_of(module)
        ds_attn = DistributedAttention(ds_local_attention, group, scatter_idx=2, gather_idx=1)

        def attend(ctx, q, k, v, causal, window, scale, dropout, ds_attn=ds_attn, site=site):
            if not ctx.pattern(site.q_side, site.kv_side, causal, window).spec.trivial or dropout:
                raise NotImplementedError("the DeepSpeed comparison runs without padding and dropout")
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            out = ds_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None, causal, scale)
            return out.transpose(1, 2)  # [b, s/n, h, d] -> [b, h, s/n, d], what AttentionSite.attend returns

        site.attend = attend  # instance attribute: only this model's sites


def _model_case(DistributedAttention, layout, name, seq_len, warmup, reps) -> dict:
    spec = MODELS[name]
    ours = build_model(spec, max_len=seq_len)
    theirs = copy.deepcopy(ours)
    seqpar_hf.patch_model(ours, layout)
    seqpar_hf.patch_model(theirs, layout)
    use_deepspeed_attention(theirs, DistributedAttention, layout.sp_group)
    batch = make_batch(spec, seq_len)
    diff = abs(ours(**batch).loss.item() - theirs(**batch).loss.item())

    def step(model):
        def run():
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    result = compare(step(ours), step(theirs), warmup, reps)
    return {
        "part": "model",
        "model": name,
        "seq_len": seq_len,
        "causal": True,
        "sp": layout.sp_size,
        "loss_abs_diff": diff,
        **result,
    }


def _worker(cfg: dict) -> list[dict]:
    DistributedAttention = load_deepspeed()
    layout = seqpar_hf.ParallelLayout(2, mode="ulysses")
    records = []
    for seq_len in cfg["seq_lens"]:
        reps = cfg["reps"] if seq_len <= 4096 else cfg["long_reps"]
        for causal in (False, True):
            records.append(
                _attention_case(
                    DistributedAttention,
                    layout.sp_group,
                    seq_len,
                    causal,
                    cfg["heads"],
                    cfg["kv_heads"],
                    cfg["head_dim"],
                    cfg["warmup"],
                    reps,
                )
            )
    if cfg["model_len"]:
        records.append(
            _model_case(DistributedAttention, layout, cfg["model"], cfg["model_len"], cfg["warmup"], cfg["model_reps"])
        )
    return records if dist.get_rank() == 0 else []


def report(records: list[dict]) -> str:
    rows = []
    for r in records:
        what = (
            f"attention h={r['heads']} kv={r['kv_heads']} d={r['head_dim']}"
            if r["part"] == "attention"
            else f"{r['model']} step"
        )
        rows.append(
            {
                "what": what,
                "s": r["seq_len"],
                "c": "yes" if r["causal"] else "no",
                "o": f"{r['ours_s']['median']:.4f}",
                "d": f"{r['deepspeed_s']['median']:.4f}",
                "r": f"{r['ratio_median']:.3f}",
                "sp": f"±{100 * r['ratio']['spread']:.1f}%",
                "n": r["ratio"]["n"],
                "ok": "yes" if r["ratio_median"] <= 1.0 else "NO",
                "diff": f"{r.get('max_abs_diff', r.get('loss_abs_diff')):.1e}",
            }
        )
    return table(
        rows,
        [
            ("what", "what"),
            ("seq len", "s"),
            ("causal", "c"),
            ("ours s", "o"),
            ("DeepSpeed s", "d"),
            ("ratio ours/DS (median)", "r"),
            ("spread", "sp"),
            ("rounds", "n"),
            ("<= 1.0", "ok"),
            ("max abs diff", "diff"),
        ],
    )


def race_options(p, reps: int, long_reps: int) -> None:
    """The options this script and vs_peers.py share: the attention shape, the model step, the rounds."""
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--model", default="llama-gqa", choices=sorted(m for m in MODELS if MODELS[m].kind == "causal"))
    p.add_argument("--model-len", type=int, default=2048, help="(b) sequence length; 0 skips (b)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=reps, help="rounds at <= 4096 tokens")
    p.add_argument("--long-reps", type=int, default=long_reps, help="rounds above 4096 tokens")
    p.add_argument("--model-reps", type=int, default=4)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", nargs="+", type=int, default=[2048, 8192], help="full sequence lengths")
    p.add_argument("--kv-heads", type=int, default=8)
    race_options(p, reps=15, long_reps=5)
    p.add_argument("--quick", action="store_true", help="128 / 256 tokens, model at 128 (validation, < 1 min)")
    output_options(p, "vs_deepspeed")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.model_len, args.reps, args.long_reps, args.model_reps = [128, 256], 128, 3, 3, 2
    try:
        import deepspeed
    except ImportError:
        sys.exit("DeepSpeed is not installed: DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install deepspeed==0.19.8")
    print(
        f"# seqpar_hf Ulysses vs DeepSpeed {deepspeed.__version__} DistributedAttention, fp32, batch 1, sp=2\n"
        f"{environment()}; 2 gloo processes x 1 torch thread\n"
    )

    from tests.helpers.spawn import spawn

    cfg = {
        k: getattr(args, k)
        for k in (
            "seq_lens",
            "heads",
            "kv_heads",
            "head_dim",
            "model",
            "model_len",
            "warmup",
            "reps",
            "long_reps",
            "model_reps",
        )
    }
    records = spawn(_worker, 2, cfg, timeout=3600)[0]
    print(report(records))
    publish("vs_deepspeed", records, args)


if __name__ == "__main__":
    main()
