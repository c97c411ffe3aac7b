"""Does communication really run while the kernel computes? Three measurements in the same 2 (and 4)
gloo processes (1 torch thread each), every figure a median over alternating rounds:

(a) gloo's asynchronous all_to_all_single: the exchange alone, a matmul loop alone (sized to take
    about as long), and the two together (`async_op=True`, compute, `wait()`). `hidden` = the share
    of the shorter one that disappeared: 1 = perfect overlap, 0 = none (the call was synchronous).
(b) Ulysses over head chunks (`seqpar_hf.attention.ulysses`): attention forward + backward (GQA,
    causal) with the fused exchange in 1, 2, 4 chunks, and the one-by-one exchange of the previous
    path; the time spent blocked in the exchanges' waits; per-round ratios chunks c / chunks 1. This
    is what `MIN_CHUNK_BYTES` (chunk only when every chunk sends at least that much) rests on.
(c) Ring attention (`seqpar_hf.attention.ring`, zigzag causal): the time blocked waiting for K/V
    (forward) and for K/V and the dK/dV accumulators (backward) against the same transfers done
    alone; `exposed` = blocked / alone (0: every hop hid behind the kernel).

    python -m benchmarks.overlap            # worlds 2 and 4; (b) and (c) at 1K-16K tokens (~15 min, idle machine)
    python -m benchmarks.overlap --quick    # world 2, small sizes (validation, < 2 min)

On CUDA (NCCL) a wait orders streams and never blocks the host; what overlaps there is measured by
benchmarks/gpu_rank.py --chunks on one GPU only as kernel time (overlap itself needs >= 2 GPUs).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks.common import environment, fmt_bytes, summary, table
from benchmarks.publish import output_options, publish
from benchmarks.vs_deepspeed import timed


class Blocked:
    """Seconds spent inside the wrapped wait functions (patched for the duration of a `with`)."""

    def __init__(self, owner, *names):
        self.owner, self.names, self.seconds, self._saved = owner, names, 0.0, {}

    def _wrap(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper

    def __enter__(self):
        for name in self.names:
            raw = self.owner.__dict__[name]
            self._saved[name] = raw
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            wrapped = self._wrap(fn)
            setattr(self.owner, name, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
        return self

    def __exit__(self, *exc):
        for name, raw in self._saved.items():
            setattr(self.owner, name, raw)


def _rounds(fns: dict, reps: int, warmup: int = 1) -> dict:
    """{name: [seconds]}: the functions in rotating order each round; each returns extra numbers or None."""
    names, out = list(fns), {n: [] for n in fns}
    for i in range(warmup + reps):
        for n in names[i % len(names) :] + names[: i % len(names)]:
            extra = {}
            t = timed(lambda n=n: extra.update(fns[n]() or {}))
            if i >= warmup:
                out[n].append((t, extra))
    return out


# ---------------------------------------------------------------------------------------------
# (a) gloo async


def gloo_async(mib: float, reps: int) -> dict:
    n = dist.get_world_size()
    send = torch.randn(int(mib * 2**20 / 4) // n * n)
    recv = torch.empty_like(send)
    a = torch.randn(256, 256)

    def comm():
        dist.all_to_all_single(recv, send)

    t_comm = summary([timed(comm) for _ in range(reps)])["median"]
    t_mm = summary([timed(lambda: a @ a) for _ in range(5)])["median"]
    loops = max(1, int(t_comm / t_mm))

    def compute():
        for _ in range(loops):
            a @ a

    def both():
        start = time.perf_counter()
        work = dist.all_to_all_single(recv, send, async_op=True)
        issued = time.perf_counter() - start  # an asynchronous call returns before the exchange is done
        compute()
        work.wait()
        return {"issue": issued}

    times = _rounds({"comm": comm, "compute": compute, "both": both}, reps)
    med = {k: summary([t for t, _ in v])["median"] for k, v in times.items()}
    hidden = (med["comm"] + med["compute"] - med["both"]) / min(med["comm"], med["compute"])
    return {
        "part": "gloo_async",
        "world": n,
        "bytes": send.nbytes,
        **{f"{k}_s": v for k, v in med.items()},
        "issue_s": summary([e["issue"] for _, e in times["both"]])["median"],
        "hidden": hidden,
    }


# ---------------------------------------------------------------------------------------------
# (b) Ulysses chunks


def ulysses_chunks(seq_len: int, heads: int, kv_heads: int, head_dim: int, reps: int) -> dict:
    from seqpar_hf.attention import kernels, pipeline
    from seqpar_hf.attention.heads import max_chunks
    from seqpar_hf.attention.ulysses import ulysses_attention, ulysses_attention_separate

    n, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    s_loc, group = seq_len // n, dist.group.WORLD

    def shard(h):
        return torch.randn(1, h, seq_len, head_dim, generator=g)[:, :, rank * s_loc : (rank + 1) * s_loc].contiguous()

    q, k, v, grad = shard(heads), shard(kv_heads), shard(kv_heads), shard(heads)

    def inner(q_, k_, v_, kv_for_q, heads=None):
        return kernels.unmasked(q_, k_, v_, True, head_dim**-0.5, kv_for_q)

    def run(fn):
        def step():
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            with Blocked(pipeline.Exchange, "wait", "wait_back") as blocked:
                fn(*x, group, rank, inner).backward(grad)
            return {"blocked": blocked.seconds}

        return step

    variants = {"previous": run(ulysses_attention_separate)}
    for c in (1, 2, 4):
        if c <= max_chunks(heads, n):
            variants[f"chunks {c}"] = run(lambda *a, c=c: ulysses_attention(*a, chunks=c))
    times = _rounds(variants, reps)
    sent = (q.numel() + 2 * k.numel()) * 4 * (n - 1) // n
    out = {
        "part": "ulysses_chunks",
        "world": n,
        "seq_len": seq_len,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "sent_bytes": sent,
        "time_s": {},
        "blocked_s": {},
        "ratio_vs_chunks1": {},
    }
    for name, rows in times.items():
        out["time_s"][name] = summary([t for t, _ in rows])
        out["blocked_s"][name] = summary([e["blocked"] for _, e in rows])["median"] if name != "previous" else None
        out["ratio_vs_chunks1"][name] = summary([a[0] / b[0] for a, b in zip(rows, times["chunks 1"])])
    return out


# ---------------------------------------------------------------------------------------------
# (c) ring hops


def ring_hops(seq_len: int, heads: int, head_dim: int, reps: int) -> dict:
    import seqpar_hf
    from seqpar_hf.attention import ring as ring_mod
    from seqpar_hf.attention.masks import MaskSpec, SeqMeta
    from seqpar_hf.parallel.sharding import ShardPlan

    layout = seqpar_hf.ParallelLayout(sp_size=dist.get_world_size(), mode="ring")
    n = layout.sp_size
    plan = ShardPlan.build(seq_len, n, layout.sp_rank, n, zigzag=True)
    meta = SeqMeta(plan, None, None)
    rplan = ring_mod.RingPlan.build(
        MaskSpec(meta, meta, True),
        layout.ring_group,
        layout.ring_ranks,
        layout.ring_rank,
        plan.ring_index(layout.ring_rank),
        [plan.ring_index(j) for j in range(n)],
    )
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, heads, seq_len // n, head_dim, generator=g) for _ in range(4))
    blocked = {"forward": [], "backward": []}

    def step():
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        with Blocked(ring_mod.Ring, "wait") as fwd:
            out = ring_mod.ring_attention(*x, rplan, head_dim**-0.5)
        with Blocked(ring_mod.Ring, "wait") as bwd:
            out.backward(grad)
        return {"forward": fwd.seconds, "backward": bwd.seconds}

    kv, acc = torch.stack([k, v]), torch.zeros((2, *k.shape))
    ring = ring_mod.Ring(rplan)

    def alone():  # the same transfers with nothing between start and wait
        start = time.perf_counter()
        for _ in range(n - 1):
            ring_mod.Ring.wait(ring.start(kv))
        mid = time.perf_counter()
        for _ in range(n - 1):
            ring_mod.Ring.wait(ring.start(kv))
        for _ in range(n):
            ring_mod.Ring.wait(ring.start(acc))
        return {"forward": mid - start, "backward": time.perf_counter() - mid}

    times = _rounds({"ring": step, "alone": alone}, reps)
    out = {
        "part": "ring_hops",
        "world": n,
        "seq_len": seq_len,
        "heads": heads,
        "head_dim": head_dim,
        "step_s": summary([t for t, _ in times["ring"]]),
    }
    for phase in blocked:
        waited = summary([e[phase] for _, e in times["ring"]])["median"]
        transfer = summary([e[phase] for _, e in times["alone"]])["median"]
        out[phase] = {"blocked_s": waited, "transfer_alone_s": transfer, "exposed": waited / transfer}
    return out


def _worker(cfg: dict) -> list[dict]:
    records = [gloo_async(mib, cfg["reps"]) for mib in cfg["mib"]]
    for s in cfg["seq_lens"]:
        reps = cfg["reps"] if s <= 4096 else cfg["long_reps"]
        records.append(ulysses_chunks(s, cfg["heads"], cfg["kv_heads"], cfg["head_dim"], reps))
        records.append(ring_hops(s, cfg["heads"] // 2, cfg["head_dim"], reps))
    return records if dist.get_rank() == 0 else []


def report(records: list[dict]) -> str:
    a = [
        {
            "w": r["world"],
            "b": fmt_bytes(r["bytes"]),
            "c": f"{r['comm_s'] * 1e3:.2f}",
            "i": f"{r['issue_s'] * 1e3:.3f}",
            "k": f"{r['compute_s'] * 1e3:.2f}",
            "t": f"{r['both_s'] * 1e3:.2f}",
            "h": f"{r['hidden']:.2f}",
        }
        for r in records
        if r["part"] == "gloo_async"
    ]
    out = "(a) gloo all_to_all_single(async_op=True) with a matmul loop:\n\n" + table(
        a,
        [
            ("world", "w"),
            ("bytes / rank", "b"),
            ("exchange ms", "c"),
            ("async call returns after ms", "i"),
            ("compute ms", "k"),
            ("both ms", "t"),
            ("hidden (1 = all)", "h"),
        ],
    )
    b = []
    for r in (r for r in records if r["part"] == "ulysses_chunks"):
        for name, t in r["time_s"].items():
            ratio = r["ratio_vs_chunks1"][name]
            b.append(
                {
                    "w": r["world"],
                    "s": r["seq_len"],
                    "sent": fmt_bytes(r["sent_bytes"]),
                    "v": name,
                    "t": f"{t['median'] * 1e3:.1f}",
                    "bl": "-" if r["blocked_s"][name] is None else f"{r['blocked_s'][name] * 1e3:.1f}",
                    "r": f"{ratio['median']:.3f} (±{100 * ratio['spread']:.0f}%)",
                }
            )
    out += "\n\n(b) Ulysses attention forward + backward by chunks:\n\n" + table(
        b,
        [
            ("world", "w"),
            ("tokens", "s"),
            ("q/k/v sent / rank", "sent"),
            ("exchange", "v"),
            ("ms", "t"),
            ("blocked in waits ms", "bl"),
            ("time / chunks 1", "r"),
        ],
    )
    c = [
        {
            "w": r["world"],
            "s": r["seq_len"],
            "t": f"{r['step_s']['median'] * 1e3:.1f}",
            **{
                p[0] + k: f"{r[p][key] * (1e3 if key != 'exposed' else 1):.{2 if key == 'exposed' else 1}f}"
                for p in ("forward", "backward")
                for k, key in (("b", "blocked_s"), ("a", "transfer_alone_s"), ("e", "exposed"))
            },
        }
        for r in records
        if r["part"] == "ring_hops"
    ]
    out += "\n\n(c) ring attention: time blocked waiting for transfers vs the transfers alone:\n\n" + table(
        c,
        [
            ("world", "w"),
            ("tokens", "s"),
            ("fwd+bwd ms", "t"),
            ("fwd blocked ms", "fb"),
            ("fwd alone ms", "fa"),
            ("fwd exposed", "fe"),
            ("bwd blocked ms", "bb"),
            ("bwd alone ms", "ba"),
            ("bwd exposed", "be"),
        ],
    )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", nargs="+", type=int, default=[2, 4])
    p.add_argument("--mib", nargs="+", type=float, default=[1, 8, 32], help="(a) bytes each rank sends, MiB")
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 8192, 16384])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--long-reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="world 2, 1 MiB, 512 / 2048 tokens, 3 rounds")
    output_options(p, "overlap", figure=False)
    args = p.parse_args(argv)
    if args.quick:
        args.world, args.mib, args.seq_lens, args.reps, args.long_reps = [2], [1], [512, 2048], 3, 3
    print(f"# overlap of communication and compute, fp32, batch 1\n{environment()}; gloo processes x 1 torch thread\n")
    from tests.helpers.spawn import spawn

    cfg = {k: getattr(args, k) for k in ("mib", "seq_lens", "heads", "kv_heads", "head_dim", "reps", "long_reps")}
    records = [r for n in args.world for r in spawn(_worker, n, cfg, timeout=7200)[0]]
    print(report(records))
    publish("overlap", records, args)


if __name__ == "__main__":
    main()
