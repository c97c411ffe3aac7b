"""One class x layout x variant of the sweep, run on every rank of the group (2 processes; 4 for the
hybrid layout): the unpatched model (a deep copy, in the same process) against the patched one, on the
variant's batch (variants.py: padded, packed, generate).

Statuses (the parent combines the ranks' records, see zoo.py):
  EXACT        loss, every gradient and the eval logits (generate: every token and every step's scores)
               within TOLERANCE (relative)
  WRONG        it ran, some number is off (worst errors and parameter recorded)
  REFUSED      patch_model raised, or the patched model refused the batch or the generate call with a
               ValueError / NotImplementedError of seqpar_hf's (the message recorded)
  CRASHED      anything else raised after patch_model accepted the model
  NOT-RUNNABLE the unpatched model itself fails on the batch (not seqpar_hf's failure)
  UNBUILDABLE / NOT-A-TEXT-LM  no tiny text LM of this class (the reason recorded)
"""

from __future__ import annotations

import copy
import os
import time
import traceback

import torch
import torch.distributed as dist

from seqpar_hf.models.mixers.sequence import KeepFloat64

from .images import IMAGE_VARIANTS, NoImages, tiny_vlm
from .numerics import TOLERANCE, relative_error
from .released import describe
from .tiny import Unbuildable, build_tiny, is_seq2seq
from .variants import VARIANTS


def where(exc: BaseException) -> str:
    """The innermost frame, and the innermost seqpar_hf frame if another one is innermost."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    fmt = lambda f: f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
    out = fmt(frames[-1])
    ours = [f for f in frames if "seqpar_hf" in f.filename]
    if ours and ours[-1] is not frames[-1]:
        out += f" (seqpar_hf: {fmt(ours[-1])})"
    return out


def refused(exc: BaseException) -> bool:
    """A refusal that says why: a ValueError / NotImplementedError raised by seqpar_hf itself (not one
    passing through it from transformers or torch)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return (
        isinstance(exc, (ValueError, NotImplementedError))
        and bool(frames)
        and "seqpar_hf" in frames[-1].filename
        and "found no attention modules" not in str(exc)
    )


def first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


ROUNDING_LIMIT = 1e-3  # WRONG rows below it are re-run in float64 (the ring's math path takes float64)
_BUILT: dict = {}  # the last class built in this process: the variants of one class reuse it


def _build(model_type: str, class_name: str, images: bool = False):
    """(model, info) of a fresh copy of the tiny model (built once per class and process), or raises.
    `images`: with its two-block vision tower (images.py)."""
    key = (model_type, class_name, images)
    if key not in _BUILT:
        _BUILT.clear()
        try:
            if images:
                from .overrides import UNBUILDABLE
                from .tiny import base_type

                if base_type(model_type) in UNBUILDABLE:
                    status, reason = UNBUILDABLE[base_type(model_type)]
                    raise Unbuildable(reason, status)
                model = tiny_vlm(model_type, class_name)
                attn = model.config.get_text_config()._attn_implementation
                _BUILT[key] = (model, {"attn": attn, "params": sum(p.numel() for p in model.parameters())})
            else:
                _BUILT[key] = build_tiny(model_type, class_name)
        except Exception as exc:  # noqa: BLE001 - raised again for every variant
            _BUILT[key] = exc
    built = _BUILT[key]
    if isinstance(built, Exception):
        raise built
    return copy.deepcopy(built[0]), built[1]


def _float64_errors(model_type: str, class_name: str, variant, batch: dict, layout) -> dict:
    """The same comparison in float64: fp32 rounding shrinks by ~1e9 there, a real error does not."""
    # `.float()` / `.to(torch.float32)` kept float64: models that compute parts in fp32 whatever their dtype (the
    # gated DeltaNet's kernel, its decay) would keep fp32 rounding there, which a sum over tokens magnifies
    with KeepFloat64(every=True):
        return _float64_run(model_type, class_name, variant, batch, layout)


def _float64_run(model_type: str, class_name: str, variant, batch: dict, layout) -> dict:
    import seqpar_hf

    model, _ = _build(model_type, class_name, variant.name.startswith("images"))
    try:  # grouped matrix products (the default experts of MoE models) take no float64
        model.set_experts_implementation("eager")
    except (AttributeError, ValueError):
        pass
    model = variant.prepare(model).double()
    ref, batch = variant.reference(copy.deepcopy(model), batch)
    seqpar_hf.patch_model(model, layout)
    return variant.patched(model, ref, batch, layout)


def _errors_text(errors: dict) -> str:
    return " ".join(f"{k[:-4]}={v:.1e}" for k, v in errors.items())


def run_case(model_type: str, class_name: str, layout_name: str, variant_name: str, layouts: dict) -> dict:
    """One class x layout x variant on this rank; never raises."""
    import seqpar_hf

    start = time.time()
    variant = {**VARIANTS, **IMAGE_VARIANTS}.get(variant_name)  # None: a class known not to build ("-")
    images = variant_name.startswith("images")
    rec = {
        "model_type": model_type,
        "class": class_name,
        "layout": layout_name,
        "variant": variant_name,
        "rank": dist.get_rank(),
    }

    def done(status, **kw):
        rec.update(status=status, seconds=round(time.time() - start, 2), **kw)
        return rec

    try:
        model, info = _build(model_type, class_name, images)
    except Unbuildable as exc:
        return done(exc.status, reason=str(exc))
    except NoImages as exc:
        return done("NOT-RUNNABLE", reason=f"no synthetic images: {exc}")
    except Exception as exc:  # noqa: BLE001
        return done("UNBUILDABLE", reason=f"build failed: {first_line(exc)}", where=where(exc))
    rec.update(
        attn=info["attn"],
        params=info["params"],
        kind="seq2seq" if is_seq2seq(model) else "causal",
        shape=describe(model.config),
    )
    if variant is None:
        return done("CRASHED", reason=f"no variant {variant_name!r} for a class that builds")
    model = variant.prepare(model)
    reference = copy.deepcopy(model)
    try:
        ref, batch = variant.reference(reference, variant.inputs(model, info))
    except NoImages as exc:
        return done("NOT-RUNNABLE", reason=f"no synthetic images: {exc}")
    except Exception as exc:  # noqa: BLE001
        return done(
            "NOT-RUNNABLE", reason=f"the unpatched model fails on the batch: {first_line(exc)}", where=where(exc)
        )
    layout = layouts[layout_name]
    try:
        seqpar_hf.patch_model(model, layout)
    except Exception as exc:  # noqa: BLE001
        # a refusal says why: a ValueError / NotImplementedError naming the structure; anything else
        # (an AttributeError inside patch_model, "found no attention modules") is an unclear one
        clear = isinstance(exc, (ValueError, NotImplementedError)) and "found no attention modules" not in str(exc)
        return done("REFUSED", reason=first_line(exc), where=where(exc), refusal="clear" if clear else "unclear")
    names = variant.errors
    try:
        rec.update(variant.patched(model, ref, batch, layout))
        # the same decision on every rank (each rank compared its own numbers with its own reference)
        worst = torch.tensor([rec[k] for k in names], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        rec.update(zip(names, worst.tolist()))
    except Exception as exc:  # noqa: BLE001
        if refused(exc):  # the batch or the call refused before any collective, naming why
            return done("REFUSED", reason=first_line(exc), where=where(exc), refusal="clear", at="forward")
        return done("CRASHED", reason=first_line(exc), where=where(exc))
    errors = {k: rec[k] for k in names}
    if all(e <= TOLERANCE for e in errors.values()):
        return done("EXACT")
    worst = max(errors, key=errors.get)
    reason = f"worst {worst} {errors[worst]:.2e}" + (f" at {rec['worst_param']}" if worst == "grad_err" else "")
    # near misses (generate: any token difference, a near tie parts them) are re-run in float64
    if max(errors.values()) < ROUNDING_LIMIT or variant_name.endswith("generate"):
        try:
            f64 = _float64_errors(model_type, class_name, variant, variant.inputs(model, info), layout)
        except Exception as exc:  # noqa: BLE001
            return done(
                "CRASHED", reason=f"float64 re-run of a near miss ({reason}): {first_line(exc)}", where=where(exc)
            )
        rec["float64"] = {k: f64[k] for k in names}
        if all(v <= TOLERANCE / 10 for v in rec["float64"].values()):
            return done("EXACT", reason=f"fp32 rounding: {reason}; in float64 {_errors_text(rec['float64'])}")
        reason += f"; in float64 {_errors_text(rec['float64'])}"
    if not variant_name.endswith("generate"):  # a reference that is not deterministic would make any comparison WRONG
        again, _ = variant.reference(copy.deepcopy(reference), batch)
        drift = relative_error(again["loss"].reshape(()), ref["loss"].reshape(()))
        if drift > TOLERANCE:
            reason += f" (the unpatched model itself is not deterministic: loss drift {drift:.1e})"
    return done("WRONG", reason=reason)
