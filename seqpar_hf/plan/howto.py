"""How to run a planned layout: the table's legend, and for the recommended layout the training flags, the
launch and the `patch_model` call that give it."""

from __future__ import annotations

from ..models.forward.loss import TILED_LOSS_MIN_ELEMENTS
from .memory import Layout

LEGEND = """columns: GiB per rank at the step's highest moment, named in "at"
  states    weights and AdamW moments, plus the gradients that exist at that moment; sharded by FSDP over dp x sp
            and split by tp
  fsdp      parameters FSDP holds gathered then: the root's embeddings and head, and one layer
  activ.    activations saved for backward (with checkpointing: one input per layer, and the layer recomputed;
            with offload: two layer inputs, the rest in host memory; with a tiled MLP: one tile's intermediates)
  logits    the loss's [tokens, vocab] fp32 tensors; with the tiled loss, one chunk of them
  comm      buffers in flight: Ulysses all-to-all, ring K/V blocks, TP all-gathered inputs
  peak GiB  their sum (at the optimizer step also its temporaries); "(does not fit)": above the usable memory"""


def checkpointing_flag() -> str:
    """transformers 5.2x renamed `--gradient_checkpointing` (now an alias that warns) `--activation_checkpointing`."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return "--activation_checkpointing" if "activation_checkpointing" in fields else "--gradient_checkpointing"


def run_lines(layout: Layout, gpus: int, dtype: str, logits_per_rank: int) -> list[str]:
    """The flags of `layout` for the trainers (SequenceParallelArguments, the TRL configs, the recipes), the
    launch (FSDP2 over dp x sp wherever more than one rank holds the weights) and the same in Python.
    `logits_per_rank`: elements of one rank's [tokens, vocab] logits, which tell whether the trainers' default
    tiled_loss="auto" tiles."""
    sp, tp = layout.sp, layout.tp
    flags = (
        [f"--sp_size {sp}"] + ([f"--sp_mode {layout.mode}"] if sp > 1 else []) + ([f"--tp_size {tp}"] if tp > 1 else [])
    )
    flags += [checkpointing_flag()] if layout.checkpointing else []
    flags += ["--sp_offload_activations"] if layout.offload else []
    flags += ["--sp_tiled_mlp true"] if layout.tiled_mlp else []
    flags += ["--bf16"] if dtype == "bf16" else []
    tiled = layout.tiled and tp == 1
    shards = gpus // tp  # ranks holding the same weights: dp x sp
    note = ""
    if tiled and logits_per_rank < TILED_LOSS_MIN_ELEMENTS:
        note = (
            "; the tiled loss: patch the model with tiled_loss=True before the trainer (its 'auto' tiles from "
            "2^26 logits)"
        )
    launch = f"accelerate launch --num_processes {gpus} <script> <flags>"
    if shards > 1:
        launch = launch.replace(" <script>", " --use_fsdp --fsdp_version 2 <script>") + (
            f"  (FSDP2 over dp x sp = {shards} ranks)"
        )
    args = [f"sp_size={sp}"] + ([f"mode={layout.mode!r}"] if sp > 1 else []) + ([f"tp_size={tp}"] if tp > 1 else [])
    options = [", tiled_loss=True"] if tiled else []
    options += [", offload_activations=True"] if layout.offload else []
    options += [", tiled_mlp=True"] if layout.tiled_mlp else []
    call = (
        f"layout = seqpar_hf.ParallelLayout({', '.join(args)}); seqpar_hf.patch_model(model, layout{''.join(options)})"
    )
    call += "; model.gradient_checkpointing_enable()" if layout.checkpointing else ""
    call += "; seqpar_hf.training.fsdp.shard_model(model, layout)" if shards > 1 else ""
    return [
        "to run it:",
        f"  flags:   {' '.join(flags)}  (SequenceParallelArguments, the TRL configs, the recipes{note})",
        f"  launch:  {launch}",
        f"  python:  {call}",
    ]
