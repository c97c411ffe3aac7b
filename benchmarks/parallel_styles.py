"""Parallel styles side by side on 4 gloo processes: activation bytes saved for backward and bytes
communicated per transformer layer per rank, measured, against the Megatron-LM formulas (Korthikanti
et al. 2022, arXiv 2205.05198) and against what HF Llama's code saves under Megatron's rules.

    python -m benchmarks.parallel_styles            # 1024 tokens, ~1-2 min on 2 CPU cores
    python -m benchmarks.parallel_styles --quick    # 128 tokens, prints the tables, writes nothing

Layouts: TP alone three ways (transformers' `base_model_tp_plan` through torch's `parallelize_module`,
the same with Megatron's "f" on each block input, transformers' own `tp_plan="auto"`), seqpar_hf's TP+SP,
Ulysses, ring and TP+SP x Ulysses. Per layer = (4-layer model - 2-layer model) / 2. The method, the
formulas and what each gap is made of: benchmarks/README.md (parallel_styles.py).
"""

from __future__ import annotations

import argparse
import collections
import tempfile

import torch
import torch.distributed as dist

from benchmarks.common import environment, table
from benchmarks.instruments import OpCommCounter, saved_storages
from benchmarks.layer_formulas import E, comm_formula, extras, llama_activations, llama_terms, megatron_activations
from benchmarks.publish import output_options, publish

WORLD = 4
LAYERS = (2, 4)
MODEL = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=688, vocab_size=1024)

# name, kind, kwargs (seqpar_hf layout, or the hand-rolled TP variant), t, sp
LAYOUTS = [
    ("unsharded", "plain", {}, 1, 1),
    ("TP", "tp", {"block_input": False}, 4, 1),
    ("TP (f)", "tp", {"block_input": True}, 4, 1),
    ("TP (HF auto)", "hf_tp", {}, 4, 1),
    ("TP+SP", "seqpar", {"sp_size": 1, "tp_size": 4}, 4, 1),
    ("Ulysses", "seqpar", {"sp_size": 4}, 1, 4),
    ("ring", "seqpar", {"sp_size": 4, "mode": "ring"}, 1, 4),
    ("TP+SP x Ulysses", "seqpar", {"sp_size": 2, "tp_size": 2}, 2, 2),
]


# ---------------------------------------------------------------------------------------------
# measurement (runs inside each gloo process)


def build(layers: int, seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        **MODEL,
        num_hidden_layers=layers,
        head_dim=MODEL["hidden_size"] // MODEL["num_attention_heads"],
        max_position_embeddings=max(seq_len, 128),
        pad_token_id=0,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).float().train()


def tensor_parallel_alone(model, mesh, block_input: bool) -> None:
    """TP without SP: transformers' plan as column/row-parallel linears; norms replicated."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    for key, style in model.config.base_model_tp_plan.items():
        plan[key] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[style]()
    if block_input:  # Megatron's f: one DTensor input per block, one backward all-reduce per block
        plan["layers.*.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        )
        plan["layers.*.mlp"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        )
    parallelize_module(model.model, mesh, plan)
    parallelize_module(
        model.model.embed_tokens, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    )
    parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Replicate()))


def transformers_tp(path: str):
    """transformers' own tensor parallelism: `from_pretrained(tp_plan="auto")` over the world."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(
        path, tp_plan="auto", tp_size=WORLD, dtype=torch.float32, attn_implementation="sdpa"
    ).train()


def _worker(seq_len: int, checkpoints: dict) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    import seqpar_hf

    rank = dist.get_rank()
    ids = torch.randint(3, MODEL["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    tp_mesh = init_device_mesh("cpu", (WORLD,))
    layouts = {name: seqpar_hf.ParallelLayout(**kw) for name, kind, kw, _, _ in LAYOUTS if kind == "seqpar"}
    records = []
    for layers in LAYERS:
        for name, kind, kw, _, _ in LAYOUTS:
            rec = None
            if kind != "plain" or rank == 0:
                model = transformers_tp(checkpoints[layers]) if kind == "hf_tp" else build(layers, seq_len)
                if kind == "tp":
                    tensor_parallel_alone(model, tp_mesh, **kw)
                elif kind == "seqpar":
                    seqpar_hf.patch_model(model, layouts[name])
                saved = saved_storages(model, batch)
                with OpCommCounter() as fwd:
                    loss = model(**batch).loss
                with OpCommCounter() as bwd:
                    loss.backward()
                rec = {
                    "layout": name,
                    "layers": layers,
                    "rank": rank,
                    "saved": list(saved.values()),
                    "forward": dict(fwd.totals),
                    "backward": dict(bwd.totals),
                    "loss": float(loss.detach()),
                }
                del model, loss
            got = [None] * WORLD
            dist.all_gather_object(got, rec)
            if rank == 0:
                records.extend(r for r in got if r is not None)
    return records


# ---------------------------------------------------------------------------------------------
# the shape the formulas take (benchmarks/layer_formulas.py)


def shape(seq_len: int) -> dict:
    h, a, g = MODEL["hidden_size"], MODEL["num_attention_heads"], MODEL["num_key_value_heads"]
    return dict(s=seq_len, b=1, h=h, a=a, g=g, d=h // a, i=MODEL["intermediate_size"])


# ---------------------------------------------------------------------------------------------
# records: one per layout, per layer per rank


def _per_layer(raw, name, key) -> tuple[float, float]:
    """(max, min) over ranks of the per-layer value, from the 2- and 4-layer runs."""
    by = {(r["layers"], r["rank"]): key(r) for r in raw if r["layout"] == name}
    lo, hi = LAYERS
    vals = [(by[(hi, rk)] - by[(lo, rk)]) / (hi - lo) for rk in sorted({rk for _, rk in by})]
    return max(vals), min(vals)


def _listing(raw, name, prefix="model.layers.2") -> list[list]:
    """Saved storages of a middle layer on rank 0, grouped by (module, shape, dtype)."""
    rec = next(r for r in raw if r["layout"] == name and r["layers"] == LAYERS[1] and r["rank"] == 0)
    rows = collections.OrderedDict()
    for module, shp, dtype, nbytes in rec["saved"]:
        if module == prefix or module.startswith(prefix + "."):
            n, tot = rows.get((module[len(prefix) + 1 :] or "(layer)", tuple(shp), dtype), (0, 0))
            rows[(module[len(prefix) + 1 :] or "(layer)", tuple(shp), dtype)] = (n + 1, tot + nbytes)
    return [[m, "x".join(map(str, s)), dt, n, b] for (m, s, dt), (n, b) in rows.items()]


def analyse(raw: list[dict], seq_len: int) -> list[dict]:
    p = shape(seq_len)
    records = []
    for name, kind, _, t, sp in LAYOUTS:
        seq_par = kind == "seqpar" and t > 1
        rec = {
            "layout": name,
            "t": t,
            "sp": sp,
            "shape": p,
            "llama_terms": llama_terms(p),
            "megatron_bytes": megatron_activations(p, t, sp, seq_par),
            "llama_terms_bytes": llama_activations(p, t, sp, seq_par),
            "extras": extras(p, name, kind, t, sp),
            "comm_formula": comm_formula(name, p, t, sp),
            "listing": _listing(raw, name),
            "loss": {r["layers"]: r["loss"] for r in raw if r["layout"] == name and r["rank"] == 0},
        }
        rec["saved_bytes"], rec["saved_bytes_min"] = _per_layer(raw, name, lambda r: sum(v[3] for v in r["saved"]))
        for phase in ("forward", "backward"):
            kinds = sorted({k for r in raw if r["layout"] == name for k in r[phase]})
            rec[phase] = {
                "sent": _per_layer(raw, name, lambda r: sum(v[0] for v in r[phase].values()))[0],
                "payload": _per_layer(raw, name, lambda r: sum(v[1] for v in r[phase].values()))[0],
                "calls": {k: _per_layer(raw, name, lambda r, k=k: r[phase].get(k, [0, 0, 0])[2])[0] for k in kinds},
            }
        records.append(rec)
    return records


# ---------------------------------------------------------------------------------------------
# report


def kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def _ratio(a: float, b: float, digits: int = 3) -> str:
    return f"{a / b:.{digits}f}" if b else "-"


def report(records: list[dict]) -> str:
    p, by = records[0]["shape"], {r["layout"]: r for r in records}
    N, unsharded = p["s"] * p["b"] * p["h"] * E, by["unsharded"]["saved_bytes"]
    terms = records[0]["llama_terms"]
    out = [
        f"Llama h={p['h']}, a={p['a']}, g={p['g']} kv heads, d={p['d']}, i={p['i']}; s={p['s']}, b={p['b']}, fp32; "
        f"{WORLD} gloo processes. Per layer per rank, KiB; N = s*b*h*4 = {kib(N)} KiB. Llama-terms per token: "
        + ", ".join(f"{k} {v}" for k, v in terms.items())
        + f" (total {sum(terms.values()) / p['h']:.2f} h).\n"
    ]
    rows = []
    for r in records:
        hi, lo, t, sp = r["saved_bytes"], r["saved_bytes_min"], r["t"], r["sp"]
        explained = r["llama_terms_bytes"] + sum(r["extras"].values())
        rows.append(
            {
                "l": r["layout"],
                "t": t,
                "sp": sp,
                "m": kib(hi) if abs(hi - lo) < 1 else f"{kib(lo)}-{kib(hi)}",
                "mg": kib(r["megatron_bytes"]),
                "mgr": _ratio(hi, r["megatron_bytes"], 2),
                "ll": kib(r["llama_terms_bytes"]),
                "llr": _ratio(hi, r["llama_terms_bytes"], 2),
                "ex": kib(explained),
                "exr": _ratio(hi, explained),
                "u": _ratio(hi, unsharded),
                "ideal": f"{1 / (t * sp):.3f}",
                "named": ", ".join(f"{k}: +{kib(v)}" for k, v in r["extras"].items()) or "-",
            }
        )
    out.append(
        table(
            rows,
            [
                ("layout", "l"),
                ("t", "t"),
                ("sp", "sp"),
                ("saved KiB", "m"),
                ("Megatron fp32", "mg"),
                ("/ Megatron", "mgr"),
                ("Llama-terms", "ll"),
                ("/ Llama-terms", "llr"),
                ("+ named extras", "ex"),
                ("/ that", "exr"),
                ("/ unsharded", "u"),
                ("ideal 1/(t sp)", "ideal"),
                ("named extras KiB", "named"),
            ],
        )
    )
    rows = []
    for r in records[1:]:
        f, fw, bw = r["comm_formula"], r["forward"], r["backward"]
        calls = {
            ph: ", ".join(f"{c:g} {k}" for k, c in r[ph]["calls"].items() if c) or "-" for ph in ("forward", "backward")
        }
        rows.append(
            {
                "l": r["layout"],
                "t": r["t"],
                "sp": r["sp"],
                "fc": calls["forward"],
                "fp": kib(fw["payload"]),
                "fpf": kib(f["payload"]),
                "fs": kib(fw["sent"]),
                "fsf": kib(f["forward"]),
                "fr": _ratio(fw["sent"], f["forward"]),
                "bc": calls["backward"],
                "bs": kib(bw["sent"]),
                "bsf": kib(f["backward"]),
                "br": _ratio(bw["sent"], f["backward"]),
                "n": f"{(fw['sent'] + bw['sent']) / N:.2f} N",
            }
        )
    out.append(
        "\n"
        + table(
            rows,
            [
                ("layout", "l"),
                ("t", "t"),
                ("sp", "sp"),
                ("fwd calls", "fc"),
                ("fwd payload", "fp"),
                ("formula", "fpf"),
                ("fwd sent", "fs"),
                ("formula", "fsf"),
                ("ratio", "fr"),
                ("bwd calls", "bc"),
                ("bwd sent", "bs"),
                ("formula", "bsf"),
                ("ratio", "br"),
                ("fwd+bwd sent", "n"),
            ],
        )
    )
    for r in records:
        if r["layout"] != "TP (f)":  # the same listing as TP
            total = kib(sum(x[4] for x in r["listing"]))
            rows = [dict(zip("msdnb", x[:4] + [kib(x[4])])) for x in r["listing"]]
            out.append(
                f"\nlayers.2 of the 4-layer model on rank 0, {r['layout']} ({total} KiB):\n\n"
                + table(rows, [("module", "m"), ("shape", "s"), ("dtype", "d"), ("storages", "n"), ("KiB", "b")])
            )
    worst = max(abs(v - by["unsharded"]["loss"][k]) for r in records for k, v in r["loss"].items())
    out.append(f"\nEvery layout's loss equals the unsharded model's within {worst:.1e}.")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="128 tokens (validation)")
    output_options(parser, "parallel_styles", figure=False)
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len = 128
    from tests.helpers.spawn import spawn

    print(
        f"# parallel styles: bytes saved and sent per layer per rank\n{environment()}; {WORLD} gloo processes x "
        "1 torch thread\n"
    )
    with tempfile.TemporaryDirectory() as tmp:  # the same weights, as checkpoints for transformers' own TP
        checkpoints = {}
        for layers in LAYERS:
            checkpoints[layers] = f"{tmp}/llama{layers}"
            build(layers, args.seq_len).save_pretrained(checkpoints[layers])
        raw = spawn(_worker, WORLD, args.seq_len, checkpoints, timeout=900)[0]
    records = analyse(raw, args.seq_len)
    print(report(records))
    publish("parallel_styles", records, args)


if __name__ == "__main__":
    main()
