"""How the sweep compares the patched model with the unpatched one: relative errors, every gradient
(after what DDP would do), and generation scores."""

from __future__ import annotations

import torch
import torch.distributed as dist

TOLERANCE = 1e-5  # fp32: the suite's parity tolerance
ZERO_GRAD_FLOOR = 1e-4  # analytically zero gradients are compared against 1e-4 of the whole gradient (tests/parity.py)


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """||actual - expected|| / max(||expected||, floor)."""
    if actual.shape != expected.shape:
        return float("inf")
    denom = max(expected.double().norm().item(), floor)
    diff = (actual.double() - expected.double()).norm().item()
    return diff / denom if denom > 0 else diff


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def average_gradients(model, layout) -> None:
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
        locals_.append(torch.zeros(shape, dtype=p.dtype) if g is None else g)
    flat = torch.cat([g.reshape(-1) for g in locals_])
    dist.all_reduce(flat, group=group)
    flat /= n
    offset = 0
    for p, g in zip(params, locals_):
        k = g.numel()
        value = flat[offset : offset + k].view_as(g)
        offset += k
        if p.grad is None:
            if value.numel() and value.abs().max() > 0:
                p.grad = value.clone() if not isinstance(p, DTensor) else None
            continue
        (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).copy_(value)


def compare(model, out_loss: torch.Tensor, ref: dict) -> dict:
    """Loss and worst gradient error (with the parameter) against the reference numbers."""
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


def gradients(model) -> dict:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def finite_error(got: tuple, want: tuple) -> float:
    """Worst relative error over generation steps, on the entries finite in the reference (processors set
    -inf); inf where the steps or the -inf entries differ."""
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for a, b in zip(got, want):
        keep = torch.isfinite(b)
        if a.shape != b.shape or not torch.equal(keep, torch.isfinite(a)):
            return float("inf")
        worst = max(worst, relative_error(a[keep], b[keep]))
    return worst
