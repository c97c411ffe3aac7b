"""CPU training throughput (tokens per second, forward + backward, fp32, batch 1).

(a) Overhead of the patch: the unpatched Marian-style model and a patched copy at sp=1 (same
    weights, same batch) in one process, alternating runs (the order flips every round, so drift in
    machine load hits both). Target: patched median <= 1.05 x unpatched median.
(b) A long sequence on 2 processes (gloo, 1 torch thread each, so 2 processes use the 2 cores):
    sp=2 Ulysses and sp=2 ring on one sequence of --long-len, against 2 processes of plain data
    parallelism at half the length per rank (same tokens per step, half the attention work), all
    three alternating inside the same processes and wrapped in DDP (every variant pays the same
    gradient all-reduce); and 1 process (--threads threads) on the full length, run afterwards.
    Hybrid needs sp >= 4 (ulysses_size and ring_size both > 1), so it is not in the sp=2 comparison.

Tokens per step count source + target tokens (a "2048-token Marian-style step" is a 2048-token
source and a 2048-token target). Each number is the median of --reps timed runs after --warmup runs;
the spread is (max - min) / 2 / median. A multi-process step's time is the slowest rank's.

    python -m benchmarks.throughput            # ~3-5 min on 2 free cores
    python -m benchmarks.throughput --quick    # 128 / 256 tokens, < 1 min
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import seqpar_hf
from benchmarks.common import MODELS, build_model, environment, make_batch, summary, table
from benchmarks.publish import output_options, publish

OVERHEAD_TARGET = 0.05


def step_time(model, batch) -> float:
    start = time.perf_counter()
    model(**batch).loss.backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def tokens(spec, seq_len: int) -> int:
    return 2 * seq_len if spec.kind == "seq2seq" else seq_len


def alternate(runners: dict, warmup: int, reps: int, sync=None) -> dict[str, list[float]]:
    """Run every runner once per round, rotating the order each round; times after warmup."""
    names, times = list(runners), {n: [] for n in runners}
    for i in range(warmup + reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t = runners[name]()
            t = sync(t) if sync else t
            if i >= warmup:
                times[name].append(t)
    return times


def record(part, variant, spec, seq_len_per_rank, processes, threads, tokens_per_step, times, **extra) -> dict:
    s = summary(times)
    return {
        "part": part,
        "variant": variant,
        "model": spec.name,
        "seq_len": seq_len_per_rank,
        "processes": processes,
        "threads_per_process": threads,
        "tokens_per_step": tokens_per_step,
        "step_s": s,
        "tokens_per_s": tokens_per_step / s["median"],
        "times_s": times,
        **extra,
    }


def overhead(spec, seq_len: int, threads: int, warmup: int, reps: int) -> list[dict]:
    torch.set_num_threads(threads)
    base = build_model(spec, max_len=seq_len)
    patched = seqpar_hf.patch_model(copy.deepcopy(base), seqpar_hf.ParallelLayout(1))
    batch = make_batch(spec, seq_len)
    times = alternate(
        {"unpatched": lambda: step_time(base, batch), "patched sp=1": lambda: step_time(patched, batch)}, warmup, reps
    )
    ratios = [p / u for p, u in zip(times["patched sp=1"], times["unpatched"])]  # paired, same round
    n = tokens(spec, seq_len)
    ratio = statistics.median(times["patched sp=1"]) / statistics.median(times["unpatched"])
    return [
        record("overhead", "unpatched", spec, seq_len, 1, threads, n, times["unpatched"]),
        record(
            "overhead",
            "patched sp=1",
            spec,
            seq_len,
            1,
            threads,
            n,
            times["patched sp=1"],
            overhead=ratio - 1,
            paired_ratio=summary(ratios),
            meets_target=ratio - 1 <= OVERHEAD_TARGET,
        ),
    ]


def _long_worker(name: str, long_len: int, warmup: int, reps: int) -> list[dict]:
    spec, rank = MODELS[name], dist.get_rank()
    base = build_model(spec, max_len=long_len)
    uly = seqpar_hf.ParallelLayout(2, mode="ulysses")
    ring = seqpar_hf.ParallelLayout(2, mode="ring")
    models = {
        "sp=2 ulysses": DDP(seqpar_hf.patch_model(copy.deepcopy(base), uly)),
        "sp=2 ring": DDP(seqpar_hf.patch_model(copy.deepcopy(base), ring)),
        "dp=2, half length": DDP(base),
    }
    full = make_batch(spec, long_len)  # the SP group's one sequence, the same on both ranks
    half = make_batch(spec, long_len // 2, seed=1 + rank)  # DP: each rank its own shorter sequence
    batches = {"sp=2 ulysses": full, "sp=2 ring": full, "dp=2, half length": half}

    def slowest(t: float) -> float:
        t = torch.tensor(t, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def runner(v):
        def run():
            dist.barrier()  # start together: the step time is the slowest rank's
            return step_time(models[v], batches[v])

        return run

    times = alternate({v: runner(v) for v in models}, warmup, reps, sync=slowest)
    n = tokens(spec, long_len)
    return [
        record("long", "sp=2 ulysses", spec, long_len, 2, 1, n, times["sp=2 ulysses"]),
        record("long", "sp=2 ring", spec, long_len, 2, 1, n, times["sp=2 ring"]),
        record("long", "dp=2, half length", spec, long_len // 2, 2, 1, n, times["dp=2, half length"]),
    ]


def single_process(spec, long_len, threads, warmup, reps) -> dict:
    torch.set_num_threads(threads)
    model = build_model(spec, max_len=long_len)
    batch = make_batch(spec, long_len)
    times = alternate({"1 process": lambda: step_time(model, batch)}, warmup, reps)["1 process"]
    return record("long", "1 process, full length", spec, long_len, 1, threads, tokens(spec, long_len), times)


def report(records: list[dict]) -> str:
    rows = []
    for r in records:
        s = r["step_s"]
        rows.append(
            {
                **r,
                "t": f"{s['median']:.3f}",
                "range": f"{s['min']:.3f}-{s['max']:.3f}",
                "sp": f"±{100 * s['spread']:.1f}%",
                "tps": f"{r['tokens_per_s']:.0f}",
                "pt": f"{r['processes']} x {r['threads_per_process']}",
                "o": f"{100 * r['overhead']:+.1f}%" if "overhead" in r else "",
                "ok": {True: "yes", False: "NO"}.get(r.get("meets_target"), ""),
            }
        )
    return table(
        rows,
        [
            ("part", "part"),
            ("variant", "variant"),
            ("model", "model"),
            ("seq len / rank", "seq_len"),
            ("processes x threads", "pt"),
            ("step s (median)", "t"),
            ("min-max", "range"),
            ("spread", "sp"),
            ("tokens/s", "tps"),
            ("overhead", "o"),
            ("<= 5%", "ok"),
        ],
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="marian-small", choices=sorted(MODELS))
    p.add_argument("--seq-len", type=int, default=2048, help="(a) source and target length")
    p.add_argument("--long-len", type=int, default=4096, help="(b) full length of the long sequence")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the single-process runs "
        "(default 2, both cores; 1 with --quick: 2 threads next to another busy process thrash)",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=7, help="(a) timed rounds")
    p.add_argument("--long-reps", type=int, default=5, help="(b) timed rounds")
    p.add_argument("--skip", choices=["overhead", "long"], default=None)
    p.add_argument("--quick", action="store_true", help="128 / 256 tokens, 2 rounds (validation, < 1 min)")
    output_options(p, "throughput")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_len, args.long_len, args.reps, args.long_reps = 128, 256, 2, 2
    if args.threads is None:
        args.threads = 1 if args.quick else 2
    spec = MODELS[args.model]
    print(
        f"# CPU throughput, {spec.name}, fp32, batch 1, forward + backward\n{environment()}\n"
        f"(a) in this process with {args.threads} threads; (b) 2 gloo processes x 1 thread, then 1 process x "
        f"{args.threads} threads\n"
    )

    records = []
    if args.skip != "overhead":
        records += overhead(spec, args.seq_len, args.threads, args.warmup, args.reps)
    if args.skip != "long":
        from tests.helpers.spawn import spawn

        records += spawn(_long_worker, 2, spec.name, args.long_len, args.warmup, args.long_reps, timeout=3600)[0]
        records.append(single_process(spec, args.long_len, args.threads, args.warmup, args.long_reps))
    print(report(records))
    publish("throughput", records, args)


if __name__ == "__main__":
    main()
