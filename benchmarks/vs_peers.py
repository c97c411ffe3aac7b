"""Our Ulysses against the peers' Ulysses, side by side in the same 2 and 4 gloo processes (1 torch
thread each), on the same q/k/v and the same SDPA call, the implementations alternating within each
round (A B C, then B C A, C A B, ...): seqpar_hf (q/k/v in one all-to-all, head chunks by size), the
same forced into 2 head chunks, DeepSpeed 0.19.8 `DistributedAttention`, axolotl-ringmaster 0.2.7's
Ulysses (`rm.setup(..., device_type="cpu", inner_attn="sdpa")`) and our previous exchange (q, k, v
and the output one by one).

(a) Attention forward + backward, GQA (8 heads, 2 or 4 kv heads, head dim 64, causal), from
    latency-bound (256-1024 tokens) to bandwidth-bound (8K-16K): each one's median time (a timing covers
    16 calls at 256 tokens, 8 at 512, 4 at 1024: single short calls are too noisy), the median of
    the per-round ratios ours / peer, the max abs difference of the output and of dq, dk, dv against
    ours over every round, and the collectives one attention layer issues, forward and backward, with
    the bytes each rank sends.
(b) One training step of the llama-gqa model (8 layers): patched by seqpar_hf; the same patched model
    with DeepSpeed's attention at its attention sites (vs_deepspeed.py); the unpatched model with
    ringmaster's own integration (its registered attention + `ContextParallelContextManager`).

The implementations are `benchmarks/peers.py`'s `IMPLS`: a new variant of our attention is one more
entry there (ours=True), timed, compared and counted against every peer. Peers are optional: one that
is not installed, or that refuses a shape, is reported with the reason. Install them in a venv of
their own (never a CUDA torch):

    python3 -m venv /work/venvs/peers && . /work/venvs/peers/bin/activate
    pip install torch==2.13.0                                            # the CPU build, first
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install -e ".[bench,peers]"   # deepspeed, axolotl-ringmaster

    python -m benchmarks.vs_peers           # sp 2 and 4, 256-16384 tokens, kv 2 and 4; model at 2048
    python -m benchmarks.vs_peers --quick   # 256 / 1024 tokens, model at 256 (validation, < 2 min)
    python -m benchmarks.vs_peers --model-lens 256 1024 8192 --model-worlds 2 4   # the step at several lengths
    python -m benchmarks.vs_peers --impls seqpar_hf deepspeed   # a subset of benchmarks/peers.py's IMPLS
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util

import torch
import torch.distributed as dist

import seqpar_hf
from benchmarks.common import MODELS, build_model, environment, fmt_bytes, make_batch, summary, table
from benchmarks.instruments import CollectiveTap, CommMeter
from benchmarks.peers import IMPLS, INSTALL, REFUSALS
from benchmarks.publish import output_options, publish
from benchmarks.vs_deepspeed import race_options, timed

TAPPED = ("seqpar_hf", "deepspeed", "ringmaster")  # packages whose aliases of torch.distributed get counted


# ---------------------------------------------------------------------------------------------
# measuring (inside each gloo process)


def _agreed(ok: bool) -> bool:
    flag = torch.tensor(int(ok))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def _counted(step, meter: CommMeter) -> dict:
    """{phase: {collective: [calls, bytes sent]}} of one `step(meter)` under the collective tap."""
    with CollectiveTap(meter.record, modules=TAPPED):
        step(meter)
    out = {"forward": {}, "backward": {}}
    for (phase, _, name), (sent, _, _, calls) in meter.totals.items():
        out[phase][name] = [calls, sent]
    return out


def calls_per_timing(seq_len: int) -> int:
    """Calls of the attention per timing: a single call at 256 tokens takes ~10 ms on 2 cores, where the
    scheduler and gloo's wake-ups spread single timings by +-40-70%; 16 calls at 256, 8 at 512, 4 at
    1024, 2 at 2048, then 1."""
    return max(1, 4096 // seq_len)


def _repeat(fn, calls: int):
    for _ in range(calls - 1):
        fn()
    return fn()


def race(runs: dict, warmup: int, reps: int, diff=None, calls: int = 1) -> dict:
    """Time `runs[name]()` round-robin, the order rotating each round; per-round ratios ours / peer.
    Each timing covers `calls` consecutive calls (the time reported is per call).
    `diff(result, reference)` (optional) is taken against the first implementation every round."""
    names, first = list(runs), next(iter(runs))
    times, worst = {n: [] for n in names}, {n: 0.0 for n in names}
    for i in range(warmup + reps):
        order, results = names[i % len(names) :] + names[: i % len(names)], {}
        for n in order:
            t = timed(lambda n=n: results.__setitem__(n, _repeat(runs[n], calls))) / calls
            if i >= warmup:
                times[n].append(t)
        for n in names if diff else ():
            worst[n] = max(worst[n], diff(results[n], results[first]))
    kind = {i.name: i.ours for i in IMPLS}
    ratios = {
        f"{o}/{p}": summary([a / b for a, b in zip(times[o], times[p])])
        for o in names
        if kind[o]
        for p in names
        if not kind[p]
    }
    return {"time_s": {n: summary(times[n]) for n in names}, "ratios": ratios, "max_abs_diff": worst if diff else None}


def fwd_bwd(attend, q, k, v, grad):
    out = attend(q, k, v)
    out.backward(grad)
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return [out.detach(), *grads]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _set_up(setup, names) -> tuple[dict, dict]:
    """({name: setup(impl)} for the implementations every rank could set up, {name: why not} for the rest).
    The peers refuse a shape before their first collective, on every rank alike."""
    done, refused = {}, {}
    for impl in (i for i in IMPLS if i.name in names):
        try:
            value, reason = setup(impl), None
        except REFUSALS as exc:
            value, reason = None, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        if _agreed(reason is None):
            done[impl.name] = value
        else:
            refused[impl.name] = reason or "refused on another rank"
    return done, refused


def attention_case(group, case: dict, warmup: int, reps: int, names) -> dict:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(0)  # the same full tensors on every rank; each takes its shard
    s_loc = case["seq_len"] // n

    def shard(h):  # [b, s, h, d] -> this rank's [b, s/n, h, d]
        full = torch.randn(1, case["seq_len"], h, case["head_dim"], generator=g)
        return full[:, rank * s_loc : (rank + 1) * s_loc].contiguous().requires_grad_()

    q, k, v = shard(case["heads"]), shard(case["kv_heads"]), shard(case["kv_heads"])
    grad = shard(case["heads"]).detach()

    def setup(impl):
        attend = impl.attention(group, case)
        fwd_bwd(attend, q, k, v, grad)  # a first call: refusals show here
        return attend

    def step(attend, meter):
        out = attend(q, k, v)
        meter.phase = "backward"
        out.backward(grad)
        for t in (q, k, v):
            t.grad = None

    attends, refused = _set_up(setup, names)
    calls = calls_per_timing(case["seq_len"])
    return {
        "part": "attention",
        "sp": n,
        **{k: v for k, v in case.items() if k != "scale"},
        "refused": refused,
        "calls_per_timing": calls,
        "collectives": {name: _counted(functools.partial(step, a), CommMeter()) for name, a in attends.items()},
        **race(
            {name: functools.partial(fwd_bwd, a, q, k, v, grad) for name, a in attends.items()},
            warmup,
            reps,
            _max_diff,
            calls,
        ),
    }


def model_case(layout, name: str, layers: int, seq_len: int, warmup: int, reps: int, names) -> dict:
    """One training step of `name` (with `layers` layers) with each implementation; the losses compared
    once, in eval mode (where every implementation reports the whole sequence's mean)."""
    spec = dataclasses.replace(MODELS[name], layers=layers)
    base, batch = build_model(spec, max_len=seq_len), make_batch(spec, seq_len)

    def setup(impl):
        model = copy.deepcopy(base)
        impl.model(model, layout)
        with torch.no_grad():
            loss = model.eval()(**batch).loss.item()
        return model.train(), loss

    def step(model, meter=None):
        loss = model(**batch).loss
        if meter is not None:
            meter.phase = "backward"
        loss.backward()
        model.zero_grad(set_to_none=True)

    models, refused = _set_up(setup, names)
    losses = {n: loss for n, (_, loss) in models.items()}
    first = next(iter(losses.values()))
    return {
        "part": "model",
        "model": name,
        "layers": layers,
        "sp": layout.sp_size,
        "seq_len": seq_len,
        "refused": refused,
        "loss": losses,
        "loss_abs_diff": {n: abs(loss - first) for n, loss in losses.items()},
        "collectives": {n: _counted(functools.partial(step, m), CommMeter()) for n, (m, _) in models.items()},
        **race({n: functools.partial(step, m) for n, (m, _) in models.items()}, warmup, reps),
    }


def _worker(cfg: dict) -> list[dict]:
    n = dist.get_world_size()
    layout = seqpar_hf.ParallelLayout(n, mode="ulysses")
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
            short = seq_len <= 4096  # long ones: the checking and the counted call were the warm-up
            records.append(
                attention_case(
                    layout.sp_group,
                    case,
                    cfg["warmup"] if short else 0,
                    cfg["reps"] if short else cfg["long_reps"],
                    cfg["impls"],
                )
            )
    for layers in cfg["layers"] if n in cfg["model_worlds"] else ():
        for seq_len in cfg["model_lens"]:
            short = seq_len <= 4096
            records.append(
                model_case(
                    layout,
                    cfg["model"],
                    layers,
                    seq_len,
                    cfg["warmup"],
                    cfg["model_reps"] if short else cfg["long_reps"],
                    cfg["impls"],
                )
            )
    return records if dist.get_rank() == 0 else []


# ---------------------------------------------------------------------------------------------
# report


def _what(r: dict) -> str:
    if r["part"] == "model":
        return f"{r['model']} ({r['layers']} layers) step"
    return f"attention h={r['heads']} kv={r['kv_heads']} d={r['head_dim']}"


def report(records: list[dict]) -> str:
    pairs = sorted({p for r in records for p in r["ratios"]})
    names = [i.name for i in IMPLS if any(i.name in r["time_s"] for r in records)]
    rows, comm_rows = [], []
    for r in records:
        diffs = r.get("max_abs_diff") or r.get("loss_abs_diff") or {}
        row = {
            "w": _what(r),
            "sp": r["sp"],
            "s": r["seq_len"],
            "diff": ", ".join(f"{n} {d:.1e}" for n, d in diffs.items() if d is not None and n != names[0]) or "-",
            "no": "; ".join(f"{n}: {why.split('; ')[0]}" for n, why in r["refused"].items()) or "-",
        }
        row.update({n: f"{r['time_s'][n]['median']:.4f}" if n in r["time_s"] else "-" for n in names})
        row.update(
            {
                p: f"{r['ratios'][p]['median']:.3f} (±{100 * r['ratios'][p]['spread']:.0f}%, n={r['ratios'][p]['n']})"
                if p in r["ratios"]
                else "-"
                for p in pairs
            }
        )
        rows.append(row)
        longest = max(x["seq_len"] for x in records if x["part"] == r["part"] and x["sp"] == r["sp"])
        for n, phases in r["collectives"].items() if r["seq_len"] == longest else ():
            comm_rows.append(
                {
                    "w": _what(r),
                    "sp": r["sp"],
                    "s": r["seq_len"],
                    "impl": n,
                    **{ph: ", ".join(f"{c} {k}" for k, (c, _) in sorted(phases[ph].items())) or "-" for ph in phases},
                    **{ph + "_b": fmt_bytes(sum(b for _, b in phases[ph].values())) for ph in phases},
                }
            )
    timing = table(
        rows,
        [("what", "w"), ("sp", "sp"), ("tokens", "s")]
        + [(f"{n} s", n) for n in names]
        + [(f"{p} (median, spread, rounds)", p) for p in pairs]
        + [("max abs diff vs " + names[0], "diff"), ("refused", "no")],
    )
    counts = table(
        comm_rows,
        [
            ("what", "w"),
            ("sp", "sp"),
            ("tokens", "s"),
            ("implementation", "impl"),
            ("forward calls", "forward"),
            ("forward sent / rank", "forward_b"),
            ("backward calls", "backward"),
            ("backward sent / rank", "backward_b"),
        ],
    )
    return (
        f"{timing}\n\nCollectives per attention layer (attention rows) and per training step (model rows), "
        f"one rank, at the longest length of each world size:\n\n{counts}"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", nargs="+", type=int, default=[2, 4], help="gloo processes = sp")
    p.add_argument("--seq-lens", nargs="+", type=int, default=[256, 1024, 8192, 16384], help="full lengths")
    p.add_argument("--kv-heads", nargs="+", type=int, default=[2, 4])
    p.add_argument("--model-worlds", nargs="+", type=int, default=[2], help="world sizes that run (b)")
    p.add_argument("--model-lens", nargs="+", type=int, default=None, help="(b) lengths (default: --model-len)")
    p.add_argument("--layers", nargs="+", type=int, default=[8], help="(b) layer counts of the model")
    p.add_argument("--impls", nargs="+", default=[i.name for i in IMPLS], choices=[i.name for i in IMPLS])
    race_options(p, reps=10, long_reps=3)
    p.add_argument("--quick", action="store_true", help="256 / 1024 tokens, model at 256 (validation, < 2 min)")
    output_options(p, "vs_peers")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.model_len, args.reps, args.model_reps = [256, 1024], 256, 3, 2
    args.model_lens = args.model_lens or ([args.model_len] if args.model_len else [])
    print(
        f"# Ulysses: seqpar_hf vs DeepSpeed vs ringmaster, fp32, batch 1\n{environment()}; "
        f"gloo processes x 1 torch thread"
    )
    for peer, how in INSTALL.items():
        found = importlib.util.find_spec(peer) is not None
        print(f"{peer}: " + ("installed" if found else f"NOT installed, skipped (install: {how})"))

    from tests.helpers.spawn import spawn

    cfg = {
        k: getattr(args, k)
        for k in (
            "seq_lens",
            "heads",
            "kv_heads",
            "head_dim",
            "model",
            "model_lens",
            "layers",
            "model_worlds",
            "warmup",
            "reps",
            "long_reps",
            "model_reps",
            "impls",
        )
    }
    records = [r for n in args.world for r in spawn(_worker, n, cfg, timeout=7200)[0]]
    print("\n" + report(records))
    publish("vs_peers", records, args)


if __name__ == "__main__":
    main()
