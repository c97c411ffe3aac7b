"""What the dry run's records prove (models/proof/probe.py): which module computes on a shard something other
than what it computes on the same tokens of the full sequence, and how to say why in a refusal; the loss
convention and the LM head's post-processing (for the tiled loss) the model's own outputs show."""

from __future__ import annotations

import torch
from torch import nn

from ..forward.head import Post, TiledHead
from .signatures import error

_IGNORED_INPUTS = ("cache_position",)  # local 0..s/sp-1 on a shard by design; no module takes positions from it
FIX = "Train it without sequence parallelism (sp_size=1, tp_size=1)"


class Refusal(ValueError):
    """A patch-time refusal: `where` (a module path, "" for the model) and why; `message` adds the names."""

    def __init__(self, where: str, why: str, fix: str = ""):
        super().__init__(why)
        self.where, self.why, self.fix = where, why, fix or FIX

    def message(self, model: nn.Module) -> str:
        name = type(model).__name__
        try:
            module = model.get_submodule(self.where) if self.where else model
        except AttributeError:
            module = None
        what = (
            f"{self.where} ({type(module).__name__})"
            if self.where and module is not None
            else (self.where or "its forward")
        )
        return f"seqpar_hf cannot shard {name}: {what} {self.why}. {self.fix}"


def tolerance(dtype: torch.dtype) -> float:
    """Relative difference above which a module's output on a shard is not the full run's: rounding of the
    same computation on a shorter sequence (other kernel blockings) stays far below it; a token that
    misses its neighbours is off by O(1)."""
    return {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}.get(dtype, 1e-5)


def _differs(full: dict, shard: dict, keep: dict, tol: float, skip=()) -> bool:
    for path, a in full.items():
        b = shard.get(path)
        if b is None or a.side != b.side or a.side not in keep or any(s in path for s in skip):
            continue
        full_idx, local_idx = keep[a.side]
        e = error(a, full_idx, b, local_idx)
        if e is not None and e > tol:
            return True
    return False


def culprits(full_calls: dict, shard_calls: dict, keep: dict, tol: float) -> list[tuple[str, set]]:
    """[(module name, the modules proven to agree)] of the innermost modules whose outputs on the shard
    differ from the full run's at the same tokens while their inputs agree. Modules called a different
    number of times (experts that got other tokens) are judged through the module around them."""
    found, clean = {}, set()
    for name, calls in shard_calls.items():
        ref = full_calls.get(name)
        if ref is None or len(ref) != len(calls):
            continue
        agree = True
        for a, b in zip(ref, calls):
            if "out" not in a or "out" not in b:
                agree = False
                continue
            out_differs = _differs(a["out"], b["out"], keep, tol)
            agree = agree and not out_differs and bool(a["out"])
            if out_differs and not _differs(a["in"], b["in"], keep, tol, _IGNORED_INPUTS):
                found[name] = "mixes"
        if agree:
            clean.add(name)
    inner = [n for n in found if not any(o != n and (o.startswith(n + ".") if n else True) for o in found)]
    return sorted(((n, clean) for n in inner), key=lambda t: (t[0].count("."), t[0]))


def describe_culprit(module: nn.Module, clean: set, ops: dict, name: str) -> str:
    """Why this module cannot be sharded, from the operations it, or what it runs and was not proven to
    agree (`clean`), was seen calling."""
    seen = set()
    for key, value in ops.items():
        if key == name or ((key.startswith(name + ".") if name else True) and key not in clean):
            seen |= value
    convs = any(isinstance(m, nn.Conv1d) for m in module.modules())
    if "softmax" in seen:
        what = "computes attention itself (a softmax over the sequence), not through transformers' AttentionInterface"
    elif "convolution" in seen or convs:
        what = "runs a convolution along the sequence"
    elif "scan" in seen:
        what = (
            "runs a scan along the sequence (cumulative sums or products: a state-space or linear-attention "
            "recurrence, or positions counted over the sequence)"
        )
    elif "selection" in seen:
        what = (
            "selects among the tokens of the whole sequence (top-k / sorting over it, e.g. a sparse-attention indexer)"
        )
    elif seen & {"scan-tokens", "selection-tokens", "softmax-tokens"}:
        what = "decides for each token from the batch's other tokens (e.g. expert capacity counted over the tokens)"
    else:
        what = (
            "mixes information along the sequence outside attention (a recurrence, a selection over the whole "
            "sequence, or positions made from it)"
        )
    return f"{what}; under sequence parallelism it would see only this rank's shard of the sequence"


def loss_convention(model: nn.Module, labels: torch.Tensor | None, out) -> str | None:
    """How the model's own loss reads its labels, from the dry run's forward with labels: "shift" (position
    t predicts label t+1, causal LMs), "same" (label t: encoder-decoder targets), "other" (neither is the
    model's loss, e.g. extra terms); None when the forward took no labels. A load-balancing term the model
    adds (its aux_loss) counts, as the patched loss adds it too."""
    loss, logits = getattr(out, "loss", None), getattr(out, "logits", None)
    if labels is None or loss is None or logits is None or logits.shape[:2] != labels.shape[:2]:
        return None
    flat = lambda x: x.reshape(-1, x.shape[-1]).float()
    shift = torch.nn.functional.cross_entropy(flat(logits[:, :-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    same = torch.nn.functional.cross_entropy(flat(logits), labels.reshape(-1), ignore_index=-100)
    aux = getattr(out, "aux_loss", None)
    if aux is not None:
        coef = getattr(model, "router_aux_loss_coef", None)
        coef = getattr(model.config, "router_aux_loss_coef", 0.0) if coef is None else coef
        shift, same = shift + coef * aux.float(), same + coef * aux.float()
    tol = max(tolerance(logits.dtype), 1e-6)
    scale = max(abs(loss.float().item()), 1e-12)
    errors = {
        name: abs(value.item() - loss.float().item()) / scale for name, value in (("shift", shift), ("same", same))
    }
    best = min(errors, key=errors.__getitem__)
    if errors[best] > tol:
        return "other"
    other = errors["same" if best == "shift" else "shift"]
    return best if other > 10 * errors[best] else None  # both within rounding: the batch cannot tell


CANDIDATES = tuple(
    Post(bias=b, scale=s, scaling=c, softcap=f)
    for c in ("divide", "multiply", None)
    for b in (True, False)
    for s in (True, False)
    for f in (True, False)
)


def post_processing(model, hidden: torch.Tensor, logits: torch.Tensor) -> Post | None:
    """The post-processing (models/forward/head.py) that turns the head's output on `hidden` into the
    model's own `logits` (from the dry run), or None when no candidate does (the model is then not tiled)."""
    module = model.get_output_embeddings()
    if module is None or getattr(module, "weight", None) is None:
        return None
    with torch.no_grad():
        for post in CANDIDATES:
            try:
                got = TiledHead(model, module, 1, post).logits(hidden)
            except Exception:  # noqa: BLE001 - a candidate that does not apply
                continue
            if got.shape == logits.shape:
                scale = logits.double().abs().max().clamp(min=1e-30)
                if ((got.double() - logits.double()).abs().max() / scale).item() <= tolerance(logits.dtype):
                    return post
    return None
