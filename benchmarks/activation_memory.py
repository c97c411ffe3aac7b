"""Activation memory per rank: bytes saved for backward, against sp and sequence length.

Counts the storages that autograd saves during one training-mode forward
(`torch.autograd.graph.saved_tensors_hooks`; each storage once, parameters and buffers excluded).
The hooks fire in the forward, so no backward is run. Reported next to the Megatron-LM estimate of
activations per transformer layer (Korthikanti et al. 2022, arXiv 2205.05198):

    s * b * h * (34 + 5 * a * s / h) / sp  bytes, for fp16 activations

(s sequence, b batch, h hidden, a heads). The models here run in fp32, so the estimate is doubled.
34 s b h counts a GPT layer with 4h MLP and dropout masks; 5 a s^2 b is the stored attention matrix,
which SDPA / flash attention never keeps, so the "no s^2" column (34 s b h * 2 / sp) is the closer one.

    python -m benchmarks.activation_memory                 # 512-2048 tokens, ~3 min on 2 CPU cores
                                                           # (4096: 4 processes exceed 24 GB)
    python -m benchmarks.activation_memory --quick         # 64 / 128 tokens, < 1 min
    python -m benchmarks.activation_memory --seq-lens 4096 --models llama-gqa --sp 2 4

One spawn of max(sp) gloo processes (1 torch thread each) runs every layout in turn: sp=1 (and
the unpatched model) on rank 0 alone with --sp1-threads threads while the others wait at a barrier,
sp=2 on ranks 0-1, sp=4 on ranks 0-3. Target: saved(sp=N) / saved(sp=1) <= 1.10 / N.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.distributed as dist

import seqpar_hf
from benchmarks.common import MODELS, build_model, environment, fmt_bytes, make_batch, table
from benchmarks.publish import output_options, publish

TARGET_SLACK = 1.10  # saved(sp=N) may exceed saved(sp=1) / N by 10% (replicated masks, indices, loss terms)


def saved_bytes(model, batch: dict) -> int:
    """Bytes of the distinct storages autograd saves in one forward of `model` (weights excluded)."""
    weights = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    seen: dict[int, int] = {}  # storage address -> size; a storage saved by several nodes counts once

    def pack(t: torch.Tensor):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage (none expected here)
            return t
        ptr = storage.data_ptr()
        if ptr and ptr not in weights:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**batch)  # the graph (and so every saved storage) stays alive while `out` does
    total = sum(seen.values())
    del out
    return total


def megatron_bytes(spec, seq_len: int, sp: int, batch: int = 1) -> tuple[float, float]:
    """(with, without the s^2 term) Megatron estimate for all layers, fp32 (= 2 x the fp16 formula)."""
    s, b, h, a = seq_len, batch, spec.d_model, spec.heads
    per_layer_fp16 = s * b * h * (34 + 5 * a * s / h) / sp
    no_s2_fp16 = s * b * h * 34 / sp
    return 2 * spec.attention_layers * per_layer_fp16, 2 * spec.attention_layers * no_s2_fp16


def _worker(
    models: list[str], seq_lens: list[int], layouts: list[tuple[int, str, int | None]], sp1_threads: int
) -> list[dict]:
    rank = dist.get_rank()
    # creating a layout is collective (new_group): every rank builds every layout, in the same order
    single = seqpar_hf.ParallelLayout(1)
    built = [(sp, mode, ring, seqpar_hf.ParallelLayout(sp, mode=mode, ring_size=ring)) for sp, mode, ring in layouts]
    records = []
    for name in models:
        spec = MODELS[name]
        model = build_model(spec, max_len=max(seq_lens))

        def measure(mode, sp, ring, layout=None):
            for seq_len in seq_lens:
                nbytes = saved_bytes(model, make_batch(spec, seq_len))
                per_rank = [None] * sp
                if layout is not None and sp > 1:
                    dist.all_gather_object(per_rank, nbytes, group=layout.sp_group)
                else:
                    per_rank = [nbytes]
                if rank == 0:
                    records.append(
                        {
                            "model": name,
                            "mode": mode,
                            "sp": sp,
                            "ring_size": ring,
                            "seq_len": seq_len,
                            "saved_bytes_per_rank": max(per_rank),
                            "saved_bytes_ranks": per_rank,
                        }
                    )

        if rank == 0:  # sp=1 alone: the other processes wait at the barrier below without using a core
            torch.set_num_threads(sp1_threads)
            measure("unpatched", 1, None)
            seqpar_hf.patch_model(model, single)
            measure("sp1", 1, None)
            seqpar_hf.unpatch_model(model)
            torch.set_num_threads(1)
        dist.barrier()
        for sp, mode, ring, layout in built:
            if rank < sp:  # the first SP group measures; further groups would repeat it
                seqpar_hf.patch_model(model, layout)
                measure(mode, sp, ring, layout)
                seqpar_hf.unpatch_model(model)
            dist.barrier()
    return records


def layouts_for(sps: list[int], modes: list[str]) -> list[tuple[int, str, int | None]]:
    out = []
    for sp in sorted(s for s in sps if s > 1):
        for mode in modes:
            if mode == "hybrid":
                if sp >= 4:  # hybrid needs ulysses_size > 1 and ring_size > 1
                    out.append((sp, "hybrid", 2))
            else:
                out.append((sp, mode, None))
    return out


def analyse(records: list[dict]) -> list[dict]:
    """Add the ratio to sp=1 and the Megatron estimates to every record."""
    base = {(r["model"], r["seq_len"]): r["saved_bytes_per_rank"] for r in records if r["mode"] == "sp1"}
    for r in records:
        spec = MODELS[r["model"]]
        r["megatron_fp32_bytes"], r["megatron_fp32_no_s2_bytes"] = megatron_bytes(spec, r["seq_len"], r["sp"])
        ref = base.get((r["model"], r["seq_len"]))
        r["ratio_to_sp1"] = r["saved_bytes_per_rank"] / ref if ref else None
        r["target_ratio"] = TARGET_SLACK / r["sp"] if r["sp"] > 1 else 1.0
        r["meets_target"] = (
            None if r["ratio_to_sp1"] is None or r["sp"] == 1 else r["ratio_to_sp1"] <= r["target_ratio"]
        )
    order = {m: i for i, m in enumerate(("unpatched", "sp1", "ulysses", "ring", "hybrid"))}
    return sorted(records, key=lambda r: (r["model"], r["seq_len"], r["sp"], order[r["mode"]]))


def report(records: list[dict]) -> str:
    rows = []
    for r in records:
        rows.append(
            {
                **r,
                "mode_s": r["mode"] + (f" (ring {r['ring_size']})" if r["mode"] == "hybrid" else ""),
                "saved": fmt_bytes(r["saved_bytes_per_rank"]),
                "mega": fmt_bytes(r["megatron_fp32_bytes"]),
                "mega2": fmt_bytes(r["megatron_fp32_no_s2_bytes"]),
                "ratio": "-" if r["ratio_to_sp1"] is None else f"{r['ratio_to_sp1']:.3f}",
                "target": f"{r['target_ratio']:.3f}",
                "ok": {None: "-", True: "yes", False: "NO"}[r["meets_target"]],
            }
        )
    return table(
        rows,
        [
            ("model", "model"),
            ("seq_len", "seq_len"),
            ("mode", "mode_s"),
            ("sp", "sp"),
            ("saved / rank", "saved"),
            ("Megatron fp32", "mega"),
            ("Megatron fp32, no s^2", "mega2"),
            ("saved / saved(sp=1)", "ratio"),
            ("target 1.10/sp", "target"),
            ("meets", "ok"),
        ],
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["marian-base", "llama-gqa"], choices=sorted(MODELS))
    p.add_argument(
        "--seq-lens",
        nargs="+",
        type=int,
        default=[512, 1024, 2048],
        help="full sequence lengths (Marian: source and target each), batch 1",
    )
    p.add_argument("--sp", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["ulysses", "ring", "hybrid"], choices=["ulysses", "ring", "hybrid"])
    p.add_argument("--sp1-threads", type=int, default=2, help="torch threads of the sp=1 runs (default: both cores)")
    p.add_argument("--quick", action="store_true", help="seq lens 64 128 (validation, < 1 min)")
    output_options(p, "activation_memory")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens = [64, 128]

    from tests.helpers.spawn import spawn

    layouts = layouts_for(args.sp, args.modes)
    world = max([1] + [sp for sp, _, _ in layouts])
    print(
        f"# activation memory: saved-for-backward bytes per rank, fp32, batch 1, forward only\n"
        f"{environment()}; {world} gloo process(es), 1 torch thread each (sp=1: rank 0 alone, "
        f"{args.sp1_threads} threads)\n"
    )
    records = []
    for name in args.models:  # one spawn per model: memory is returned to the system in between
        records += spawn(_worker, world, [name], args.seq_lens, layouts, args.sp1_threads, timeout=3600)[0]
    records = analyse(records)
    print(report(records))
    print(
        "\nMegatron columns: all layers (Marian: 6 encoder + 6 decoder; its cross-attention is not in the "
        "formula), fp16 formula x 2 for fp32. Measured includes embeddings and the loss (fp32 log-softmax "
        "of [s/sp, vocab])."
    )
    publish("activation_memory", records, args)


if __name__ == "__main__":
    main()
