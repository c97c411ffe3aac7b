"""One class x layout of the sweep, run on every rank of a 2-process gloo group: the unpatched model
(a deep copy, in the same process) against the patched one, loss, every gradient and eval logits.

Statuses (the parent combines the ranks' records, see zoo.py):
  EXACT        loss, every gradient and the eval logits within TOLERANCE (relative)
  WRONG        it ran, some number is off (worst errors and parameter recorded)
  REFUSED      patch_model raised (the message recorded)
  CRASHED      it raised after patch_model accepted the model
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

from .batches import causal_batch, decoder_inputs, pad_id, seq2seq_batch
from .tiny import Unbuildable, build_tiny, is_seq2seq

TOLERANCE = 1e-5  # fp32: the suite's parity tolerance
ZERO_GRAD_FLOOR = 1e-4  # analytically zero gradients are compared against 1e-4 of the whole gradient (tests/parity.py)


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """||actual - expected|| / max(||expected||, floor)."""
    if actual.shape != expected.shape:
        return float("inf")
    denom = max(expected.double().norm().item(), floor)
    diff = (actual.double() - expected.double()).norm().item()
    return diff / denom if denom > 0 else diff


def where(exc: BaseException) -> str:
    """The innermost frame, and the innermost seqpar_hf frame if another one is innermost."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    fmt = lambda f: f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"  # noqa: E731
    out = fmt(frames[-1])
    ours = [f for f in frames if "seqpar_hf" in f.filename]
    if ours and ours[-1] is not frames[-1]:
        out += f" (seqpar_hf: {fmt(ours[-1])})"
    return out


def first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:400]


def full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def make_batch(model, info: dict) -> dict:
    """The training batch: seq2seq (source 13, target 9) or causal (length 13; left padding on one row
    unless the model attends with eager, whose fully masked query rows differ from SDPA's)."""
    pad = pad_id(model)
    if is_seq2seq(model):
        return seq2seq_batch(pad)
    batch = causal_batch(pad, left_pad=info["attn"] == "sdpa")
    if info.get("labels") == "codebooks":  # audio-code LMs: labels [batch, length, codebooks]
        batch["labels"] = batch["labels"].unsqueeze(-1)
    return batch


def eval_inputs(model, batch: dict) -> dict:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if is_seq2seq(model) and "decoder_input_ids" not in inputs:
        inputs["decoder_input_ids"] = decoder_inputs(model, batch["labels"])
    return inputs


def reference_run(model, batch: dict) -> dict:
    """Loss, gradients (name -> tensor) and eval logits of the unpatched model; raises if it cannot run."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        logits = model(**eval_inputs(model, batch)).logits
    return {"loss": loss.detach(), "grads": grads, "logits": logits}


def _reference(model, batch: dict) -> tuple[dict, dict]:
    """The reference numbers and the batch they were computed on. A seq2seq model that does not build
    its decoder inputs from labels (FSMT) gets them in the batch."""
    try:
        return reference_run(model, batch), batch
    except Exception:
        if not is_seq2seq(model):
            raise
        batch = {**batch, "decoder_input_ids": decoder_inputs(model, batch["labels"])}
        return reference_run(model, batch), batch


def _average_gradients(model, layout) -> None:
    """What DDP over the world does (here: the dp x sp ranks holding the same weights), in one
    collective; parameters without a gradient count as zero on that rank."""
    n = layout.dp_size * layout.sp_size
    if n == 1:
        return
    group = layout.dp_sp_group
    from torch.distributed.tensor import DTensor
    params = [p for p in model.parameters() if p.requires_grad]
    locals_ = []
    for p in params:
        g = p.grad
        g = g.to_local() if isinstance(g, DTensor) else g
        shape = (p.to_local() if isinstance(p, DTensor) else p).shape
        locals_.append(torch.zeros(shape) if g is None else g)
    flat = torch.cat([g.reshape(-1) for g in locals_])
    dist.all_reduce(flat, group=group)
    flat /= n
    offset = 0
    for p, g in zip(params, locals_):
        k = g.numel()
        value = flat[offset:offset + k].view_as(g)
        offset += k
        if p.grad is None:
            if value.numel() and value.abs().max() > 0:
                p.grad = value.clone() if not isinstance(p, DTensor) else None
            continue
        (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).copy_(value)


def compare(model, out_loss: torch.Tensor, ref: dict) -> dict:
    loss_err = relative_error(out_loss.detach().reshape(()), ref["loss"].reshape(()))
    grads = ref["grads"]
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in grads.values())).item() if grads else 0.0
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        want = grads.get(name)
        got = None if p.grad is None else full(p.grad)
        if want is None:
            err = 0.0 if got is None or not got.numel() or got.abs().max() == 0 else float("inf")
        elif got is None:
            err = 0.0 if not want.numel() or want.abs().max() == 0 else float("inf")
        else:
            err = relative_error(got, want, floor=ZERO_GRAD_FLOOR * total)
        if err > worst:
            worst, worst_name = err, name
    return {"loss_err": loss_err, "grad_err": worst, "worst_param": worst_name}


def _patched_errors(model, reference_numbers: dict, batch: dict, layout) -> dict:
    """Train (loss, every gradient) and eval (gathered logits) errors of the patched `model`."""
    import seqpar_hf
    model.train()
    out = model(**batch)
    out.loss.backward()
    _average_gradients(model, layout)
    errors = compare(model, out.loss, reference_numbers)
    model.eval()
    with torch.no_grad():
        out = model(**eval_inputs(model, batch))
    logits = full(seqpar_hf.gather_logits(model, full(out.logits)))
    errors["logits_err"] = relative_error(*_real_positions(model, batch, logits, reference_numbers["logits"]))
    return errors


def _real_positions(model, batch: dict, *logits: torch.Tensor) -> tuple:
    """Logits at real tokens only: at a padded query whose keys are all masked (left padding, or right
    padding under a window) kernels legitimately disagree (SDPA: 0, eager: the mean of the values);
    no loss or generated token reads them."""
    mask = batch.get("attention_mask")
    if is_seq2seq(model) or mask is None or logits[0].shape[:2] != mask.shape:
        return logits
    keep = mask.bool()
    return tuple(t[keep] for t in logits)


ERRORS = ("loss_err", "grad_err", "logits_err")
ROUNDING_LIMIT = 1e-3  # WRONG rows below it are re-run in float64 (the ring's math path takes float64)


def _float64_errors(model_type: str, class_name: str, batch: dict, layout) -> dict:
    """The same comparison in float64: fp32 rounding shrinks by ~1e9 there, a real error does not."""
    import seqpar_hf
    model, _ = build_tiny(model_type, class_name)
    model = model.double()
    ref = reference_run(copy.deepcopy(model), batch)
    seqpar_hf.patch_model(model, layout)
    return _patched_errors(model, ref, batch, layout)


def run_case(model_type: str, class_name: str, layout_name: str, layouts: dict) -> dict:
    """One class x layout on this rank; never raises."""
    import seqpar_hf
    start = time.time()
    rec = {"model_type": model_type, "class": class_name, "layout": layout_name, "rank": dist.get_rank()}

    def done(status, **kw):
        rec.update(status=status, seconds=round(time.time() - start, 2), **kw)
        return rec

    try:
        model, info = build_tiny(model_type, class_name)
    except Unbuildable as exc:
        return done(exc.status, reason=str(exc))
    except Exception as exc:  # noqa: BLE001
        return done("UNBUILDABLE", reason=f"build failed: {first_line(exc)}", where=where(exc))
    rec.update(attn=info["attn"], params=info["params"], kind="seq2seq" if is_seq2seq(model) else "causal")
    reference = copy.deepcopy(model)
    try:
        ref, batch = _reference(reference, make_batch(model, info))
    except Exception as exc:  # noqa: BLE001
        return done("NOT-RUNNABLE", reason=f"the unpatched model fails on the batch: {first_line(exc)}",
                    where=where(exc))
    layout = layouts[layout_name]
    try:
        seqpar_hf.patch_model(model, layout)
    except Exception as exc:  # noqa: BLE001
        # a refusal says why: a ValueError / NotImplementedError naming the structure; anything else
        # (an AttributeError inside patch_model, "found no attention modules") is an unclear one
        clear = isinstance(exc, (ValueError, NotImplementedError)) and "found no attention modules" not in str(exc)
        return done("REFUSED", reason=first_line(exc), where=where(exc), refusal="clear" if clear else "unclear")
    try:
        rec.update(_patched_errors(model, ref, batch, layout))
        # the same decision on every rank (the numbers are already identical; this makes sure)
        worst = torch.tensor([rec[k] for k in ERRORS], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        rec.update(zip(ERRORS, worst.tolist()))
    except Exception as exc:  # noqa: BLE001
        return done("CRASHED", reason=first_line(exc), where=where(exc))
    errors = {k: rec[k] for k in ERRORS}
    if all(e <= TOLERANCE for e in errors.values()):
        return done("EXACT")
    worst = max(errors, key=errors.get)
    reason = f"worst {worst} {errors[worst]:.2e}" + (f" at {rec['worst_param']}" if worst == "grad_err" else "")
    if max(errors.values()) < ROUNDING_LIMIT:
        try:
            f64 = _float64_errors(model_type, class_name, batch, layout)
        except Exception as exc:  # noqa: BLE001
            return done("CRASHED", reason=f"float64 re-run of a near miss ({reason}): {first_line(exc)}",
                        where=where(exc))
        rec["float64"] = {k: f64[k] for k in ERRORS}
        if all(v <= TOLERANCE / 10 for v in rec["float64"].values()):
            return done("EXACT", reason=f"fp32 rounding: {reason}; in float64 " +
                        " ".join(f"{k[:-4]}={v:.1e}" for k, v in rec["float64"].items()))
        reason += "; in float64 " + " ".join(f"{k[:-4]}={v:.1e}" for k, v in rec["float64"].items())
    # a reference that is not deterministic would make any comparison WRONG: say so
    again = reference_run(copy.deepcopy(reference), batch)
    drift = relative_error(again["loss"].reshape(()), ref["loss"].reshape(()))
    if drift > TOLERANCE:
        reason += f" (the unpatched model itself is not deterministic: loss drift {drift:.1e})"
    return done("WRONG", reason=reason)
