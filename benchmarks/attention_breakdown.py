"""Where a Ulysses attention call's time goes, ours against DeepSpeed's: the kernel, and everything else
(the exchanges: packing, posting, the transfer, waiting for the partner rank). Issue 24's target (attention
forward + backward <= 0.85x DeepSpeed's "where latency dominates") depends on how much of DeepSpeed's time
is its exchange; this measures it instead of guessing it from the length.

In the same gloo processes (1 torch thread each), alternating within each round as vs_peers.py does:
ours (`seqpar_hf.attention.ulysses.ulysses_attention`), DeepSpeed 0.19.8's `DistributedAttention` (if
installed) and the kernel alone: the same SDPA call on what one rank computes after the exchange
(q [1, h/sp, S, d], its kv heads, causal), forward + backward. Per shape: medians, the exchange's share
of each time (1 - kernel / time), the exchanges alone compared ((ours - kernel) / (DeepSpeed - kernel), from
the medians), and the median of the per-round ratios ours / DeepSpeed.

    python -m benchmarks.attention_breakdown                   # sp 2 (kv 2, 4) and 4 (kv 4); 256, 512, 1024 tokens
    python -m benchmarks.attention_breakdown --quick           # sp 2, kv 2, 256 / 512 tokens, 5 rounds
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from benchmarks.common import environment, table
from benchmarks.peers import REFUSALS, deepspeed_attention, ours_attention
from benchmarks.publish import output_options, publish
from benchmarks.vs_deepspeed import timed
from benchmarks.vs_peers import calls_per_timing, fwd_bwd
from seqpar_hf.attention import kernels
from seqpar_hf.attention.heads import split_heads


def _kernel_only(case: dict, n: int, rank: int):
    """The SDPA call this rank makes after the exchange, forward + backward, on tensors of that shape."""
    split = split_heads(case["heads"], case["kv_heads"], n)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, split.q_sizes[rank], case["seq_len"], case["head_dim"], generator=g).requires_grad_()
    k, v = (
        torch.randn(1, split.kv_sizes[rank], case["seq_len"], case["head_dim"], generator=g).requires_grad_()
        for _ in range(2)
    )
    grad = torch.randn_like(q)
    kv_for_q = split.kv_for_q[rank]
    if kv_for_q is None and q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        kv_for_q = tuple(i // rep for i in range(q.shape[1]))

    def run():
        kernels.unmasked(q, k, v, case["causal"], case["scale"], kv_for_q).backward(grad)
        for t in (q, k, v):
            t.grad = None

    return run


def measure(case: dict, warmup: int, reps: int) -> dict:
    group = dist.group.WORLD
    n, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    s_loc = case["seq_len"] // n

    def shard(h):
        full = torch.randn(1, case["seq_len"], h, case["head_dim"], generator=g)
        return full[:, rank * s_loc : (rank + 1) * s_loc].contiguous().requires_grad_()

    q, k, v = shard(case["heads"]), shard(case["kv_heads"]), shard(case["kv_heads"])
    grad = shard(case["heads"]).detach()
    runs, refused = {"seqpar_hf": ours_attention()(group, case)}, {}
    try:
        runs["deepspeed"] = deepspeed_attention(group, case)
        fwd_bwd(runs["deepspeed"], q, k, v, grad)
    except REFUSALS as exc:
        runs.pop("deepspeed", None)
        refused["deepspeed"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    calls = {name: (lambda a=a: fwd_bwd(a, q, k, v, grad)) for name, a in runs.items()}
    calls["kernel"] = _kernel_only(case, n, rank)
    names, per_call = list(calls), calls_per_timing(case["seq_len"])
    times = {name: [] for name in names}
    for i in range(warmup + reps):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            t = timed(lambda name=name: [calls[name]() for _ in range(per_call)]) / per_call
            if i >= warmup:
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    out = {
        "sp": n,
        **{key: val for key, val in case.items() if key != "scale"},
        "rounds": reps,
        "calls_per_timing": per_call,
        "time_s": med,
        "refused": refused,
        "exchange_share": {name: 1 - med["kernel"] / med[name] for name in runs},
    }
    if "deepspeed" in runs:
        out["ours_vs_deepspeed"] = statistics.median(a / b for a, b in zip(times["seqpar_hf"], times["deepspeed"]))
    return out


def _worker(cfg: dict) -> list[dict]:
    records = []
    for kv in cfg["kv_heads"]:
        for seq_len in cfg["seq_lens"]:
            case = {
                "seq_len": seq_len,
                "heads": cfg["heads"],
                "kv_heads": kv,
                "head_dim": cfg["head_dim"],
                "causal": True,
                "scale": cfg["head_dim"] ** -0.5,
            }
            records.append(measure(case, cfg["warmup"], cfg["reps"]))
    return records if dist.get_rank() == 0 else []


def report(records: list[dict]) -> str:
    rows = []
    for r in records:
        t, share = r["time_s"], r["exchange_share"]
        rows.append(
            {
                "sp": r["sp"],
                "kv": r["kv_heads"],
                "s": r["seq_len"],
                "k": f"{1e3 * t['kernel']:.2f}",
                "o": f"{1e3 * t['seqpar_hf']:.2f}",
                "os": f"{100 * share['seqpar_hf']:.0f}%",
                "d": f"{1e3 * t['deepspeed']:.2f}" if "deepspeed" in t else "-",
                "ds": f"{100 * share['deepspeed']:.0f}%" if "deepspeed" in share else "-",
                "e": f"{(t['seqpar_hf'] - t['kernel']) / (t['deepspeed'] - t['kernel']):.2f}"
                if "deepspeed" in t
                else "-",
                "r": f"{r['ours_vs_deepspeed']:.3f}"
                if "ours_vs_deepspeed" in r
                else "; ".join(r["refused"].values()) or "-",
            }
        )
    return table(
        rows,
        [
            ("sp", "sp"),
            ("kv heads", "kv"),
            ("tokens", "s"),
            ("kernel ms", "k"),
            ("ours ms", "o"),
            ("ours: exchange share", "os"),
            ("DeepSpeed ms", "d"),
            ("DeepSpeed: exchange share", "ds"),
            ("exchange: ours / DeepSpeed", "e"),
            ("ours / DeepSpeed (median of rounds)", "r"),
        ],
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", nargs="+", type=int, default=[2, 4], help="gloo processes = sp")
    p.add_argument("--seq-lens", nargs="+", type=int, default=[256, 512, 1024], help="full lengths")
    p.add_argument("--kv-heads", nargs="+", type=int, default=None, help="default: 2 and 4 at sp 2, 4 at sp 4")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=30, help="rounds")
    p.add_argument("--quick", action="store_true", help="sp 2, kv 2, 256 / 512 tokens, 5 rounds (validation)")
    output_options(p, "attention_breakdown", figure=False)
    args = p.parse_args(argv)
    if args.quick:
        args.world, args.seq_lens, args.kv_heads, args.reps = [2], [256, 512], [2], 5
    print(
        f"# Ulysses attention: kernel vs exchange, fp32, batch 1, causal\n{environment()}; "
        f"gloo processes x 1 torch thread"
    )
    from tests.helpers.spawn import spawn

    records = []
    for n in args.world:
        kv = args.kv_heads or ([2, 4] if n == 2 else [4])  # DeepSpeed refuses kv heads < sp
        cfg = {
            "seq_lens": args.seq_lens,
            "kv_heads": kv,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "warmup": args.warmup,
            "reps": args.reps,
        }
        records += spawn(_worker, n, cfg, timeout=7200)[0]
    print("\n" + report(records))
    publish("attention_breakdown", records, args)


if __name__ == "__main__":
    main()
