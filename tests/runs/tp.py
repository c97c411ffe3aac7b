"""Tensor (+ sequence) parallel parity cases run inside spawned gloo processes: the patched model, with
gradients averaged over the data-parallel x sequence-parallel ranks (what FSDP / DDP over those ranks
do), against the unpatched model in the same process. Every gradient is compared as a full tensor."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import seqpar_hf

from ..helpers.models import build_model, make_batch, relative_error
from .parity import ZERO_GRAD_FLOOR


def average_over_replicas(model, layout) -> None:
    """The data-parallel average: over the ranks holding the same weights (dp x sp), not over TP."""
    n = layout.dp_size * layout.sp_size
    for p in model.parameters():
        if p.grad is None or n == 1:
            continue
        local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(local, group=layout.dp_sp_group)
        local /= n


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(case: dict) -> dict:
    layout = seqpar_hf.ParallelLayout(
        sp_size=case["sp"],
        mode=case.get("mode", "ulysses"),
        ring_size=case.get("ring_size"),
        tp_size=case["tp"],
        head_chunks=case.get("head_chunks", "auto"),
    )
    family = case["family"]
    model = build_model(family, **case.get("model", {}))
    reference = copy.deepcopy(model)
    if case.get("checkpointing"):  # the block inputs' re-gather under the checkpoint's own saved-tensor hooks
        model.gradient_checkpointing_enable()
        reference.gradient_checkpointing_enable()
    batches = [make_batch(family, seed=100 + d, **case.get("batch", {})) for d in range(layout.dp_size)]
    seqpar_hf.patch_model(model, layout, **case.get("patch", {}))
    result = {"name": case["name"]}
    if case.get("eval"):
        model.eval(), reference.eval()
        inputs = {k: v for k, v in batches[layout.dp_rank].items() if k != "labels"}
        if family in ("marian", "bart", "mbart", "pegasus", "m2m100"):
            inputs["decoder_input_ids"] = reference.prepare_decoder_input_ids_from_labels(
                batches[layout.dp_rank]["labels"]
            )
        with torch.no_grad():
            result["logits_err"] = relative_error(model(**inputs).logits, reference(**inputs).logits)
        return result
    out = model(**batches[layout.dp_rank])
    out.loss.backward()
    average_over_replicas(model, layout)
    ref_losses = []
    for batch in batches:
        loss = reference(**batch).loss
        (loss / layout.dp_size).backward()
        ref_losses.append(loss.detach())
    result["loss_err"] = relative_error(out.loss.detach(), ref_losses[layout.dp_rank])
    grads = dict(reference.named_parameters())
    total = torch.sqrt(sum(g.grad.double().norm() ** 2 for g in grads.values() if g.grad is not None)).item()
    worst, worst_name = 0.0, ""
    for name, p in model.named_parameters():
        want = grads[name].grad
        if want is None:
            continue
        err = relative_error(full(p.grad), want, floor=ZERO_GRAD_FLOOR * total)
        if err > worst:
            worst, worst_name = err, name
    result["grad_err"], result["worst"] = worst, worst_name
    result["dtensor_params"] = sum(isinstance(p, DTensor) for p in model.parameters())
    return result


def run_cases(cases: list[dict]) -> list[dict]:
    return [run_case(c) for c in cases]


# ---------------------------------------------------------------------------------------------
# the cases, per world size, and the refusals


def _cases_world2():
    return [
        dict(name="tp2-llama-gqa", family="llama", sp=1, tp=2),
        dict(name="tp2-marian", family="marian", sp=1, tp=2),
        dict(name="tp2-bart", family="bart", sp=1, tp=2),
        dict(name="tp2-qwen3", family="qwen3", sp=1, tp=2),
        dict(name="tp2-llama-eval", family="llama", sp=1, tp=2, eval=True),
        dict(name="tp2-llama-checkpointing", family="llama", sp=1, tp=2, checkpointing=True),
        # the MLP over sequence tiles of 2 tokens: each tile all-gathered over TP and reduce-scattered back
        dict(name="tp2-llama-tiled-mlp", family="llama", sp=1, tp=2, checkpointing=True, patch=dict(tiled_mlp=2)),
        dict(name="tp2-marian-checkpointing", family="marian", sp=1, tp=2, checkpointing=True),
        dict(name="tp2-marian-eval", family="marian", sp=1, tp=2, eval=True),
    ]


def _cases_world4():
    # four ranks share two cores here: each family once per mode
    cases = [
        dict(name="tp2xdp2-llama", family="llama", sp=1, tp=2),
        dict(name="tp2xdp2-marian", family="marian", sp=1, tp=2),
        dict(name="tp4-llama", family="llama", sp=1, tp=4, model=dict(kv_heads=4)),
    ]
    cases += [dict(name=f"tp2xsp2-ulysses-{f}", family=f, sp=2, tp=2) for f in ("llama", "marian", "m2m100")]
    cases += [dict(name=f"tp2xsp2-ring-{f}", family=f, sp=2, tp=2, mode="ring") for f in ("gemma", "bart")]
    cases.append(
        dict(
            name="tp2xsp2-ulysses-llama-head-chunks-2",
            family="llama",
            sp=2,
            tp=2,
            head_chunks=2,
            model=dict(heads=8, kv_heads=4),
        )
    )
    cases.append(dict(name="tp2xsp2-ulysses-marian-eval", family="marian", sp=2, tp=2, eval=True))
    return cases


CASES = {2: _cases_world2(), 4: _cases_world4()}


def refusals() -> dict:
    """Layouts that cannot work, each refused with its message (None: accepted)."""
    layout = seqpar_hf.ParallelLayout(sp_size=1, tp_size=2)
    out = {}
    for name, family, kwargs in (
        ("kv-heads", "llama", dict(heads=4, kv_heads=1)),
        ("heads", "marian", dict(heads=3)),
        ("fused-qkv", "phi3", {}),
        ("experts", "mixtral", {}),
    ):
        try:
            seqpar_hf.patch_model(build_model(family, **kwargs), layout)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    model = seqpar_hf.patch_model(build_model("llama"), layout)
    batch = make_batch("llama", seed=1)
    embeds = torch.zeros(*batch["input_ids"].shape, model.config.hidden_size)
    try:  # refused in the forward, on every rank alike (every rank of the replica has the same batch)
        model(inputs_embeds=embeds, attention_mask=batch["attention_mask"], labels=batch["labels"])
        out["inputs-embeds"] = None
    except NotImplementedError as exc:
        out["inputs-embeds"] = str(exc)
    try:
        seqpar_hf.ParallelLayout(sp_size=2, tp_size=2)
        out["world"] = None
    except ValueError as exc:
        out["world"] = str(exc)
    return out


def regather_check() -> dict:
    """What a TP layer saves for the backward: every [.., hidden] tensor saved inside a decoder layer is
    this rank's sequence slice (the block inputs are gathered again in the backward), never the
    gathered whole sequence."""
    layout = seqpar_hf.ParallelLayout(sp_size=1, tp_size=2)
    model = build_model("llama")
    batch = make_batch("llama", seed=3, pad=False)
    seqpar_hf.patch_model(model, layout)
    hidden, inside, rows = model.config.hidden_size, [0], []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda *a: inside.__setitem__(0, inside[0] + 1))
        layer.register_forward_hook(lambda *a: inside.__setitem__(0, inside[0] - 1))

    weights = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        local = t.to_local() if isinstance(t, DTensor) else t
        if inside[0] and local.dim() and local.shape[-1] == hidden:
            try:
                weight = local.untyped_storage().data_ptr() in weights
            except RuntimeError:  # a wrapper without storage (a pending collective's result): not a weight
                weight = False
            if not weight:
                rows.append(local.numel() // hidden)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss.backward()
    return {"rows": sorted(set(rows)), "tokens": batch["input_ids"].numel(), "batch": batch["input_ids"].shape[0]}
