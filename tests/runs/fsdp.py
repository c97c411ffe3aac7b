"""FSDP2 x SP runs inside spawned gloo processes: a plain training loop (AdamW steps, then the full
parameters) against one process holding the global batch."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import seqpar_hf
from seqpar_hf.training import checkpoint
from seqpar_hf.training.fsdp import shard_model

from ..helpers.models import build_model, make_batch, relative_error


def plain_loop(case: dict) -> dict:
    """`steps` AdamW steps of the patched, FSDP2-sharded model (dp x sp ranks) vs one process on the
    global batch; returns the worst relative error of the parameters after the steps (full tensors),
    the per-step losses, and the model-state bytes this rank holds."""
    layout = seqpar_hf.ParallelLayout(sp_size=case["sp"], mode=case.get("mode", "ulysses"), tp_size=case.get("tp", 1))
    family = case["family"]
    model = build_model(family)
    for name, p in model.named_parameters():
        if name.endswith("k_proj.bias"):  # analytically zero gradient: Adam would turn rounding noise into steps
            p.requires_grad_(False)
    reference = copy.deepcopy(model)
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable()
        reference.gradient_checkpointing_enable()
    seqpar_hf.patch_model(model, layout, tiled_loss=case.get("tiled", "auto"), **case.get("patch", {}))
    summary = shard_model(model, layout) if not case.get("ddp") else {"bytes": 0}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(case.get("steps", 3)):
        batches = [make_batch(family, seed=10 * step + d) for d in range(layout.dp_size)]
        loss = model(**batches[layout.dp_rank]).loss
        loss.backward()
        if case.get("ddp"):  # the DDP reference: average over the world
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= layout.world_size
        optimizer.step(), optimizer.zero_grad()
        ref_loss = sum(reference(**b).loss for b in batches) / layout.dp_size  # DDP: mean over replicas
        ref_loss.backward()
        ref_optimizer.step(), ref_optimizer.zero_grad()
        local = torch.tensor([loss.item()])
        dist.all_reduce(local)  # the replicas' mean, as DDP logs it
        losses.append(local.item() / layout.world_size)
        ref_losses.append(ref_loss.item())
    state = checkpoint.full_model_state_dict(model) if not case.get("ddp") else model.state_dict()
    worst = 0.0
    if dist.get_rank() == 0:
        want = reference.state_dict()
        worst = max(relative_error(v, want[k]) for k, v in state.items() if v.is_floating_point())
    optimizer_bytes = sum(
        t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
    return {
        "name": case["name"],
        "param_err": worst,
        "losses": losses,
        "ref_losses": ref_losses,
        "summary": summary,
        "optimizer_bytes": optimizer_bytes,
    }


def run_loops(cases: list[dict]) -> list[dict]:
    return [plain_loop(c) for c in cases]


# (FSDP with TP on Marian: the Trainer's tp2xsp2-fsdp run in tests/test_trainer_gloo.py)
LOOPS = [
    dict(name="sp2xdp2-llama", family="llama", sp=2),
    dict(name="sp2xdp2-marian", family="marian", sp=2),
    dict(name="sp4-ring-llama", family="llama", sp=4, mode="ring"),
    # seqpar_hf/memory/: layer inputs offloaded to host memory (with FSDP2, with TP), the MLP over tiles of 2 tokens;
    # with the tiled loss
    dict(
        name="sp2xdp2-llama-offload-tiled-mlp-tiled-loss",
        family="llama",
        sp=2,
        checkpointing=True,
        tiled=True,
        patch=dict(offload_activations=True, tiled_mlp=2),
    ),
    dict(
        name="tp2xsp2-llama-offload-tiled-mlp",
        family="llama",
        sp=2,
        tp=2,
        checkpointing=True,
        patch=dict(offload_activations=True, tiled_mlp=2),
    ),
]
