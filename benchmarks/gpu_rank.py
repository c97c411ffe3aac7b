"""One rank of an sp-way sequence-parallel group on one GPU: peak memory, step time and the
longest sequence that fits, per sp, with gradient checkpointing off and on (bf16, SDPA flash).

The other sp-1 ranks are simulated: the process joins a single-process "fake" process group of
world size sp (benchmarks/fake_group.py), so `ParallelLayout(sp)` sees sp ranks and
every collective returns at once without moving data (received buffers are zero-filled here, as a
stand-in for the write a real collective does and to keep garbage out of the kernels). Only memory and
compute time are meaningful: the step time EXCLUDES communication (see comm_volume.py for the bytes;
divide by the link bandwidth to add it). The input check is off (its all-gather would compare garbage).
Rank 0 is the one measured: with Ulysses it holds the largest head share, with the zigzag ring the
same work as every other rank.

For each (model, sp or unpatched, checkpointing) the full sequence length doubles from --start-len
while the step fits in memory (torch.cuda.OutOfMemoryError ends the search) and the next doubling is
predicted (x4: attention is quadratic) to stay under --step-cap-s; the longest length that ran is
reported with the reason the search stopped, and a projection of the longest that fits from the
slope of peak memory between the last two lengths (activations grow linearly with flash attention).
--budget-s is shared by the sweeps: each may use the time left over the sweeps left, so a slow early
sweep cannot starve the sp=8 ones; a sweep stopped by it reports "budget".

Model FLOPs per rank (3 x forward, no recompute; attention 4 s_q s_k d per layer, half if causal)
over the step time give TFLOP/s per rank and MFU against the measured bf16 matmul rate; the measured
flash attention rate (forward + backward, counted as 3.5 x forward) is reported next to it.

    python -m benchmarks.gpu_rank                 # H200: ~7 min (sweeps bounded by --budget-s 360)
    python -m benchmarks.gpu_rank --quick         # CPU or GPU, tiny lengths: checks the fake-group path
    python -m benchmarks.gpu_rank --modes ulysses ring --sp 8 --models llama-gqa
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import seqpar_hf
from benchmarks import fake_group
from benchmarks.common import (
    MODELS,
    build_model,
    disable_checkpointing,
    enable_checkpointing,
    environment,
    fmt_bytes,
    make_batch,
    summary,
    table,
    write_json,
)
from benchmarks.instruments import CollectiveTap
from benchmarks.publish import json_path, output_options, publish

# ---------------------------------------------------------------------------------------------
# FLOPs and kernel ceilings


def train_flops(spec, seq_len: int) -> float:
    """Model FLOPs of one forward + backward (3 x forward) of the whole model, batch 1."""
    d, L, f, V, s = spec.d_model, spec.layers, spec.ffn, spec.vocab, seq_len
    if spec.kind == "causal":
        kv = spec.kv_heads * spec.head_dim
        linear = (L * (2 * d * d + 2 * d * kv + 3 * d * f) + d * V) * s
        attention = L * 4 * s * s * d * 0.5
    else:  # source and target both of seq_len
        encoder = L * (4 * d * d + 2 * d * f) * s
        decoder = (L * (4 * d * d + 2 * d * d + 2 * d * f) + d * V) * s + L * 2 * d * d * s  # cross k, v on source
        linear = encoder + decoder
        attention = L * 4 * s * s * d * (1 + 0.5 + 1)  # encoder self, causal decoder self, cross
    return 3 * (2 * linear + attention)


def timed(fn, device, reps: int) -> float:
    fn()  # warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernel_rates(device, dtype, n: int, s: int, heads: int = 8, head_dim: int = 64) -> list[dict]:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    t = timed(lambda: a @ b, device, 10)
    out = [{"part": "kernel", "kernel": f"matmul {n}x{n}x{n}", "tflops": 2 * n**3 / t / 1e12, "time_s": t}]
    q, k, v = (torch.randn(1, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    for causal in (False, True):

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(torch.ones_like(q))

        t = timed(step, device, 5)
        flops = 3.5 * 4 * s * s * heads * head_dim * (0.5 if causal else 1.0)
        out.append(
            {
                "part": "kernel",
                "kernel": f"sdpa fwd+bwd s={s} h={heads} d={head_dim}" + (" causal" if causal else ""),
                "tflops": flops / t / 1e12,
                "time_s": t,
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# one step, one sweep


def free(model, device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def try_step(model, batch, device, reps: int, cap_s: float) -> dict:
    """Warm-up + `reps` timed steps (the warm-up alone if it exceeds cap_s); {} on OOM."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times, oom = [], False
    try:
        for i in range(1 + reps):
            sync(device)
            start = time.perf_counter()
            model(**batch).loss.backward()
            sync(device)
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
            if i == 0 and times[0] > cap_s:
                break
    except torch.cuda.OutOfMemoryError:
        oom = True
    if oom:  # free outside the except block: its traceback holds the step's tensors
        free(model, device)
        return {}
    result = {"times_s": times[1:] or times, "step_s": summary(times[1:] or times)["median"]}
    if device.type == "cuda":
        result.update(peak_bytes=torch.cuda.max_memory_allocated(), base_bytes=base)
        result["activation_bytes"] = result["peak_bytes"] - base
    return result


def sweep(model, spec, label: dict, device, args, deadline: float, matmul_tflops: float) -> list[dict]:
    sp = label["sp"]
    records, seq_len, reason = [], args.start_len, "max length"
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    while seq_len <= args.max_len:
        if time.monotonic() > deadline:
            reason = "budget"
            break
        batch = make_batch(spec, seq_len, device=device)
        error = None
        try:
            r = try_step(model, batch, device, args.reps, args.step_cap_s)
        except Exception as exc:  # noqa: BLE001 - record it and go on: one failure must not lose the run
            error = f"error: {type(exc).__name__}: {str(exc)[:160]}"
        del batch
        if error:
            free(model, device)
            reason = error
            break
        if not r:
            reason = "out of memory"
            break
        flops = train_flops(spec, seq_len) / sp
        records.append(
            {
                "part": "step",
                **label,
                "seq_len": seq_len,
                "tokens_per_rank": seq_len // sp,
                **r,
                "model_tflops_per_rank": flops / r["step_s"] / 1e12,
                "mfu_vs_matmul": flops / r["step_s"] / 1e12 / matmul_tflops,
            }
        )
        if r["step_s"] * 4 > args.step_cap_s:
            reason = "time cap"
            break
        seq_len *= 2
    summary_rec = {
        "part": "max_len",
        **label,
        "longest_run": records[-1]["seq_len"] if records else None,
        "stop_reason": reason,
        "projected_max": None,
    }
    ok = [r for r in records if "peak_bytes" in r]
    if len(ok) >= 2 and capacity:
        (l1, p1), (l2, p2) = (ok[-2]["seq_len"], ok[-2]["peak_bytes"]), (ok[-1]["seq_len"], ok[-1]["peak_bytes"])
        slope = (p2 - p1) / (l2 - l1)
        if slope > 0:
            summary_rec["projected_max"] = int(l2 + (0.95 * capacity - p2) / slope)  # 5% for fragmentation
    return records + [summary_rec]


def run(args, device, dtype, save=None) -> list[dict]:
    """All sweeps; `save(records)` after each, so a run cut short keeps what it measured."""
    records = kernel_rates(device, dtype, args.matmul_n, args.attn_len)
    matmul = records[0]["tflops"]
    end = time.monotonic() + args.budget_s
    backends = (
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        if device.type == "cuda"
        else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    )
    models = {name: build_model(MODELS[name], max_len=args.max_len, dtype=dtype, device=device) for name in args.models}
    impls = [("unpatched", 1)] + [
        (mode, sp)
        for sp in args.sp
        for mode in args.modes
        if not (mode == "ring" and sp == 1) and not (mode == "hybrid" and sp < 4)
    ]
    sweeps_left = len(args.checkpointing) * len(impls) * len(models)
    with sdpa_kernel(backends), CollectiveTap(fake_group.zero_received):
        for ckpt in args.checkpointing:
            for mode, sp in impls:
                fake_group.join(sp)
                layout = (
                    None
                    if mode == "unpatched"
                    else fake_group.layout(sp, mode=mode, ring_size=2 if mode == "hybrid" else None)
                )
                for name, model in models.items():
                    (enable_checkpointing if ckpt else disable_checkpointing)(model)
                    if layout is not None:
                        seqpar_hf.patch_model(model, layout, check_inputs=False)
                    label = {"model": name, "mode": mode, "sp": sp, "checkpointing": ckpt}
                    now = time.monotonic()
                    deadline = now + max(end - now, 0) / sweeps_left  # this sweep's fair share
                    sweeps_left -= 1
                    out = sweep(model, MODELS[name], label, device, args, deadline, matmul)
                    seqpar_hf.unpatch_model(model)
                    records += out
                    if save:
                        save(records)
                    print(
                        f"  {name} {mode} sp={sp} ckpt={'on' if ckpt else 'off'}: longest {out[-1]['longest_run']} "
                        f"({out[-1]['stop_reason']})",
                        flush=True,
                    )
    if dist.is_initialized():
        dist.destroy_process_group()
    return records


def report(records: list[dict]) -> str:
    ker = [{**r, "t": f"{r['tflops']:.1f}"} for r in records if r["part"] == "kernel"]
    out = table(ker, [("kernel", "kernel"), ("TFLOP/s", "t")])
    steps = [
        {
            **r,
            "ck": "on" if r["checkpointing"] else "off",
            "pk": fmt_bytes(r.get("peak_bytes")),
            "ac": fmt_bytes(r.get("activation_bytes")),
            "t": f"{r['step_s']:.3f}",
            "tps": f"{r['tokens_per_rank'] / r['step_s']:.0f}",
            "tf": f"{r['model_tflops_per_rank']:.1f}",
            "mfu": f"{100 * r['mfu_vs_matmul']:.1f}%",
        }
        for r in records
        if r["part"] == "step"
    ]
    out += "\n\n" + table(
        steps,
        [
            ("model", "model"),
            ("mode", "mode"),
            ("sp", "sp"),
            ("ckpt", "ck"),
            ("seq len", "seq_len"),
            ("peak / rank", "pk"),
            ("activations", "ac"),
            ("step s (no comm)", "t"),
            ("tokens/s / rank", "tps"),
            ("TFLOP/s / rank", "tf"),
            ("MFU vs matmul", "mfu"),
        ],
    )
    mx = [
        {
            **r,
            "ck": "on" if r["checkpointing"] else "off",
            "pr": "-" if r["projected_max"] is None else f"{r['projected_max']:,}",
        }
        for r in records
        if r["part"] == "max_len"
    ]
    out += "\n\nLongest full sequence (Marian: source and target each):\n\n" + table(
        mx,
        [
            ("model", "model"),
            ("mode", "mode"),
            ("sp", "sp"),
            ("ckpt", "ck"),
            ("longest run", "longest_run"),
            ("stopped by", "stop_reason"),
            ("projected max (memory slope)", "pr"),
        ],
    )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["llama-gqa", "marian-base"], choices=sorted(MODELS))
    p.add_argument("--sp", nargs="+", type=int, default=[1, 2, 4, 8])
    p.add_argument("--modes", nargs="+", default=["ulysses"], choices=["ulysses", "ring", "hybrid"])
    p.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--start-len", type=int, default=8192)
    p.add_argument("--max-len", type=int, default=1 << 20, help="also the Marian position table size")
    p.add_argument("--step-cap-s", type=float, default=3.0, help="no doubling once the next step would exceed this")
    p.add_argument("--reps", type=int, default=2, help="timed steps per length after one warm-up")
    p.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="time for all sweeps together, shared evenly: a sweep gets the remaining time over the sweeps left",
    )
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--attn-len", type=int, default=16384)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bf16 on GPU, fp32 on CPU")
    p.add_argument(
        "--quick",
        action="store_true",
        help="lengths 64-128, sp 1 2 4, ulysses + ring, tiny kernels; runs on CPU (no memory numbers there)",
    )
    output_options(p, "gpu_rank")
    args = p.parse_args(argv)
    args.checkpointing = [c == "on" for c in args.checkpointing]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        args.start_len, args.max_len, args.sp, args.reps = 64, 128, [1, 2, 4], 1
        args.modes = sorted(set(args.modes) | {"ring"})
        args.matmul_n, args.attn_len, args.step_cap_s = 256, 512, 1e9
        if device.type == "cpu":
            torch.set_num_threads(1)  # a validation run; one thread does not thrash on a busy machine
    elif device.type != "cuda":
        p.error("the full run needs a CUDA GPU; use --quick to check the fake-group path on CPU")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"# one simulated SP rank on {name}, {dtype}, batch 1, fake process group (no communication)\n{environment()}\n"
    )
    records = run(args, device, dtype, save=lambda recs: write_json(json_path(args, "gpu_rank"), recs, quiet=True))
    print(report(records))
    publish("gpu_rank", records, args)


if __name__ == "__main__":
    main()
