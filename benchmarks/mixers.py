"""Token mixers under SP, per mixer layer and rank: activation bytes saved for backward, bytes each rank sends in
the mixer's forward collectives (the backward mirrors them), and the mixer's forward time, for each path
(models/mixers/): split along the sequence (a convolution halo, the scan's state passed), split by heads (or
channels), run whole, and one process without SP.

    python -m benchmarks.mixers                   # 4096 / 8192 / 16384 tokens, sp 1, 2, 4; ~10 min on 2 CPU cores
    python -m benchmarks.mixers --mixer lfm2      # LFM2's gated short convolution: sequence (halo), channels, whole
    python -m benchmarks.mixers --mixer granite4  # Granite 4's Mamba2: sequence, by heads, whole
    python -m benchmarks.mixers --quick           # 256 tokens, prints the tables, writes nothing
    python -m benchmarks.mixers --device cuda --seq-lens 16384 32768 65536 --sp 1 2 4 8  # one GPU, see below

The model: a Qwen3.5 text model from a config (hidden 512, two layers: gated DeltaNet then full attention,
key heads 4 / value heads 8 of width 64 as Qwen3-Next's 16 / 32 of 128 scaled down, vocab 1024), fp32,
batch 1, in gloo processes of one thread each (sp=4 runs 4 processes on 2 cores: its times are not a
speed). The by-heads path is the one a mixer takes where the split along the sequence is not proven, the
run-whole path the one where no head layout is either (Jamba's Mamba): here forced by hiding them, on the same
model.

With `--device cuda` each (length, sp, path) runs one simulated rank on one GPU (benchmarks/fake_group.py:
collectives return at once, what they would receive zeroed): rank 1 of sp, a middle run of the sequence where
sp > 2 (the most work of the state passing: the widened call, then the call from the passed state). Bytes are
this rank's; times leave out the communication; the peak is the GPU allocator's over a step.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import environment, fmt_bytes, table
from benchmarks.instruments import CollectiveTap, CommMeter, ModuleTags
from benchmarks.publish import json_path, output_options, publish, write_json

MODEL = dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
    vocab_size=1024,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    layer_types=["linear_attention", "full_attention"],
    num_hidden_layers=2,
)
MIXERS = {"qwen3_5": "model.layers.0.linear_attn", "lfm2": "model.layers.0.conv", "granite4": "model.layers.0.mamba"}
PATHS = {kind: ("sequence", "heads", "whole") for kind in MIXERS}
GRANITE4 = dict(  # Granite 4's Mamba2 (one group, 128 heads of 64, state 256) scaled to hidden 512
    hidden_size=512,
    intermediate_size=1024,
    shared_intermediate_size=1024,
    num_local_experts=0,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    num_hidden_layers=2,
    layer_types=["mamba", "attention"],
    mamba_n_heads=16,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=64,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=256,
)
LFM2 = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    num_hidden_layers=2,
    layer_types=["conv", "full_attention"],
    conv_L_cache=3,
)


def build(seq_len: int, mixer: str = "qwen3_5"):
    torch.manual_seed(0)
    if mixer == "granite4":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        config = GraniteMoeHybridConfig(**GRANITE4, max_position_embeddings=max(seq_len, 128), pad_token_id=0)
        config._attn_implementation = "sdpa"
        return GraniteMoeHybridForCausalLM(config).float().train()
    if mixer == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        config = Lfm2Config(**LFM2, max_position_embeddings=max(seq_len, 128), pad_token_id=0)
        config._attn_implementation = "sdpa"
        return Lfm2ForCausalLM(config).float().train()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**MODEL, max_position_embeddings=max(seq_len, 128), pad_token_id=0)
    config._attn_implementation = "sdpa"
    return Qwen3_5ForCausalLM(config).float().train()


def measure(
    seq_len: int, sp: int, path: str, repeats: int, mixer_kind: str = "qwen3_5", device: str = "cpu", dtype="fp32"
) -> dict:
    """One rank's figures (runs in each gloo process; on CUDA, in one process as rank 1 of a fake group)."""
    import contextlib

    import seqpar_hf
    from benchmarks import fake_group
    from seqpar_hf.models.forward.state import state_of
    from seqpar_hf.models.mixers import halo, heads, scan

    MIXER = MIXERS[mixer_kind]
    if path in ("heads", "whole"):  # as for a mixer not proven to split along the sequence
        halo.depthwise_conv = lambda module: None
        scan.find = lambda module: {}
    if path == "whole":
        heads.head_layout = lambda module: None  # as for a mixer without a proven head layout
    model = build(seq_len, mixer_kind).to(device, torch.bfloat16 if dtype == "bf16" else torch.float32)
    fake = device != "cpu"
    if fake:
        fake_group.join(sp, rank=min(1, sp - 1))
    if sp > 1:
        layout = fake_group.layout(sp) if fake else seqpar_hf.ParallelLayout(sp_size=sp)
        seqpar_hf.patch_model(model, layout, check_inputs=False)
        got = set(state_of(model).mixers.values())
        assert (got == {path}) == (path != "whole"), got
    ids = torch.randint(1, MODEL["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    sync = torch.cuda.synchronize if fake else (lambda: None)
    mixer = model.get_submodule(MIXER)
    # activation bytes the mixer saves (each storage once; the gathered input and the partial sums included)
    saved: dict = {}
    tags = ModuleTags(model)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights and ptr not in saved and tags.current.startswith(MIXER):
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    meter = CommMeter()
    mixer.register_forward_pre_hook(lambda m, a, k: setattr(meter, "label", "mixer"), with_kwargs=True)
    mixer.register_forward_hook(lambda m, a, k, o: setattr(meter, "label", "other"), with_kwargs=True)

    def record(name, arguments):  # one tap: a tap inside another would see the outer wrapper's (*args, **kwargs)
        if fake:
            fake_group.zero_received(name, arguments)
        meter.record(name, arguments)

    zeroed = CollectiveTap(fake_group.zero_received) if fake else contextlib.nullcontext()
    with tags, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), CollectiveTap(record):
        out = model(**batch)
        out.loss.backward()
    del out
    times = []
    starts: list = []

    def start(*_):
        sync()
        starts.append(time.perf_counter())

    def stop(*_):
        sync()
        times.append(time.perf_counter() - starts[-1])

    mixer.register_forward_pre_hook(start, with_kwargs=True)
    mixer.register_forward_hook(stop, with_kwargs=True)
    steps = []
    if fake:
        torch.cuda.reset_peak_memory_stats()
    with zeroed:
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            model(**batch).loss.backward()
            sync()
            steps.append(time.perf_counter() - t0)
    sent = sum(v[0] for (phase, label, _), v in meter.totals.items() if label == "mixer")
    return {
        "mixer": mixer_kind,
        "seq_len": seq_len,
        "sp": sp,
        "path": path if sp > 1 else "one process",
        "mixer_saved_bytes": sum(saved.values()),
        "mixer_forward_sent_bytes": sent,
        "mixer_forward_s": sorted(times)[len(times) // 2],
        "step_s": sorted(steps)[len(steps) // 2],
        "device": torch.cuda.get_device_name() if fake else "cpu",
        "dtype": dtype,
        "peak_bytes": torch.cuda.max_memory_allocated() if fake else None,
    }


def run(
    seq_lens: list[int],
    sps: list[int],
    repeats: int,
    partial=None,
    mixer: str = "qwen3_5",
    device: str = "cpu",
    paths: list[str] | None = None,
    dtype: str = "fp32",
) -> list[dict]:
    """Every (length, sp, path); `partial(records)` after each one (a long run keeps what it measured)."""
    from tests.helpers.spawn import spawn

    records = []
    for seq_len in seq_lens:
        for sp in sps:
            for path in (paths or PATHS[mixer]) if sp > 1 else ("one",):
                ranks = 1 if device != "cpu" else sp  # on the GPU one simulated rank
                got = spawn(measure, ranks, seq_len, sp, path, repeats, mixer, device, dtype, timeout=3600.0)
                rec = dict(got[0], per_rank_saved=[g["mixer_saved_bytes"] for g in got])
                print(
                    f"{seq_len} tokens sp={sp} {rec['path']}: mixer saves {fmt_bytes(rec['mixer_saved_bytes'])}, "
                    f"forward {rec['mixer_forward_s'] * 1e3:.0f} ms, step {rec['step_s']:.2f} s",
                    flush=True,
                )
                records.append(rec)
                if partial is not None:
                    partial(records)
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mixer", choices=sorted(MIXERS), default="qwen3_5", help="the mixer layer measured")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one simulated rank per run")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the model's weights and inputs")
    parser.add_argument("--paths", nargs="+", choices=["sequence", "heads", "whole"], help="default: all three")
    output_options(parser, "mixers", figure=False)
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_lens, args.repeats = [256], 1
    print(environment())
    name = "mixers" if args.mixer == "qwen3_5" else f"mixers_{args.mixer}"
    name += "_cuda" if args.device == "cuda" else ""
    path = json_path(args, name)
    partial = (lambda rs: write_json(path, rs)) if path else None
    records = run(args.seq_lens, args.sp, args.repeats, partial, args.mixer, args.device, args.paths, args.dtype)
    one = {r["seq_len"]: r for r in records if r["sp"] == 1}
    rows = []
    for r in records:
        base = one.get(r["seq_len"])
        rows.append(
            {
                **r,
                "saved": fmt_bytes(r["mixer_saved_bytes"]),
                "share": f"{r['mixer_saved_bytes'] / base['mixer_saved_bytes']:.2f}" if base else "",
                "sent": fmt_bytes(r["mixer_forward_sent_bytes"]),
                "fwd": f"{r['mixer_forward_s'] * 1e3:.0f} ms",
                "step": f"{r['step_s']:.2f} s",
                "peak": fmt_bytes(r["peak_bytes"]) if r.get("peak_bytes") else "",
            }
        )
    print(
        table(
            rows,
            [
                ("tokens", "seq_len"),
                ("sp", "sp"),
                ("path", "path"),
                ("mixer activations / rank", "saved"),
                ("vs one process", "share"),
                ("mixer forward sent / rank", "sent"),
                ("mixer forward", "fwd"),
                ("model step", "step"),
            ]
            + ([("peak (GPU)", "peak")] if args.device == "cuda" else []),
        )
    )
    publish(name, records, args)


if __name__ == "__main__":
    main()
