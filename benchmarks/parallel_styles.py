"""Parallel styles side by side at one world size: activation bytes and communication bytes per
transformer layer per rank, measured, against the Megatron-LM formulas (Korthikanti et al. 2022,
arXiv 2205.05198), for a Llama-like model.

    python benchmarks/parallel_styles.py            # what produced benchmarks/results/parallel_styles.md
    python benchmarks/parallel_styles.py --quick    # 128 tokens, prints the report, writes nothing

(`HF_HUB_OFFLINE=1` is set by the script; it spawns its own 4 gloo processes, 1 torch thread each,
via tests/helpers/spawn.py; ~1-2 min on 2 CPU cores.)

Layouts, all on 4 processes (fp32, SDPA, dropout 0, batch 1, no padding, labels = input_ids):
- `unsharded`: the plain model, one process (rank 0 alone; the reference);
- `TP`: tensor parallelism alone, hand-rolled with torch's `parallelize_module` from transformers'
  `base_model_tp_plan` (q/k/v, gate/up column-parallel, o/down row-parallel with a replicated output,
  i.e. an all-reduce); norms and residuals replicated; vocab-parallel embedding with a replicated
  output, column-parallel LM head gathering the logits. The plan as transformers writes it converts the
  block input to a DTensor per linear, so the backward all-reduces the input gradient once per
  linear (3 + 2 per layer); `TP (f)` adds `PrepareModuleInput` on `self_attn` and `mlp`, the
  Megatron "f" operator: one backward all-reduce per block. Both save the same activations.
- `TP+SP`: seqpar_hf with tp_size=4, sp_size=1 (Megatron TP + sequence-sharded norm regions);
- `Ulysses`: seqpar_hf sp_size=4; `ring`: sp_size=4, mode="ring";
- `TP+SP x Ulysses`: seqpar_hf tp_size=2, sp_size=2.

Activation bytes: every storage autograd saves during one training forward
(`torch.autograd.graph.saved_tensors_hooks`), once per storage (`untyped_storage().data_ptr()`),
storages of parameters and buffers excluded, DTensors counted by their local tensor. Communication
bytes: every collective the rank issues in one forward and in the backward, seen by a
`TorchDispatchMode` (it sees both the `c10d.*` ops behind `torch.distributed` calls and the
`_c10d_functional.*` ops DTensor redistributions use). "Sent" is what leaves the rank with ring
algorithms: all-gather (n-1) x input, reduce-scatter (n-1)/n x input, all-reduce 2 (n-1)/n x tensor,
all-to-all the input minus the rank's own chunk, send its tensor. "Payload" is the Megatron paper's
unit: the full tensor of the collective (all-gather output, reduce-scatter input, all-reduce tensor,
all-to-all input, sent tensor). Per layer = (model with 4 layers - model with 2 layers) / 2, which
cancels the embedding, the LM head, the loss and seqpar_hf's per-forward input check.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "parallel_styles.md"
WORLD = 4
LAYERS = (2, 4)
MODEL = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=688, vocab_size=1024)
E = 4  # bytes per fp32 element

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


def _local(t):
    """The plain tensor holding `t`'s data on this rank: a DTensor's local tensor, an
    AsyncCollectiveTensor's result (what DTensor's functional collectives return until waited on)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    while isinstance(t, (DTensor, AsyncCollectiveTensor)):
        t = t._local_tensor if isinstance(t, DTensor) else t.elem
    return t


class ModuleTags:
    """Which module is running (innermost), through global module hooks."""

    def __init__(self, model):
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack = []

    def __enter__(self):
        from torch.nn.modules import module as mm

        def pre(module, args):
            self.stack.append(self.names.get(id(module), "?"))

        def post(module, args, out):
            if self.stack:
                self.stack.pop()
        self.handles = [mm.register_module_forward_pre_hook(pre), mm.register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""


def saved_tensors(model, batch) -> dict:
    """{storage address: (module, local shape, dtype, storage bytes)} saved in one training forward."""
    weights = {_local(t).untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    seen = {}
    tags = ModuleTags(model)

    def pack(t):
        local = _local(t)
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        ptr = storage.data_ptr()
        if ptr and ptr not in weights and ptr not in seen:
            seen[ptr] = (tags.current, tuple(local.shape), str(local.dtype).replace("torch.", ""), storage.nbytes())
        return t

    with tags, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**batch)  # the graph keeps every saved storage alive while `out` lives
    del out
    return seen


def _group_size(group) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group, str):
        group = _resolve_process_group(group)
    if isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    return group.size()


def _rank_in(group) -> int:
    if isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    return group.rank()


def collective_bytes(op: str, args) -> tuple[str, int, int]:
    """(kind, bytes sent by this rank, payload bytes) of one collective op call."""
    if op == "c10d::alltoall_base_":
        out, inp, pg, _, in_splits = args[:5]
        n, me = _group_size(pg), _rank_in(pg)
        rows = list(in_splits) or [inp.shape[0] // n] * n
        row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
        return "all-to-all", (sum(rows) - rows[me]) * row, inp.nbytes
    if op == "_c10d_functional::all_to_all_single":
        inp, _, in_splits, group = args[:4]
        n = _group_size(group)
        return "all-to-all", inp.nbytes * (n - 1) // n, inp.nbytes
    if op == "c10d::_allgather_base_":
        out, inp, pg = args[:3]
        return "all-gather", (_group_size(pg) - 1) * inp.nbytes, out.nbytes
    if op == "_c10d_functional::all_gather_into_tensor":
        inp, n = args[0], args[1]
        return "all-gather", (n - 1) * inp.nbytes, n * inp.nbytes
    if op == "_c10d_functional::reduce_scatter_tensor":
        inp, n = args[0], args[2]
        return "reduce-scatter", inp.nbytes * (n - 1) // n, inp.nbytes
    if op == "c10d::allreduce_":
        payload, n = sum(t.nbytes for t in args[0]), _group_size(args[1])
        return "all-reduce", 2 * (n - 1) * payload // n, payload
    if op == "_c10d_functional::all_reduce":
        payload, n = args[0].nbytes, _group_size(args[2])
        return "all-reduce", 2 * (n - 1) * payload // n, payload
    if op == "c10d::send":
        payload = sum(t.nbytes for t in args[0])
        return "send", payload, payload
    if op == "c10d::recv_":
        return "recv", 0, 0
    return f"other: {op}", 0, 0


_SKIP = ("_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd")


class CommCounter(TorchDispatchMode):
    """Bytes of every c10d / functional collective this rank issues, per kind."""

    def __init__(self):
        super().__init__()
        self.totals = collections.defaultdict(lambda: [0, 0, 0])  # kind -> [sent, payload, calls]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional"):
            op = func._schema.name
            if op not in _SKIP:
                kind, sent, payload = collective_bytes(op, args)
                t = self.totals[kind]
                t[0] += sent
                t[1] += payload
                t[2] += 1
        return func(*args, **(kwargs or {}))


def build(layers: int, seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, num_hidden_layers=layers, head_dim=MODEL["hidden_size"] // MODEL["num_attention_heads"],
                         max_position_embeddings=max(seq_len, 128), pad_token_id=0, attention_dropout=0.0,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).float().train()


def tensor_parallel_alone(model, mesh, block_input: bool) -> None:
    """TP without SP: transformers' plan as column/row-parallel linears; norms replicated."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    plan = {}
    for key, style in model.config.base_model_tp_plan.items():
        plan[key] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[style]()
    if block_input:  # Megatron's f: one DTensor input per block, one backward all-reduce per block
        plan["layers.*.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()}, desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False)
        plan["layers.*.mlp"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                                  use_local_output=False)
    parallelize_module(model.model, mesh, plan)
    parallelize_module(model.model.embed_tokens, mesh,
                       RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Replicate()))


def transformers_tp(path: str):
    """transformers' own tensor parallelism: `from_pretrained(tp_plan="auto")` over the world."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, tp_plan="auto", tp_size=WORLD, dtype=torch.float32,
                                            attn_implementation="sdpa").train()


def _worker(seq_len: int, checkpoints: dict) -> list[dict]:
    import seqpar_hf
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    ids = torch.randint(3, MODEL["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    tp_mesh = init_device_mesh("cpu", (WORLD,))
    layouts = {name: seqpar_hf.ParallelLayout(**kw) for name, kind, kw, _, _ in LAYOUTS if kind == "seqpar"}
    records = []
    for layers in LAYERS:
        for name, kind, kw, t, sp in LAYOUTS:
            active = kind != "plain" or rank == 0
            rec = None
            if active:
                model = transformers_tp(checkpoints[layers]) if kind == "hf_tp" else build(layers, seq_len)
                if kind == "tp":
                    tensor_parallel_alone(model, tp_mesh, **kw)
                elif kind == "seqpar":
                    seqpar_hf.patch_model(model, layouts[name])
                saved = saved_tensors(model, batch)
                with CommCounter() as fwd:
                    loss = model(**batch).loss
                with CommCounter() as bwd:
                    loss.backward()
                rec = {"layout": name, "layers": layers, "t": t, "sp": sp, "rank": rank,
                       "saved_bytes": sum(v[3] for v in saved.values()),
                       "saved": [(*v,) for v in saved.values()],
                       "forward": {k: list(v) for k, v in fwd.totals.items()},
                       "backward": {k: list(v) for k, v in bwd.totals.items()},
                       "loss": float(loss.detach())}
                del model, loss
            got = [None] * WORLD
            dist.all_gather_object(got, rec)
            if rank == 0:
                records.extend(r for r in got if r is not None)
    return records


# ---------------------------------------------------------------------------------------------
# formulas (bytes per transformer layer per rank; s tokens, b = 1)


def shape(seq_len: int) -> dict:
    h, a, g = MODEL["hidden_size"], MODEL["num_attention_heads"], MODEL["num_key_value_heads"]
    return dict(s=seq_len, b=1, h=h, a=a, g=g, d=h // a, i=MODEL["intermediate_size"])


def megatron_activations(p: dict, t: int, sp: int, sequence_parallel: bool) -> float:
    """Korthikanti et al. per layer, adapted to fp32, no dropout, flash attention (GPT shapes):
    fp16 34 sbh + 5 as^2 b -> drop the two 1-byte dropout masks (2 sbh), the softmax output, its
    dropout mask and dropout output (5 as^2 b; flash keeps only O, already counted as the projection
    input) -> 32 sbh in 2-byte elements -> 64 sbh bytes in fp32. TP alone: 10 -> 8 replicated
    (2 LN inputs, QKV input, MLP input), 24/t sharded -> sbh (16 + 48/t). TP+SP: 64 sbh / t. A
    sequence-sharded layout divides everything by sp."""
    sbh = p["s"] * p["b"] * p["h"]
    if t > 1 and not sequence_parallel:
        return sbh * (16 + 48 / t) / sp
    return 64 * sbh / (t * sp)


def llama_terms(p: dict) -> dict:
    """Elements per token that HF Llama's training forward saves per layer (fp32, SDPA flash kernel):
    norms: each RMSNorm keeps its input and input * rsqrt (2 h) and rsqrt (1) -> 4 h + 2;
    linear inputs: the two norm outputs (input of q/k/v and of gate/up) -> 2 h;
    attention: rotated q (h), rotated k (g d), v (g d), the kernel output (h, also the o_proj input),
    logsumexp (a, fp32) -> 2 h + 2 g d + a;  SwiGLU MLP: gate out, silu(gate), up out, their product
    (the down_proj input) -> 4 i."""
    h, g, d, a, i = p["h"], p["g"], p["d"], p["a"], p["i"]
    return {"norms": 4 * h + 2, "norm outputs": 2 * h, "attention": 2 * h + 2 * g * d + a, "mlp": 4 * i}


def llama_activations(p: dict, t: int, sp: int, sequence_parallel: bool) -> float:
    """Megatron's sharding rules applied to `llama_terms`: TP alone keeps norms and norm outputs
    whole, TP+SP shards everything t ways, SP shards everything sp ways."""
    terms = llama_terms(p)
    total = sum(terms.values())
    if t > 1 and not sequence_parallel:
        per_token = terms["norms"] + terms["norm outputs"] + (terms["attention"] + terms["mlp"]) / t
    else:
        per_token = total / t
    return p["s"] * p["b"] * per_token / sp * E


def comm_formula(name: str, p: dict, t: int, sp: int) -> dict:
    """{"forward": sent, "backward": sent, "payload": forward payload} per layer per rank, fp32."""
    s, b, h, g, d = p["s"], p["b"], p["h"], p["g"], p["d"]
    N = s * b * h * E  # one [s, b, h] activation
    out = {"forward": 0.0, "backward": 0.0, "payload": 0.0}
    if name.startswith("TP") and "SP" not in name:  # 2 all-reduces forward (o_proj, down_proj)
        ar = 2 * (t - 1) / t * N
        out["forward"], out["payload"] = 2 * ar, 2 * N
        out["backward"] = (2 if "(f)" in name else 5) * ar  # f: one per block; plan verbatim: one per linear
        return out
    if "TP+SP" in name:  # per block an all-gather of the block input and a reduce-scatter of its output
        n_tok = N / sp  # the SP-local sequence
        out["forward"] = out["backward"] = 4 * (t - 1) / t * n_tok
        out["payload"] = 4 * n_tok
    u = sp if name != "ring" else 1
    if u > 1:  # Ulysses: q, k, v in, o out; heads = this TP rank's share
        hq, hkv = p["a"] // t, max(g // t, u)
        x = (u - 1) / u * b * d * E * (2 * hq + 2 * hkv) * s / sp
        out["forward"] += x
        out["backward"] += x
        out["payload"] += b * d * E * (2 * hq + 2 * (g // t)) * s / sp
    if name == "ring":  # stacked K/V block passed r - 1 times; backward also the fp32 dK/dV home
        block = 2 * b * g * (s / sp) * d * E
        out["forward"] += (sp - 1) * block
        out["backward"] += (sp - 1) * block + sp * block
        out["payload"] += (sp - 1) * block
    return out


# ---------------------------------------------------------------------------------------------
# report


def kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def per_layer(records, name, key) -> tuple[float, float, list[float]]:
    """(max over ranks of the per-layer value, min over ranks, per rank) from the 2- and 4-layer runs."""
    by = {(r["layers"], r["rank"]): key(r) for r in records if r["layout"] == name}
    ranks = sorted({rk for _, rk in by})
    lo, hi = LAYERS
    vals = [(by[(hi, rk)] - by[(lo, rk)]) / (hi - lo) for rk in ranks]
    return max(vals), min(vals), vals


def layer_listing(records, name) -> list[tuple]:
    """Saved storages attributed to a middle layer (layers.2 of the 4-layer model) on rank 0."""
    rec = next(r for r in records if r["layout"] == name and r["layers"] == LAYERS[1] and r["rank"] == 0)
    rows = collections.OrderedDict()
    prefix = "model.layers.2"
    for module, shp, dtype, nbytes in rec["saved"]:
        if module == prefix or module.startswith(prefix + "."):
            key = (module[len(prefix) + 1:] or "(layer)", shp, dtype)
            n, tot = rows.get(key, (0, 0))
            rows[key] = (n + 1, tot + nbytes)
    return [(*k, n, tot) for k, (n, tot) in rows.items()]


def extras(p: dict, name: str, kind: str, t: int, sp: int) -> dict:
    """Elements per token (per rank, per layer) that seqpar_hf / DTensor save beyond `llama_terms`
    under Megatron's rules, each named (see the report's explanation)."""
    h = p["h"]
    out = {}
    if kind == "seqpar" and t > 1:  # the all-gathered inputs of q/k/v and gate/up, saved whole by the linears
        out["gathered block inputs"] = 2 * h * (1 / sp - 1 / (t * sp))
    if kind == "seqpar" and sp > 1 and name != "ring":  # Ulysses: kernel output (heads-sharded) and o_proj input
        out["attention output twice"] = h / (t * sp)
    return out


def report(records: list[dict], seq_len: int, command: str, environment: str) -> str:
    p = shape(seq_len)
    s, h = p["s"], p["h"]
    sbh = s * p["b"] * h
    unsharded, _, _ = per_layer(records, "unsharded", lambda r: r["saved_bytes"])
    out = ["# Parallel styles: activation and communication bytes per layer per rank\n",
           f"Produced by `{command}` ({environment}; written by `benchmarks/parallel_styles.py`). "
           f"Model: Llama, hidden h={h}, a={p['a']} heads, g={p['g']} kv heads (GQA), head dim d={p['d']}, "
           f"intermediate i={p['i']} (SwiGLU), vocab {MODEL['vocab_size']}, RMSNorm, rotary; fp32, SDPA, dropout 0; "
           f"batch b=1, sequence s={s}, no padding, labels = input_ids. World: {WORLD} gloo processes on CPU for "
           f"every layout (the unsharded reference runs on one of them). Per layer = (4-layer model - 2-layer "
           f"model) / 2, which cancels embedding, LM head, loss and per-forward checks. Values are the maximum over "
           f"the ranks (the ranks agree unless a range is shown). KiB = 1024 bytes; one [s, b, h] fp32 activation "
           f"N = s*b*h*4 = {kib(sbh * E)} KiB. Bytes are counted, not timed: they do not depend on the machine's speed "
           "or load.\n",
           "Layouts: `TP` = tensor parallelism alone from transformers' `base_model_tp_plan` with torch's "
           "`ColwiseParallel` / `RowwiseParallel` (norms replicated); `TP (f)` = the same plus `PrepareModuleInput` "
           "on `self_attn` and `mlp` (Megatron's f: one DTensor block input); `TP (HF auto)` = transformers' own "
           "`from_pretrained(..., tp_plan=\"auto\", tp_size=4)`, which works on CPU gloo; `TP+SP` = seqpar_hf "
           "`ParallelLayout(sp_size=1, tp_size=4)`; `Ulysses` = `sp_size=4`; `ring` = `sp_size=4, mode=\"ring\"`; "
           "`TP+SP x Ulysses` = `sp_size=2, tp_size=2`.\n"]

    # -- activations
    out.append("## 1. Activation bytes saved for backward, per layer per rank\n")
    rows, explained_rows = [], []
    for name, kind, _, t, sp in LAYOUTS:
        hi, lo, _ = per_layer(records, name, lambda r: r["saved_bytes"])
        seq_par = kind == "seqpar" and t > 1
        mega = megatron_activations(p, t, sp, seq_par)
        llama = llama_activations(p, t, sp, seq_par)
        extra = extras(p, name, kind, t, sp)
        explained = llama + sum(extra.values()) * s * p["b"] * E
        span = kib(hi) if abs(hi - lo) < 1 else f"{kib(lo)}-{kib(hi)}"
        rows.append([name, t, sp, span, kib(mega), f"{hi / mega:.2f}", kib(llama), f"{hi / llama:.2f}",
                     kib(explained), f"{hi / explained:.3f}", f"{hi / unsharded:.3f}", f"{1 / (t * sp):.3f}"])
        if extra:
            explained_rows.append([name] + [", ".join(f"{k}: +{kib(v * s * p['b'] * E)} KiB" for k, v in extra.items())])
    out.append(table(["layout", "t", "sp", "measured KiB", "Megatron fp32 KiB", "meas / Megatron",
                      "Llama-terms KiB", "meas / Llama-terms", "Llama-terms + named extras KiB", "meas / that",
                      "meas / unsharded", "ideal 1/(t sp)"], rows))
    terms = llama_terms(p)
    tot = sum(terms.values())
    out.append(f"""
Formulas (bytes per layer per rank, fp32, s*b*h = {sbh}):
- **Megatron fp32**: Korthikanti et al. give per layer, for fp16 activations (2-byte elements, 1-byte
  dropout masks), TP alone `sbh(10 + 24/t + 5as/(ht))` and TP+SP `sbh(34/t + 5as/(ht))` bytes
  (unsharded, t=1: `sbh(34 + 5as/h)`). Adaptation to this run: dropout 0 saves no masks, which removes the
  two 1-byte `sbh` masks (attention-output and MLP-output dropout) and the 1-byte `as^2b` softmax-dropout
  mask; the flash / SDPA kernel keeps neither the `2as^2b` softmax output nor the `2as^2b` dropout output
  (it keeps its output O, already counted as the output projection's input, and an fp32 logsumexp of
  `a*s*b` elements, {p['a'] / h:.1%} of `sbh` here, ignored); fp32 doubles every 2-byte term. So 34 -> 32 `sbh`
  2-byte units -> **64 sbh bytes** unsharded; TP alone `10 + 24/t` -> `8 + 24/t` (2 LN inputs, QKV input,
  MLP input replicated) -> **sbh(16 + 48/t)**; TP+SP **64 sbh / t**; Ulysses / ring (sequence sharded
  everywhere) **64 sbh / sp**; TP+SP x Ulysses **64 sbh / (t sp)**. This is a GPT layer: LayerNorm, GeLU MLP of
  width 4h, multi-head attention (k, v as wide as q).
- **Llama-terms**: Megatron's rules (what is replicated, what is divided) applied to what HF Llama's code
  saves, in fp32 elements per token: two RMSNorms {terms['norms']} = 2 x (2h + 1) (HF's RMSNorm is eager ops:
  `pow` keeps the input, `x * rsqrt` keeps x and rsqrt, `weight * .` keeps x*rsqrt); their outputs, the inputs of
  q/k/v and gate/up, {terms['norm outputs']} = 2h; attention {terms['attention']} = 2h + 2gd + a (rotated q,
  rotated k and v with g kv heads, the kernel output, the logsumexp; rotary itself keeps only cos/sin, shared by
  all layers); SwiGLU MLP {terms['mlp']} = 4i (gate output for SiLU, SiLU output and up output for the
  product, the product for down_proj). Total {tot} elements = {tot / h:.2f} h per token, against Megatron's
  64/4 = 16 h. TP alone keeps the norms and norm outputs whole and divides attention + MLP by t; TP+SP
  divides everything by t; sequence sharding divides everything by sp.
- **Llama-terms + named extras**: plus what this implementation saves beyond Megatron's rules (below).
""")
    out.append("### Gaps over 10%, explained\n")
    mlp_gpt = 8
    out.append(f"""*Measured vs Megatron fp32, unsharded ({unsharded / megatron_activations(p, 1, 1, False):.2f}x)*:
the measured bytes equal the Llama-terms to the byte, so the whole gap is the architecture. Per token, in
h fp32 elements (Megatron 16 = LN inputs 2 + QKV/MLP inputs 2 + q, k, v, O 4 + MLP 8):
- RMSNorm as HF writes it keeps input **and** input*rsqrt: 2 x 2h (+2 rsqrt) instead of 2 x h: **+{(terms['norms'] - 2 * h) / h:.2f} h**
  (listing: `input_layernorm` / `post_attention_layernorm`, two [s, h] storages each);
- SwiGLU with i = {p['i']}: 4i = {terms['mlp'] / h:.2f} h instead of GeLU's 2 x 4h = {mlp_gpt} h: **+{terms['mlp'] / h - mlp_gpt:.2f} h**
  (listing: `mlp.act_fn`, `mlp` x2, `mlp.down_proj`, all [s, i]);
- GQA: k and v have g = {p['g']} of {p['a']} heads: 2gd = {2 * p['g'] * p['d'] / h:.2f} h instead of 2h; the logsumexp adds
  a/h = {p['a'] / h:.3f}: **{(terms['attention'] - 4 * h) / h:+.2f} h** (listing: `self_attn` [b, g, s, d] x2 vs [b, a, s, d] x2 for
  rotated q and the output; SDPA runs with `enable_gqa`, no repeated k/v is stored; O is also o_proj's input, one storage);
- total {tot / h:.2f} h / 16 h = {tot / h / 16:.3f}.

*TP alone ({per_layer(records, 'TP', lambda r: r['saved_bytes'])[0] / megatron_activations(p, 4, 1, False):.2f}x Megatron)*: same architectural terms, with the replicated part larger:
Llama keeps 2 x (2h + 1) + 2h = {(terms['norms'] + terms['norm outputs']) / h:.2f} h whole on every rank (Megatron: 4h), and
divides {(terms['attention'] + terms['mlp']) / h:.2f} h by t (Megatron: 12h). Measured = Llama-terms exactly, for all three TP variants.

*TP+SP (seqpar_hf, {per_layer(records, 'TP+SP', lambda r: r['saved_bytes'])[0] / llama_activations(p, 4, 1, True):.2f}x Llama-terms)*: the norm regions are sharded as intended ([s/t, h]),
but `q_proj` and `gate_proj` save their **all-gathered** input, a replicated [s, h] DTensor on every TP rank
(listing: `self_attn.q_proj` and `mlp.gate_proj` [s, h] where everything else is /t). Megatron's SP saves the
[s/t, h] shard and repeats the all-gather in the backward (Korthikanti et al., sec. 4.2.2). Extra per layer per
rank: 2 x (1 - 1/t) x s*b*h*4 = {kib(2 * (1 - 1 / 4) * sbh * E)} KiB, i.e. 2h(1 - 1/t) = {2 * (1 - 1 / 4):.2f} h per token, {2 * (1 - 1 / 4) / (tot / h / 4):.0%} on top
of the ideal {tot / h / 4:.2f} h. With it, TP+SP saves {per_layer(records, 'TP+SP', lambda r: r['saved_bytes'])[0] / unsharded:.3f} of the unsharded layer, not 1/t = 0.250.

*Ulysses ({per_layer(records, 'Ulysses', lambda r: r['saved_bytes'])[0] / llama_activations(p, 1, 4, False):.2f}x Llama-terms, under 10%)*: everything is /sp except the attention
output, stored twice: once as the kernel's output [b, a/sp, s, d] before the all-to-all back, and once as
`o_proj`'s input [s/sp, h] (listing: the extra `self_attn.o_proj` row, absent from the unsharded listing, where
SDPA's output memory is already [b, s, a, d] and o_proj's input is a view of it). Extra: s*b*h*4/sp =
{kib(sbh * E / 4)} KiB per layer. The two tensors are different data (heads- vs sequence-sharded): inherent
to the method.

*ring ({per_layer(records, 'ring', lambda r: r['saved_bytes'])[0] / llama_activations(p, 1, 4, False):.2f}x Llama-terms)*: everything is /sp. `RingAttention` allocates its
output [b, s/sp, a, d]-contiguous and returns the [b, a, s/sp, d] view, so HF's transpose + reshape for
`o_proj` is a view of the storage the ring already saved (an earlier version allocated [b, a, s, d], and the
reshape copied it: +{kib(sbh * E / 4)} KiB per layer).

*TP+SP x Ulysses ({per_layer(records, 'TP+SP x Ulysses', lambda r: r['saved_bytes'])[0] / llama_activations(p, 2, 2, True):.2f}x Llama-terms)*: both effects: gathered block inputs [s/sp, h] instead of
[s/(sp t), h] (+2h(1/sp - 1/(t sp)) per token) and the attention output twice (+h/(t sp)).

Named extras per layout (the "Llama-terms + named extras" column; measured / that = 1.000 means every byte is
accounted for):
""")
    out.append(table(["layout", "extras per layer per rank"], explained_rows))

    # -- communication
    out.append("\n## 2. Communication bytes per layer per rank\n")
    rows, comm = [], {}
    for name, _, _, t, sp in LAYOUTS[1:]:
        f = comm_formula(name, p, t, sp)
        fs, _, _ = per_layer(records, name, lambda r: sum(v[0] for v in r["forward"].values()))
        fp, _, _ = per_layer(records, name, lambda r: sum(v[1] for v in r["forward"].values()))
        bs, _, _ = per_layer(records, name, lambda r: sum(v[0] for v in r["backward"].values()))
        comm[name] = (fs, bs)
        kinds = sorted({k for r in records if r["layout"] == name for ph in ("forward", "backward") for k in r[ph]})
        calls = []
        for ph in ("forward", "backward"):
            parts = []
            for k in kinds:
                c, _, _ = per_layer(records, name, lambda r, k=k, ph=ph: r[ph].get(k, [0, 0, 0])[2])
                if c:
                    parts.append(f"{c:g} {k}")
            calls.append(", ".join(parts) or "-")
        rows.append([name, t, sp, calls[0], kib(fp), kib(f["payload"]), kib(fs), kib(f["forward"]),
                     f"{fs / f['forward']:.3f}" if f["forward"] else "-", calls[1], kib(bs), kib(f["backward"]),
                     f"{bs / f['backward']:.3f}" if f["backward"] else "-"])
    out.append(table(["layout", "t", "sp", "fwd calls / layer", "fwd payload KiB", "payload formula KiB",
                      "fwd sent KiB", "sent formula KiB", "ratio", "bwd calls / layer", "bwd sent KiB",
                      "bwd formula KiB", "ratio"], rows))
    out.append(f"""
Formulas (per layer per rank, N = s*b*h*4 = {kib(sbh * E)} KiB; *sent* = bytes leaving the rank with ring
algorithms, *payload* = the paper's unit, the collective's full tensor):
- TP alone: forward 2 all-reduces of N (after o_proj and down_proj: Megatron's g): payload 2N, sent
  2 x 2(t-1)/t N. Backward: Megatron's f, one all-reduce of the block input's gradient per block (2), is what
  `TP (f)` does; the plan applied per linear (`TP`, and transformers' own `tp_plan="auto"`) all-reduces the input
  gradient of q, k, v, gate and up separately: **5 all-reduces, 2.5x the bytes**.
- TP+SP: per block an all-gather of the block input (payload N) and a reduce-scatter of its output (payload N):
  payload 4N, twice TP's, but sent 4 (t-1)/t N = exactly TP's two all-reduces (an all-reduce is a
  reduce-scatter plus an all-gather), as the paper says. Backward: the mirror, same bytes.
- Ulysses over u ranks: all-to-alls of q, k, v forward and of the output back, each leaving (u-1)/u of the local
  tensor: (u-1)/u * b d 4 (2 h_q + 2 max(h_kv, u)) s/sp (kv heads are replicated up to one per rank when
  fewer than u); backward the same. Under TP+SP x Ulysses the heads are the TP rank's share (h_q = a/t,
  h_kv = g/t) and the TP collectives move the SP-local sequence, N/sp.
- ring over r ranks: the stacked K/V block 2 b g (s/r) d 4 passed r-1 times forward; backward r-1 times plus
  the fp32 dK/dV accumulator r times (it travels a full turn home).

Every layout matches its formula exactly (ratio 1.000): nothing else is communicated per layer (the per-forward
input check, the loss reductions, the embedding and the LM head collectives cancel in the 4 - 2 layer difference).
Per layer, forward + backward, sent per rank: """ + ", ".join(f"{n} {kib(a + b)} KiB ({(a + b) / (sbh * E):.2f} N)" for n, (a, b) in comm.items()) + ".\n")

    # -- which one when
    mem = {n: per_layer(records, n, lambda r: r["saved_bytes"])[0] / unsharded for n, *_ in LAYOUTS}
    tot_comm = {n: (a + b) / (sbh * E) for n, (a, b) in comm.items()}
    out.append(f"""## 3. Which one when

From the numbers above (this model: a={p['a']} heads, g={p['g']} kv heads, h={h}, world 4; "activations" = measured
per-layer bytes per rank / unsharded; "comm" = forward + backward bytes sent per rank per layer in units of
N = s*b*h*4, i.e. per token of the *full* sequence):

| layout | activations / layer / rank | comm / layer / rank (fwd+bwd) | head constraint | shards weights | comm pattern | use when |
|---|---|---|---|---|---|---|
| TP alone (f) | {mem['TP (f)']:.2f} (norm regions, their outputs whole) | {tot_comm['TP (f)']:.2f} N (plan per linear: {tot_comm['TP']:.2f} N) | t divides kv heads | yes, 1/t | 4 all-reduces, blocking, ∝ s·h whatever t | the model's weights do not fit one device and sequences are short; fast intra-node links only. Prefer TP+SP: same bytes, less memory |
| TP+SP (seqpar_hf tp_size) | {mem['TP+SP']:.2f} (ideal 0.25; gathered block inputs kept whole) | {tot_comm['TP+SP']:.2f} N | t divides kv heads | yes, 1/t | 4 all-gathers + 4 reduce-scatters, blocking, ∝ s·h whatever t | weights need sharding within a node (NVLink); {tot_comm['TP+SP'] / tot_comm['Ulysses']:.1f}× Ulysses' bytes here |
| Ulysses (sp) | {mem['Ulysses']:.2f} (ideal 0.25; attention output twice) | {tot_comm['Ulysses']:.2f} N | sp ≤ query heads (kv heads replicated when fewer) | no (add FSDP) | 8 all-to-alls, ∝ s·h/sp: shrinks as sp grows | long sequences, heads ≥ sp, good all-to-all bandwidth (intra-node, or inter-node with fast fabric): least bytes of all |
| ring (sp) | {mem['ring']:.2f} (ideal 0.25) | {tot_comm['ring']:.2f} N | none | no (add FSDP) | p2p to neighbours, K/V only (GQA makes it smaller), overlappable with the block compute | sp larger than the head count, slow or inter-node links (overlap hides it when s/sp is long enough), few kv heads |
| TP+SP x Ulysses (t=2, sp=2) | {mem['TP+SP x Ulysses']:.2f} | {tot_comm['TP+SP x Ulysses']:.2f} N | a/t ≥ u, t divides g | yes, 1/t | TP inside a node, all-to-all over the sp group | weights need TP *and* sequences are too long for TP alone: TP over the fastest links, Ulysses (or ring, hybrid) across |

Rules of thumb from this data: at equal world size all layouts that shard the sequence everywhere (TP+SP, Ulysses,
ring, the hybrid) land within {min(mem[n] for n in ('TP+SP', 'Ulysses', 'ring', 'TP+SP x Ulysses')):.2f}-{max(mem[n] for n in ('TP+SP', 'Ulysses', 'ring', 'TP+SP x Ulysses')):.2f} of the unsharded activations, while TP alone keeps
{mem['TP (f)']:.2f}; the difference is bandwidth: TP's collectives carry the whole [s, h] activation per block
({tot_comm['TP+SP']:.2f} N per layer at t=4: 8 (t-1)/t N, growing toward 8 N with t), Ulysses carries q, k, v, o once
({tot_comm['Ulysses']:.2f} N, falling as 1/sp), ring only K/V forward and K/V + dK/dV backward ({tot_comm['ring']:.2f} N, constant in
sp, hidden behind compute when the blocks are big). TP is the only one that divides the weights and the
matmul work per token; the sequence-parallel styles need FSDP/ZeRO for the weights.
""")
    out.append(appendix(records, p))
    return "\n".join(out) + "\n"


def appendix(records, p) -> str:
    lines = ["## Appendix: saved tensors of one layer (layers.2 of the 4-layer model, rank 0)\n",
             "Each distinct storage once, attributed to the innermost module running when it was first saved "
             "(`self_attn` alone = code inside the attention module outside its linears: rotary, the SDPA / "
             "ring kernel, the Ulysses all-to-alls). The previous layer's output is saved by this layer's "
             "`input_layernorm`. Shapes are local to the rank; the linears save their input flattened to 2-D.\n"]
    for name, *_ in LAYOUTS:
        if name == "TP (f)":
            continue
        listing = layer_listing(records, name)
        total = sum(r[4] for r in listing)
        lines.append(f"\n**{name}** ({kib(total)} KiB in this layer)\n")
        lines.append(table(["module", "shape", "dtype", "storages", "KiB"],
                           [[m, "x".join(map(str, s)), dt, n, kib(b)] for m, s, dt, n, b in listing]))
    losses = {(r["layout"], r["layers"]): r["loss"] for r in records if r["rank"] == 0}
    ref = {layers: losses[("unsharded", layers)] for layers in LAYERS}
    worst = max(abs(v - ref[k[1]]) for k, v in losses.items())
    lines.append(f"\nSanity: every layout's loss equals the unsharded model's (same weights, same batch) within "
                 f"{worst:.1e} (unsharded: {', '.join(f'{ref[k]:.6f} ({k} layers)' for k in LAYERS)}).\n")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="128 tokens; print, write nothing")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_len = 128
    from tests.helpers.spawn import spawn

    import transformers
    with tempfile.TemporaryDirectory() as tmp:  # the same weights, as checkpoints for transformers' own TP
        checkpoints = {}
        for layers in LAYERS:
            checkpoints[layers] = f"{tmp}/llama{layers}"
            build(layers, args.seq_len).save_pretrained(checkpoints[layers])
        records = spawn(_worker, WORLD, args.seq_len, checkpoints, timeout=900)[0]
    command = "python benchmarks/parallel_styles.py" + ("" if args.seq_len == 1024 else f" --seq-len {args.seq_len}")
    env = (f"torch {torch.__version__}, transformers {transformers.__version__}, {os.cpu_count()} CPU cores, "
           f"{WORLD} processes x 1 torch thread")
    text = report(records, args.seq_len, command, env)
    print(text)
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
