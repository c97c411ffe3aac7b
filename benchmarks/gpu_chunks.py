"""What one GPU can say about head-chunked Ulysses (seqpar_hf/attention/ulysses.py): the cost side of
chunking. Overlapping the all-to-all with the kernel needs >= 2 GPUs; nothing here measures it.

(a) Kernel time per chunk count: SDPA flash forward + backward over the heads one Ulysses rank holds
    (h / sp query heads, their kv heads, the whole sequence), in one call and in c calls of h / (sp c)
    heads each, as the chunked path runs them. Ratio c / 1 > 1 is what the overlap must win back.
(b) Step time of one simulated rank (fake process group, benchmarks/gpu_rank.py: collectives return
    at once, received buffers zeroed) of the Llama-GQA model at sp = 2, 4, 8, with the exchange in
    1, 2, 4 head chunks (`ParallelLayout(head_chunks=c)`): everything chunking adds except the
    communication (packing copies, more and smaller kernels, the pipeline's autograd nodes).

    python -m benchmarks.gpu_chunks            # H200: ~3 min
    python -m benchmarks.gpu_chunks --quick    # CPU or GPU, tiny sizes: checks the script

`--quick` ran on an H200 (2026-12-04); the full run has not been made yet.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import seqpar_hf
from benchmarks import fake_group
from benchmarks.common import MODELS, build_model, environment, make_batch, table
from benchmarks.gpu_rank import timed, try_step
from benchmarks.instruments import CollectiveTap
from benchmarks.publish import output_options, publish
from seqpar_hf.attention.heads import chunk_plan, max_chunks


def kernel_times(device, dtype, seq_len: int, heads: int, kv_heads: int, head_dim: int, sp: int, chunks, reps: int):
    """(a): this rank's share after the exchange, in c calls."""
    plan_heads = chunk_plan(heads, kv_heads, sp, 1).pieces[0][0]
    h, g = plan_heads.heads, plan_heads.kv_heads
    q = torch.randn(1, h, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, g, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)
    out = []
    for c in (c for c in chunks if c <= max_chunks(heads, sp)):
        pieces = [p[0] for p in chunk_plan(heads, kv_heads, sp, c).pieces]

        def step():
            for p in pieces:
                lo, hi = p.q_local
                ku, kv_ = k[:, p.kv_use[0] : p.kv_use[1]], v[:, p.kv_use[0] : p.kv_use[1]]
                o = F.scaled_dot_product_attention(
                    q[:, lo:hi], ku, kv_, is_causal=True, enable_gqa=(hi - lo) != ku.shape[1]
                )
                o.backward(grad[:, lo:hi])

        out.append(
            {
                "part": "kernel",
                "sp": sp,
                "seq_len": seq_len,
                "heads": h,
                "kv_heads": g,
                "chunks": c,
                "time_s": timed(step, device, reps),
            }
        )
    for r in out:
        r["ratio"] = r["time_s"] / out[0]["time_s"]
    return out


def step_times(device, dtype, args) -> list[dict]:
    """(b): the fake-group step per sp and chunk count."""
    spec = MODELS["llama-gqa"]
    model = build_model(spec, max_len=args.step_len, dtype=dtype, device=device)
    batch = make_batch(spec, args.step_len, device=device)
    records = []
    with CollectiveTap(fake_group.zero_received):
        for sp in args.sp:
            fake_group.join(sp)
            for c in (c for c in args.chunks if c <= max_chunks(spec.heads, sp)):
                layout = fake_group.layout(sp, head_chunks=c)
                seqpar_hf.patch_model(model, layout, check_inputs=False)
                r = try_step(model, batch, device, args.reps, cap_s=1e9)
                seqpar_hf.unpatch_model(model)
                records.append(
                    {
                        "part": "step",
                        "sp": sp,
                        "chunks": c,
                        "seq_len": args.step_len,
                        "step_s": r.get("step_s"),
                        "peak_bytes": r.get("peak_bytes"),
                    }
                )
            base = next(r for r in records if r["sp"] == sp and r["chunks"] == 1)
            for r in records:
                if r["sp"] == sp and r["step_s"] and base["step_s"]:
                    r["ratio"] = r["step_s"] / base["step_s"]
    if dist.is_initialized():
        dist.destroy_process_group()
    return records


def report(records: list[dict]) -> str:
    k = [{**r, "t": f"{r['time_s'] * 1e3:.2f}", "r": f"{r['ratio']:.3f}"} for r in records if r["part"] == "kernel"]
    s = [
        {**r, "t": "-" if r["step_s"] is None else f"{r['step_s']:.3f}", "r": f"{r.get('ratio', float('nan')):.3f}"}
        for r in records
        if r["part"] == "step"
    ]
    return (
        "(a) SDPA forward + backward over one rank's heads, in c calls:\n\n"
        + table(
            k,
            [
                ("sp", "sp"),
                ("tokens", "seq_len"),
                ("heads / rank", "heads"),
                ("kv / rank", "kv_heads"),
                ("chunks", "chunks"),
                ("ms", "t"),
                ("/ 1 chunk", "r"),
            ],
        )
        + "\n\n(b) one simulated rank's training step (no communication), llama-gqa:\n\n"
        + table(s, [("sp", "sp"), ("tokens", "seq_len"), ("chunks", "chunks"), ("step s", "t"), ("/ 1 chunk", "r")])
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sp", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--chunks", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[8192, 32768, 131072], help="(a) full lengths")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--step-len", type=int, default=65536, help="(b) full length")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny sizes, runs on CPU")
    output_options(p, "gpu_chunks", figure=False)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        args.seq_lens, args.step_len, args.reps, args.heads, args.head_dim = [256], 256, 1, 8, 32
    elif device.type != "cuda":
        p.error("the full run needs a CUDA GPU; use --quick to check the script on CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(
        f"# head-chunked Ulysses on one {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
        f"{dtype}, batch 1\n{environment()}\n"
    )
    records = [
        r
        for sp in args.sp
        for s in args.seq_lens
        for r in kernel_times(device, dtype, s, args.heads, args.kv_heads, args.head_dim, sp, args.chunks, args.reps)
    ]
    records += step_times(device, dtype, args)
    print(report(records))
    publish("gpu_chunks", records, args)


if __name__ == "__main__":
    main()
