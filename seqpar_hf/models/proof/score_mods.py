"""Soft-capping and sinks, proven per attention module at patch time: the module's own attention function
(the implementation the model runs unpatched) is called on a few random tokens with the keywords the dry
run saw (`softcap=`, `s_aux=` / `sinks=`), and must give what the sharded kernels compute with them
(`attention/scores.py`). A keyword the implementation reads otherwise (or ignores: SDPA drops sinks) is
refused by name, so a sink or a cap is honoured only where its meaning is shown, never by its name.
"""

from __future__ import annotations

import torch

from ... import _compat
from ...attention.scores import ScoreMods, reference
from .probe_checks import Refusal, tolerance

_TOKENS = 5


def _run(function, module, mods: ScoreMods, call: dict, dtype, device, scale: float):
    gen = torch.Generator().manual_seed(0)
    (_, h, _, d), h_kv, d_v = call["q"], call["k"][1], call["v"][3]
    q, k, v = (
        torch.randn(1, m, _TOKENS, w, generator=gen).to(device=device, dtype=dtype)
        for m, w in ((h, d), (h_kv, d), (h_kv, d_v))
    )
    allowed = torch.ones(_TOKENS, _TOKENS, dtype=torch.bool, device=device).tril()[None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    kwargs = {key: call["kwargs"][key] for key in ("softcap", "s_aux", "sinks") if key in call["kwargs"]}
    with torch.no_grad():
        got = function(module, q, k, v, mask, dropout=0.0, scaling=scale, is_causal=True, **kwargs)[0]  # [1, s, h, d_v]
        index = torch.arange(h, device=device) * h_kv // h  # each query head's kv head
        want = reference(q, k.index_select(1, index), v.index_select(1, index), allowed, scale, mods)
    return got.transpose(1, 2).double(), want.double()


def check(pretrained, calls: list[dict], original: str | None) -> None:
    """Raise a Refusal for the first module whose soft-capping or sinks its own attention function does not
    compute as `attention/scores.py` does."""
    seen: set[str] = set()
    for call in calls:
        mods = ScoreMods.of(call["kwargs"])
        if call["q_side"] is None or not mods.active or call["module"] in seen:
            continue
        seen.add(call["module"])
        module = pretrained.get_submodule(call["module"])
        what = "; ".join(
            f"{k}={'<' + str(tuple(call['kwargs'][k].shape)) + ' tensor>' if k != 'softcap' else call['kwargs'][k]}"
            for k in ("softcap", "s_aux", "sinks")
            if call["kwargs"].get(k) is not None
        )
        scale = call["kwargs"].get("scaling") or call["q"][3] ** -0.5
        device = mods.sinks.device if mods.sinks is not None else next(pretrained.parameters()).device
        function = _compat.original_attention_function(module, original or "sdpa")
        why = None
        for dtype in (torch.float32, torch.bfloat16):  # flash kernels take half precision only
            try:
                got, want = _run(function, module, mods, call, dtype, device, float(scale))
            except Exception as exc:  # noqa: BLE001 - the implementation refuses the keyword, or the dtype
                why = f"raises {type(exc).__name__}: {str(exc)[:200]}"
                continue
            close = bool((got - want).abs().max() <= tolerance(dtype) * want.abs().max().clamp(min=1.0))
            why = None if close else "computes something else with them"
            break
        if why is not None:
            raise Refusal(
                call["module"],
                f"passes {what} to its attention function ({original or 'sdpa'}), which {why}; the sharded "
                "kernels honour soft-capping as softcap * tanh(score / softcap) before the mask and sinks as "
                "one logit per head in every row's softmax denominator",
                "Load the model with attn_implementation='eager'",
            )
