"""seqpar_hf: sequence parallelism (Ulysses, ring, hybrid) for Hugging Face models and trainers."""

from .models.patch import (
    gather_logits,
    gather_sequence,
    is_patched,
    layout_of,
    model_kind,
    patch_model,
    sp_disabled,
    unpatch_model,
)
from .parallel.layout import ParallelLayout
from .parallel.process_group import init_process_group
from .training.arguments import SequenceParallelArguments
from .training.callbacks import TimeBudgetCallback
from .training.trainer import SequenceParallelTrainer

__all__ = [
    "ParallelLayout",
    "init_process_group",
    "patch_model",
    "unpatch_model",
    "is_patched",
    "layout_of",
    "sp_disabled",
    "model_kind",
    "gather_logits",
    "gather_sequence",
    "SequenceParallelArguments",
    "SequenceParallelTrainer",
    "TimeBudgetCallback",
]
