"""Bytes per transformer layer per rank predicted for a Llama layer under each parallel style, fp32,
batch b, s tokens: activations saved for backward (Megatron-LM's formulas, Korthikanti et al. 2022,
arXiv 2205.05198, and the same rules applied to what HF Llama saves) and bytes communicated. The
derivations are in benchmarks/README.md (parallel_styles.py); `p` is the shape dict of
`parallel_styles.shape` (s, b, h hidden, a heads, g kv heads, d head dim, i intermediate).
"""

from __future__ import annotations

E = 4  # bytes per fp32 element


def megatron_activations(p: dict, t: int, sp: int, sequence_parallel: bool) -> float:
    """Korthikanti et al. in fp32, no dropout, flash attention: TP alone sbh (16 + 48/t), else 64 sbh / t."""
    sbh = p["s"] * p["b"] * p["h"]
    if t > 1 and not sequence_parallel:
        return sbh * (16 + 48 / t) / sp
    return 64 * sbh / (t * sp)


def llama_terms(p: dict) -> dict:
    """fp32 elements per token that HF Llama's training forward saves per layer, by part."""
    h, g, d, a, i = p["h"], p["g"], p["d"], p["a"], p["i"]
    return {"norms": 4 * h + 2, "norm outputs": 2 * h, "attention": 2 * h + 2 * g * d + a, "mlp": 4 * i}


def llama_activations(p: dict, t: int, sp: int, sequence_parallel: bool) -> float:
    """Megatron's rules on `llama_terms`: TP alone keeps norms and their outputs whole, TP+SP divides
    everything by t, sequence sharding divides everything by sp."""
    terms = llama_terms(p)
    if t > 1 and not sequence_parallel:
        per_token = terms["norms"] + terms["norm outputs"] + (terms["attention"] + terms["mlp"]) / t
    else:
        per_token = sum(terms.values()) / t
    return p["s"] * p["b"] * per_token / sp * E


def extras(p: dict, name: str, kind: str, t: int, sp: int) -> dict:
    """Bytes per layer per rank that seqpar_hf saves beyond `llama_activations`, each named. (The
    gathered TP block inputs are saved as this rank's slice and gathered again in the backward.)"""
    tokens, h, out = p["s"] * p["b"] * E, p["h"], {}
    if kind == "seqpar" and sp > 1 and name != "ring":  # Ulysses: kernel output (heads-sharded) and o_proj input
        out["attention output twice"] = h / (t * sp) * tokens
    return out


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
        out["forward"] = 4 * (t - 1) / t * n_tok
        # backward: their mirrors, and the block input gathered again (it was saved as the slice)
        out["backward"] = 6 * (t - 1) / t * n_tok
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
