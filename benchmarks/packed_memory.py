"""Packed rows on one GPU: peak memory and step time of a training step (forward + backward) versus
the row's length, for the patched model (varlen flash kernel over the documents, no [s, s] mask) and
the unpatched transformers model on the same packed batch (transformers turns restarting
`position_ids` into a 4-D block-diagonal mask for SDPA: quadratic in the row).

Rows hold documents of --doc-len tokens each (`position_ids` restarting, no attention mask, the
`DataCollatorWithFlattening` convention); bf16 weights and activations, llama-gqa (benchmarks/common.py).
"Activations" is the step's peak minus what was allocated before it (weights); bytes per token
staying flat as the row grows is the linear-memory claim of issue 11.

    python -m benchmarks.packed_memory                    # H200: ~1 min
    python -m benchmarks.packed_memory --quick            # CPU: checks the script (fp32, tiny lengths)
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import seqpar_hf
from benchmarks.common import MODELS, build_model, environment, fmt_bytes, table, write_json


def packed_batch(length: int, doc_len: int, vocab: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, length), generator=g)
    pos = (torch.arange(length) % doc_len)[None]
    return {"input_ids": ids.to(device), "labels": ids.to(device), "position_ids": pos.to(device)}


def step(model, batch, device) -> tuple[int, float]:
    """(activation peak in bytes, seconds) of one forward + backward."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    model(**batch, use_cache=False).loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = 0
    return peak, time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    p.add_argument("--doc-len", type=int, default=1024)
    p.add_argument(
        "--unpatched-up-to",
        type=int,
        default=65536,
        help="largest length for the unpatched model (its mask is quadratic)",
    )
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.quick:
        args.lengths, args.doc_len, args.unpatched_up_to = [256, 512], 64, 512
    spec = MODELS["llama-gqa"]
    print(environment())
    rows = []
    for variant in ("patched", "unpatched"):
        model = build_model(spec, max(args.lengths), dtype=dtype, device=device)
        if variant == "patched":
            seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
        for length in args.lengths:
            if variant == "unpatched" and length > args.unpatched_up_to:
                continue
            batch = packed_batch(length, args.doc_len, spec.vocab, device)
            try:
                step(model, batch, device)  # warm-up (kernel selection, allocator)
                peak, seconds = step(model, batch, device)
            except torch.cuda.OutOfMemoryError:
                rows.append({"variant": variant, "length": length, "peak": None, "seconds": None})
                print(f"{variant} {length}: out of memory", flush=True)
                break
            rows.append(
                {
                    "variant": variant,
                    "length": length,
                    "peak": peak,
                    "per_token": peak / length,
                    "seconds": seconds,
                    "tokens_per_s": length / seconds,
                }
            )
            print(
                f"{variant} {length}: {fmt_bytes(peak)} ({peak / length / 1024:.1f} KiB/token), {seconds:.3f} s",
                flush=True,
            )
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    shown = [
        {
            **r,
            "peak": "OOM" if r["peak"] is None else fmt_bytes(r["peak"]),
            "per_token": f"{r.get('per_token', 0) / 1024:.1f} KiB",
            "seconds": "OOM" if r["seconds"] is None else f"{r['seconds']:.3f}",
        }
        for r in rows
    ]
    print(
        table(
            shown,
            [
                ("model", "variant"),
                ("row tokens", "length"),
                ("activation peak", "peak"),
                ("per token", "per_token"),
                ("step s", "seconds"),
            ],
        )
    )
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
