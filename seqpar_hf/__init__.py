"""seqpar_hf: sequence parallelism (Ulysses, ring, hybrid) for Hugging Face models and Trainer."""

from .adapter import gather_logits, gather_sequence, is_patched, patch_model, sp_disabled, unpatch_model
from .layout import ParallelLayout
from .trainer import SequenceParallelArguments, SequenceParallelTrainer

__all__ = ["ParallelLayout", "patch_model", "unpatch_model", "is_patched", "sp_disabled",
           "gather_logits", "gather_sequence", "SequenceParallelArguments", "SequenceParallelTrainer"]
