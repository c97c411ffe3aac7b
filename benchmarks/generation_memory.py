"""Generation under SP (`model.generate` on a patched model): what each rank holds, the longest prompt that
generates 64 tokens in a per-rank budget, and what a decoding step costs.

One rank of an sp-way group runs in one process joined to a single-process "fake" process group of world
size sp (benchmarks/fake_group.py, as gpu_rank.py and longest_sequence.py): sizes and
memory are exact, the tokens are not (collectives move nothing; received buffers are zeroed). sp = 1 is
the unpatched model. fp32, batch 1, no padding, greedy.

1. Bytes per rank of the sharded parts (target: <= 1.10 / sp of sp = 1): Marian-base (6 + 6 layers,
   d 512) with a long source: the encoder states and every layer's cross-attention K/V (read from the
   returned cache); llama-gqa (8 layers, 8 / 2 heads of 64) with a long prompt and 64 new tokens: the KV
   cache. Also the bytes each rank receives per decoding step (the log-sum-exp merges, counted).
2. The longest prompt that generates 64 tokens within --budget-gib per rank, per sp: the 44M-parameter
   Llama of longest_sequence.py (32K vocabulary, fp32 weights included). torch's MemTracker follows every
   storage of the whole generate call at two prompt lengths; the peak is affine in the length (segment by
   segment, longest_sequence.fit), a third length checks the prediction, and the budget is solved for.
3. Decode-step time, SP machinery vs unpatched at sp = 1 (a group of one: the sharded prefill and the
   merged attention run, nothing is communicated): the median decoding step (the model's forwards after
   the prompt's) of each run, the two models in turn, the median over runs; 1 thread. CPU timings on a
   shared 2-core machine are indicative only.

    python -m benchmarks.generation_memory            # ~10 min on 2 CPU cores
    python -m benchmarks.generation_memory --quick    # short lengths: checks the script
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist

import seqpar_hf
from benchmarks import fake_group
from benchmarks.common import MODELS, build_model, environment, fmt_bytes, records_of, table
from benchmarks.instruments import CollectiveTap
from benchmarks.longest_sequence import CONFIG, Timeline, fit, longest
from benchmarks.publish import json_path, output_options, publish
from seqpar_hf.models.forward.state import state_of
from seqpar_hf.models.generation.generate import generate as generate_sp

NEW_TOKENS = 64


def tokens(n: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, vocab, (1, n), generator=g)}


def model_for(spec_name: str, length: int, sp: int, mode: str = "ulysses", force: bool = False):
    """The model, unpatched at sp = 1 (unless `force`: patched over a group of one), else patched as rank 0
    of a fake sp-way group (no input check: it would compare zeroed buffers)."""
    spec = MODELS[spec_name]
    model = build_model(spec, max_len=length + NEW_TOKENS + 8).eval()
    if sp > 1 or force:
        fake_group.join(sp)
        seqpar_hf.patch_model(model, fake_group.layout(sp_size=sp, mode=mode), check_inputs=False)
    return model, spec


def run_generate(model, inputs: dict, new: int, force: bool = False):
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1, return_dict_in_generate=True)
    state = state_of(model)
    if force:  # generate under SP over a group of one (the wrapper would run the plain model)
        return generate_sp(state, model.generate.original, {**inputs, **kwargs})
    return model.generate(**inputs, **kwargs)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def sharded_bytes(sp: int, source: int, prompt: int) -> list[dict]:
    """Bytes per rank of the encoder states + cross K/V (Marian) and of the KV cache (Llama)."""
    rows = []
    model, spec = model_for("marian-base", source, sp)
    seen = {}
    encoder = model.get_encoder()
    hook = encoder.register_forward_hook(
        lambda m, a, k, out: seen.__setitem__("states", out.last_hidden_state), with_kwargs=True
    )
    received = []
    tap = CollectiveTap(lambda name, a: (fake_group.zero_received(name, a), received.append(_gathered(name, a))))
    with tap:
        out = run_generate(model, tokens(source, spec.vocab), NEW_TOKENS)
    hook.remove()
    cross = out.cache.cross_attention_cache.layers
    rows.append(
        {
            "model": "marian-base",
            "what": "encoder states + cross K/V",
            "sp": sp,
            "tokens": source,
            "encoder_states": _bytes([seen["states"]]),
            "cross_kv": _bytes([t for layer in cross for t in (layer.keys, layer.values)]),
            "self_kv (replicated)": _bytes(
                [t for layer in out.cache.self_attention_cache.layers for t in (layer.keys, layer.values)]
            ),
            "received_per_step": sum(received) / NEW_TOKENS,
        }
    )  # every decoder forward is a step
    rows[-1]["sharded"] = rows[-1]["encoder_states"] + rows[-1]["cross_kv"]
    received.clear()
    model, spec = model_for("llama-gqa", prompt, sp)
    with tap:
        out = run_generate(model, tokens(prompt, spec.vocab), NEW_TOKENS)
    rows.append(
        {
            "model": "llama-gqa",
            "what": "KV cache",
            "sp": sp,
            "tokens": prompt + NEW_TOKENS,
            "sharded": _bytes([t for layer in out.cache.layers for t in (layer.keys, layer.values)]),
            "received_per_step": sum(received) / (NEW_TOKENS - 1),
        }
    )  # the forwards after the prompt's
    gc.collect()
    return rows


def _gathered(name: str, a: dict) -> int:
    """Bytes this rank receives from the others in an all-gather (fake group: counted, not moved): in
    generate, only the decoding steps' merges all-gather (the prompt's forward all-to-alls, or passes K/V
    around the ring, and broadcasts its last hidden state once)."""
    if name in ("all_gather_into_tensor", "all_gather_single"):
        out, n = a["output_tensor"], dist.get_world_size(a.get("group"))
        return out.numel() * out.element_size() * (n - 1) // n
    return 0


def llama_44m(max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "max_position_embeddings": max_len}))
    model.set_attn_implementation("sdpa")
    return model.eval()


class _Root(torch.nn.Module):
    def __init__(self, model, inputs):
        super().__init__()
        self.inner, self.inputs = [model], inputs  # a list: not a submodule of its own

    def forward(self):
        return run_generate(self.inner[0], self.inputs, NEW_TOKENS)


def longest_prompt(sp: int, locals_: list[int], budget: float) -> dict:
    """Peak per rank of generate(prompt, 64 new tokens) at local prompt lengths; fit; solve for the budget."""
    points = []
    model = llama_44m(locals_[-1] * sp + NEW_TOKENS + 8)
    if sp > 1:
        fake_group.join(sp)
        seqpar_hf.patch_model(model, fake_group.layout(sp_size=sp), check_inputs=False)
    for local in locals_:
        inputs = tokens(local * sp, CONFIG["vocab_size"])
        gc.collect()
        timeline = Timeline()
        timeline.tracker.track_external(model)
        with CollectiveTap(fake_group.zero_received), timeline.tracker:
            _Root(model, inputs)()  # MemTracker follows a root module called once, the model many times in it
        snapshot = next(iter(timeline.tracker.get_tracker_snapshot("peak").values()))
        total = int(next(v for k, v in snapshot.items() if str(getattr(k, "value", k)).lower() == "total"))
        points.append(
            {
                "local": local,
                "total": total,
                "optimizer_total": 0,
                "segments": [t for _, t in timeline.segments],
                "segment_keys": [str(k) for k, _ in timeline.segments],
            }
        )
    peak, _ = fit(points[:2])
    check = points[-1]
    return {
        "sp": sp,
        "peaks": [p["total"] for p in points],
        "locals": locals_,
        "predicted_third": peak(check["local"]),
        "fit_error": abs(peak(check["local"]) - check["total"]) / check["total"],
        "longest": longest(peak, sp, budget),
        "budget": budget,
    }


class StepTimer:
    """Wall time of every forward of the model after the first (the prompt's): the decoding steps."""

    def __init__(self, model):
        self.times, self._start = [], None
        self.handles = [model.register_forward_pre_hook(self.pre), model.register_forward_hook(self.post)]

    def pre(self, module, args):
        self._start = time.perf_counter()

    def post(self, module, args, out):
        self.times.append(time.perf_counter() - self._start)

    def decode_median(self) -> float:
        return statistics.median(self.times[1:])


def decode_time(spec_name: str, length: int, new: int, reps: int) -> dict:
    """Median per-step decode time of the unpatched model and of generate under SP over a group of one,
    the two run in turn `reps` times (each run's median step; the median of those)."""
    out = {"model": spec_name, "tokens": length, "new": new}
    runs = {label: [] for label in ("unpatched", "sp machinery (sp=1)")}
    models = {}
    for label, force in (("unpatched", False), ("sp machinery (sp=1)", True)):
        model, spec = model_for(spec_name, length, 1, force=force)
        models[label] = (model, force)
    inputs = tokens(length, spec.vocab)
    for _ in range(reps):
        for label, (model, force) in models.items():
            timer = StepTimer(model)
            run_generate(model, inputs, new + 1, force)
            runs[label].append(timer.decode_median())
            for h in timer.handles:
                h.remove()
    out.update({label: statistics.median(v) for label, v in runs.items()})
    out["ratio"] = out["sp machinery (sp=1)"] / out["unpatched"]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--source", type=int, default=4096, help="Marian-base source tokens")
    parser.add_argument("--prompt", type=int, default=8192, help="llama-gqa prompt tokens")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="per-rank budget of the longest-prompt search")
    parser.add_argument("--reps", type=int, default=3)
    parts = ["bytes", "longest", "time"]
    parser.add_argument(
        "--parts",
        nargs="+",
        default=parts,
        choices=parts,
        help="what to measure; the records of the other parts are kept from the JSON file",
    )
    parser.add_argument("--quick", action="store_true")
    output_options(parser, "generation_memory", figure=False)
    args = parser.parse_args()
    if args.quick:
        args.source, args.prompt, args.reps = 256, 512, 1
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(environment())
    records = []
    if "bytes" in args.parts:
        records += measure_bytes(args)
    if "longest" in args.parts:
        records += measure_longest(args)
    if "time" in args.parts:
        records += measure_time(args)
    path = json_path(args, "generation_memory")
    if path is not None and path.exists() and len(args.parts) < 3:  # keep the other parts' records
        records = [r for r in records_of(path) if r["part"] not in args.parts] + records
    publish("generation_memory", records, args)


def measure_bytes(args) -> list[dict]:
    rows = [r for sp in args.sp for r in sharded_bytes(sp, args.source, args.prompt)]
    for r in rows:
        base = next(b for b in rows if b["model"] == r["model"] and b["sp"] == 1)
        r["times_sp_over_sp1"] = r["sharded"] * r["sp"] / base["sharded"]
    print("\n1. Bytes per rank of the sharded parts (target: x sp / sp=1 <= 1.10)\n")
    print(
        table(
            [
                {
                    **r,
                    "sharded_f": fmt_bytes(r["sharded"]),
                    "ratio": f"{r['times_sp_over_sp1']:.3f}",
                    "recv": fmt_bytes(r["received_per_step"]),
                }
                for r in rows
            ],
            [
                ("model", "model"),
                ("what", "what"),
                ("sp", "sp"),
                ("tokens", "tokens"),
                ("bytes / rank", "sharded_f"),
                ("x sp / sp=1", "ratio"),
                ("received / step", "recv"),
            ],
        )
    )
    return [{"part": "bytes", **r} for r in rows]


def measure_longest(args) -> list[dict]:
    locals_ = [64, 128, 256] if args.quick else [512, 1024, 2048]
    budget = args.budget_gib * 2**30
    found = [longest_prompt(sp, locals_, budget) for sp in args.sp]
    print(
        f"\n2. Longest prompt that generates {NEW_TOKENS} tokens in {args.budget_gib} GiB per rank (44M Llama, fp32)\n"
    )
    print(
        table(
            [
                {
                    "sp": r["sp"],
                    "longest": f"{r['longest']:,}",
                    "x": f"{r['longest'] / found[0]['longest']:.2f}",
                    "peaks": " / ".join(fmt_bytes(p) for p in r["peaks"]),
                    "err": f"{r['fit_error']:.2%}",
                }
                for r in found
            ],
            [
                ("sp", "sp"),
                ("longest prompt", "longest"),
                ("vs sp=1", "x"),
                ("measured peaks (3 lengths)", "peaks"),
                ("third predicted, error", "err"),
            ],
        )
    )
    return [{"part": "longest", **r} for r in found]


def measure_time(args) -> list[dict]:
    torch.set_num_threads(1)  # a loaded 2-core machine: threads that wait for each other swamp the step
    times = [
        decode_time("llama-gqa", args.prompt // 2, 16 if args.quick else 32, args.reps),
        decode_time("marian-base", args.source // 2, 16 if args.quick else 32, args.reps),
    ]
    print("\n3. Decode step, generate under SP over a group of one vs unpatched (CPU, indicative)\n")
    print(
        table(
            [
                {
                    **t,
                    "u": f"{t['unpatched'] * 1e3:.1f} ms",
                    "s": f"{t['sp machinery (sp=1)'] * 1e3:.1f} ms",
                    "r": f"{t['ratio']:.2f}",
                }
                for t in times
            ],
            [("model", "model"), ("tokens", "tokens"), ("unpatched", "u"), ("SP path, sp=1", "s"), ("ratio", "r")],
        )
    )
    return [{"part": "time", **t} for t in times]


if __name__ == "__main__":
    main()
