"""Parity cases run inside spawned gloo processes: the patched model (wrapped in DDP over the whole
world, as accelerate does) against the unpatched model in the same process."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import seqpar_hf

from .models import build_model, make_batch, relative_error

# Analytically zero gradients (k_proj biases: softmax ignores a shift shared by all keys) are float
# noise of ~1e-14 in both models; they are compared against 1e-4 of the whole gradient's norm.
ZERO_GRAD_FLOOR = 1e-4


def _grad_errors(patched, reference) -> tuple[float, str]:
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in grads.values())).item()
    worst, worst_name = 0.0, ""
    for name, p in patched.named_parameters():
        if name not in grads:
            assert p.grad is None or p.grad.abs().max() == 0, f"{name} has a gradient only under SP"
            continue
        assert p.grad is not None, f"{name} has no gradient under SP"
        err = relative_error(p.grad, grads[name], floor=ZERO_GRAD_FLOOR * total)
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name


def run_case(case: dict) -> dict:
    """One parity case. `case`: family, sp, mode, ring_size, model (config overrides), batch (batch
    overrides), checkpointing, eval (compare gathered logits without labels instead of loss + gradients)."""
    layout = seqpar_hf.ParallelLayout(sp_size=case["sp"], mode=case.get("mode", "ulysses"),
                                      ring_size=case.get("ring_size"))
    family = case["family"]
    model = build_model(family, seed=case.get("seed", 0), **case.get("model", {}))
    reference = copy.deepcopy(model)
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable()
        reference.gradient_checkpointing_enable()
    batches = [make_batch(family, seed=100 + d, **case.get("batch", {})) for d in range(layout.dp_size)]
    mine = batches[layout.dp_rank]
    patch = dict(case.get("patch", {}))
    if case.get("chunk_elements"):  # small chunks: the tiled loss runs over several of them
        patch["tiled_chunk_elements"] = case["chunk_elements"]
    seqpar_hf.patch_model(model, layout, **patch)
    if case.get("deepcopy"):  # a deep copy of the patched model is a patched model on the same layout
        original, model = model, copy.deepcopy(model)
        with torch.no_grad():
            for p in original.parameters():
                p.add_(1.0)  # the copy must not share weights with the original
    result = {"name": case["name"], "rank": layout.rank}

    if case.get("eval"):
        model.eval(), reference.eval()
        inputs = {k: v for k, v in mine.items() if k != "labels"}
        if family in ("marian", "bart", "mbart", "pegasus"):
            inputs["decoder_input_ids"] = reference.prepare_decoder_input_ids_from_labels(mine["labels"])
        with torch.no_grad():
            out = model(**inputs)
            expected = reference(**inputs)
        logits = seqpar_hf.gather_logits(model, out.logits)
        result["logits_err"] = relative_error(logits, expected.logits)
        if "encoder_last_hidden_state" in expected:
            enc = seqpar_hf.gather_sequence(model, out.encoder_last_hidden_state, side="encoder")
            result["encoder_err"] = relative_error(enc, expected.encoder_last_hidden_state)
        return result

    ddp = DDP(model)
    if case.get("second_batch"):  # two forwards of different lengths before one backward
        extra = [make_batch(family, seed=200 + d, **case["second_batch"]) for d in range(layout.dp_size)]
        out = ddp(**mine)
        out2 = ddp(**extra[layout.dp_rank])
        (out.loss + out2.loss).backward()
        ref_losses = []
        for batch, batch2 in zip(batches, extra):
            loss = reference(**batch).loss
            ((loss + reference(**batch2).loss) / layout.dp_size).backward()
            ref_losses.append(loss.detach())
    else:
        out = ddp(**mine)
        out.loss.backward()
        ref_losses = []
        for batch in batches:  # plain data parallelism over dp_size replicas, each with its full batch
            loss = reference(**batch).loss
            (loss / layout.dp_size).backward()
            ref_losses.append(loss.detach())
    result["loss"] = out.loss.item()
    result["loss_err"] = abs(out.loss.item() - ref_losses[layout.dp_rank].item()) / abs(ref_losses[layout.dp_rank].item())
    result["grad_err"], result["worst_param"] = _grad_errors(model, reference)
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, out.loss.item())
    result["group_losses"] = losses[layout.sp_size * layout.dp_rank: layout.sp_size * (layout.dp_rank + 1)]
    return result


def run_cases(cases: list[dict]) -> list[dict]:
    return [run_case(c) for c in cases]
