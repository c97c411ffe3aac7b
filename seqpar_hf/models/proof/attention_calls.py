"""What each attention call of the dry run passes, and the site it makes (patch time).

Every module that calls the attention function in the dry run (models/proof/probe.py) becomes a site with
its sides (which sequence its queries and keys come from: read off their lengths, never off
`module.is_causal`) and its pattern, decided as the unpatched model decides it: SDPA, eager and flex
attention follow the mask the layer is given (its mask function, read exactly, any window size); flash
attention follows `is_causal` and `sliding_window`. Keywords the sharded attention does not honour
(models/forward/sites.py) are refused by name. Calls whose queries do not run along the sequence
(attention over a token's own layers) are token-local: they run the original implementation as they are.
"""

from __future__ import annotations

import torch

from ...attention.mask_patterns import describe, read_tensor
from ..forward.sites import keyword_why, unsupported
from .probe_checks import Refusal


def _flash(original: str | None) -> bool:
    return original is not None and "flash" in original


def _flag(call: dict) -> bool:
    """The causal flag SDPA reads when it gets no mask: the call's is_causal, else the module's, else True."""
    causal = call["kwargs"].get("is_causal")
    causal = call["is_causal_attr"] if causal is None else causal
    return bool(True if causal is None else causal)


def call_pattern(call: dict, original: str | None, valid: dict) -> tuple | None:
    """(causal, window) this call computes in the unpatched model, or None for an unsupported pattern.
    `valid`: side -> [b, s] real tokens of the dry run's batch."""
    kw = call["kwargs"]
    if _flash(original):
        causal = kw.get("is_causal")
        causal = call["is_causal_attr"] if causal is None else causal
        window = kw.get("sliding_window")
        return bool(True if causal is None else causal), (int(window) if window is not None and window > 0 else None)
    if call["given"]:  # a mask made through the mask interface: its function's pattern, read exactly
        pattern = call["pattern"]
        if pattern is not None and original in ("sdpa", None) and pattern[0] != _flag(call):
            # SDPA drops a mask it can replace by its own flag (no padding), and the flag says otherwise
            raise Refusal(
                call["module"],
                f"says is_causal={_flag(call)} but is given a {describe(pattern)} mask: "
                "the unpatched model (SDPA) attends by the mask when the batch has padding and by the flag "
                "when it has none",
                "Make the module's is_causal agree with its mask (or load the model with attn_implementation='eager')",
            )
        return pattern
    mask = call["mask"]
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:  # a mask the model built itself: read the tensor
        rows, keys = valid[call["q_side"]], valid[call["kv_side"]]
        return read_tensor(mask.cpu(), keys.cpu(), rows.cpu())
    if original == "sdpa" or original is None:  # no mask: SDPA's own rule
        return _flag(call) and call["q"][2] > 1, None
    return False, None  # eager without a mask attends to every key


def site_records(calls: list[dict], original: str | None, valid: dict, biases: dict | None = None) -> dict:
    """module path -> (q_side, kv_side, pattern, heads, kv_heads) for sequence sites, or "local" for
    token-local calls; Refusal for what the sharded attention cannot reproduce. `biases`: the modules whose
    `position_bias=` is proven (proof/relative_bias.py)."""
    biases = biases or {}
    by_module: dict[str, list[dict]] = {}
    for call in calls:
        by_module.setdefault(call["module"], []).append(call)
    out: dict[str, str | tuple] = {}
    for name, group in by_module.items():
        local = [c["q_side"] is None for c in group]
        if all(local):
            out[name] = "local"
            continue
        if any(local):
            raise Refusal(name, "calls the attention function both along the sequence and across something else")
        bad = sorted(
            {k for c in group for k in unsupported(c["kwargs"]) if not (k == "position_bias" and name in biases)}
        )
        if bad:
            raise Refusal(name, keyword_why(bad))
        if any(c["kv_side"] is None for c in group):
            raise Refusal(
                name,
                f"attends to keys that are not a sequence of the model (length {group[0]['k'][2]}: "
                "extra memory or sink tokens?)",
            )
        records = {(c["q_side"], c["kv_side"], call_pattern(c, original, valid), c["q"][1], c["k"][1]) for c in group}
        if len(records) > 1:
            raise Refusal(name, "is called with different attention patterns or sides in one forward")
        q_side, kv_side, pattern, heads, kv_heads = records.pop()
        if pattern is None:
            raise Refusal(
                name,
                f"is given {describe(None)} (e.g. blockwise, prefix or input-dependent masks)",
                "Use a model whose attention is causal, bidirectional, a sliding window or chunked",
            )
        if q_side != kv_side and pattern != (False, None):
            raise Refusal(
                name, f"cross-attends with a {describe(pattern)} pattern; cross-attention is sharded bidirectional only"
            )
        out[name] = (q_side, kv_side, pattern, heads, kv_heads)
    return out
