"""TRL's `SFTTrainer` and `DPOTrainer` with sequence parallelism (optional: `pip install seqpar_hf[trl]`).

    from seqpar_hf.training.trl import SequenceParallelSFTConfig, SequenceParallelSFTTrainer

    args = SequenceParallelSFTConfig(output_dir="out", sp_size=2, ...)   # + every SFTConfig field
    trainer = SequenceParallelSFTTrainer(model=model, args=args, train_dataset=..., peft_config=...)

How they stay exact: TRL computes its losses itself, from the backbone's hidden states (its fused LM
head calls `model.base_model` directly) or from the model's logits. seqpar_hf shards every sequence in
the backbone's forward and, for such callers, gathers the backbone's outputs back to the full
sequence, so TRL's loss, token accuracy, entropy and DPO log-ratios are computed on exactly what the
unpatched model gives, identically on every rank of the SP group (the LM head runs on the full
sequence on every rank: the cost of not touching TRL's code). The gathered states send each rank's
shard of the gradient back scaled by sp, so DDP's average over the world is the average over
replicas. `SequenceParallelMixin` makes the ranks of a replica read the same batches and count once,
in the schedule and in every metric TRL gathers (token counts, accuracy, entropy, rewards).
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as exc:  # pragma: no cover - exercised without trl installed
    raise ImportError("seqpar_hf.training.trl needs TRL: pip install 'seqpar_hf[trl]'") from exc

from ..models.patch import is_patched, patch_model
from ..parallel.layout import ParallelLayout
from .arguments import SequenceParallelFields, patch_options
from .trainer import SequenceParallelMixin

# GRPO and RLOO live in their own module (generation and scoring per rank); importable from here too
from .trl_rl import (
    SequenceParallelGRPOConfig,
    SequenceParallelGRPOTrainer,
    SequenceParallelRLOOConfig,
    SequenceParallelRLOOTrainer,
)


@dataclass
class SequenceParallelSFTConfig(SequenceParallelFields, SFTConfig):
    """`SFTConfig` plus the parallel layout (`--sp_size`, `--sp_mode`, `--sp_ring_size`, `--tp_size`)."""

    def __post_init__(self):
        self._post_init_layout()
        super().__post_init__()
        self._validate_layout()


@dataclass
class SequenceParallelDPOConfig(SequenceParallelFields, DPOConfig):
    """`DPOConfig` plus the parallel layout."""

    def __post_init__(self):
        self._post_init_layout()
        super().__post_init__()
        self._validate_layout()


class _TRLSequenceParallel(SequenceParallelMixin):
    def _finish_setup(self):
        # A model TRL loaded (or wrapped) itself is patched now; its forward is TRL's from here on, so
        # only the backbone is sharded (TRL computes the loss on the gathered outputs).
        if not is_patched(self.model):
            patch_model(self.model, self.layout, lm_loss=False, **patch_options(self.args))


class SequenceParallelSFTTrainer(_TRLSequenceParallel, SFTTrainer):
    """TRL's `SFTTrainer`, sequence-parallel over `args.sp_size` ranks: exact against one process with
    the same global batch (loss, grad_norm, eval_loss, token accuracy, entropy, token counts), with
    `peft_config=`, gradient checkpointing, gradient accumulation, and padding-free / packed rows."""

    def __init__(
        self,
        model,
        args: SequenceParallelSFTConfig | None = None,
        *pargs,
        layout: ParallelLayout | None = None,
        **kwargs,
    ):
        self._setup_layout(model, args, layout)  # patches a model object before TRL wraps its forward
        super().__init__(model, args, *pargs, **kwargs)
        self._finish_setup()


class SequenceParallelDPOTrainer(_TRLSequenceParallel, DPOTrainer):
    """TRL's `DPOTrainer`, sequence-parallel over `args.sp_size` ranks. The reference model may be a
    deep copy of the patched model (sequence-parallel too) or a separate model (run whole on every rank)."""

    def __init__(
        self,
        model,
        ref_model=None,
        args: SequenceParallelDPOConfig | None = None,
        *pargs,
        layout: ParallelLayout | None = None,
        **kwargs,
    ):
        self._setup_layout(model, args, layout)
        super().__init__(model, ref_model, args, *pargs, **kwargs)
        self._finish_setup()


__all__ = [
    "SequenceParallelSFTConfig",
    "SequenceParallelSFTTrainer",
    "SequenceParallelDPOConfig",
    "SequenceParallelDPOTrainer",
    "SequenceParallelGRPOConfig",
    "SequenceParallelGRPOTrainer",
    "SequenceParallelRLOOConfig",
    "SequenceParallelRLOOTrainer",
]
