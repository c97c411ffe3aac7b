"""Training arguments with the parallel layout: `SequenceParallelFields` (the layout fields, shared with the
TRL configs) and `SequenceParallelArguments` (= `Seq2SeqTrainingArguments` + the layout)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from transformers import Seq2SeqTrainingArguments

from ..parallel.layout import MODES, check_head_chunks, validate_sizes
from ..parallel.process_group import DEFAULT_TIMEOUT

GENERATE_CHOICES = ("auto", "always", "never")
# sp_generate=auto: the source length from which generation runs under SP. Slicing the rows over the ranks
# holds the same bytes per rank as SP when the batch has at least sp rows, moves nothing per step and
# replicates no decoder work, so it is the default for the short sources of sentence-level batches; SP pays
# for long sources (a few rows of thousands of tokens: the rows cannot be split evenly, one row's encoder
# states and cross-attention K/V grow with it) -- see benchmarks/generation_memory.py.
AUTO_MIN_TOKENS = 1024


def _has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


@dataclass
class SequenceParallelFields:
    """The layout fields every sequence-parallel training-arguments class carries."""

    sp_size: int = field(
        default=1,
        metadata={
            "help": "Ranks that split each sequence (an SP group). The world "
            "size must be a multiple of sp_size x tp_size; data parallelism "
            "runs over the rest. 1 disables SP."
        },
    )
    sp_mode: str = field(
        default="ulysses",
        metadata={
            "help": "ulysses: all-to-all of heads (needs sp_size <= attention heads); ring: K/V blocks passed around "
            "a ring (any sp_size); hybrid: Ulysses inside groups of sp_size // sp_ring_size, ring across them; "
            "auto: chosen when the model is patched, from its heads and the ranks per node (logged with the "
            "reason; seqpar_hf.parallel.auto).",
            "choices": list(MODES),
        },
    )
    sp_ring_size: int | None = field(default=None, metadata={"help": "Ring size for sp_mode=hybrid (divides sp_size)."})
    sp_head_chunks: str = field(
        default="auto",
        metadata={
            "help": "Ulysses: parts of the heads whose all-to-all overlaps the attention kernel of the previous part; "
            "auto: chosen by the exchange's size (1 where it is too small to pay, e.g. on CPU); N: at most N."
        },
    )
    sp_mixer_split: str = field(
        default="auto",
        metadata={
            "help": "Token mixers outside attention (gated DeltaNets, Mamba, Mamba2) proven both ways: auto: along "
            "the sequence (1/sp of their activations, a few states sent), by heads where a fused kernel hides the "
            "scan at run time; heads: by heads (an all-to-all of the layer's inputs; faster for Mamba2 on a GPU).",
            "choices": ["auto", "heads"],
        },
    )
    tp_size: int = field(
        default=1,
        metadata={
            "help": "Megatron-style tensor + sequence parallelism over this many "
            "consecutive ranks (heads and MLP columns split, norms sharded "
            "along the sequence). 1 disables it."
        },
    )

    sp_offload_activations: bool = field(
        default=False,
        metadata={
            "help": "Keep the layer inputs gradient checkpointing saves in host memory (pinned, copied on a side "
            "stream, prefetched a layer ahead of the backward); bit-identical. Needs --gradient_checkpointing."
        },
    )
    sp_tiled_mlp: str = field(
        default="false",
        metadata={
            "help": "Compute each layer's MLP over sequence tiles, recomputed in the backward, so its [tokens, ffn] "
            "intermediates are one tile's: true (tiles of hidden-size tokens), N (tokens per tile), auto (where a "
            "rank's intermediate has >= 2^26 elements), false."
        },
    )

    # transformers' default is 1800 s. A rank that stopped (raised, killed, other code) leaves the others waiting
    # this long in their next collective, and ParallelLayout gives its groups the same timeout; seqpar_hf's checks
    # make the usual disagreements errors before any collective, so what is left should fail in minutes.
    # 10 minutes covers what one rank may do alone while the others wait (rank 0 writing a checkpoint or
    # preparing data); raise it for very large checkpoints or slow file systems.
    ddp_timeout: int = field(
        default=int(DEFAULT_TIMEOUT.total_seconds()),
        metadata={
            "help": "Timeout (s) of the collectives of the process group and of the sequence-parallel layout's groups."
        },
    )

    def _post_init_layout(self):
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _has_accelerator():
            # a multi-process launch on a machine without GPUs: run the processes on CPU (gloo) rather than
            # as unrelated single processes (accelerate does that unless ACCELERATE_USE_CPU=1 is set)
            self.use_cpu = True

    def _validate_layout(self):
        validate_sizes(self.world_size, self.sp_size, self.sp_mode, self.sp_ring_size, self.tp_size)
        self.head_chunks()  # a bad value fails here, not at the first forward
        self.patch_options()

    def patch_options(self) -> dict:
        """The memory options patch_model takes from the flags (seqpar_hf/memory/)."""
        return patch_options(self)

    def head_chunks(self) -> int | str:
        """`sp_head_chunks` as ParallelLayout takes it ("auto" or a positive int)."""
        value = str(self.sp_head_chunks)
        return check_head_chunks(int(value) if value.isdigit() else value)


@dataclass
class SequenceParallelArguments(SequenceParallelFields, Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` plus the parallel layout (`--sp_size 2` on the command line)."""

    sp_generate: str = field(
        default="auto",
        metadata={
            "help": "predict_with_generate: always: every rank of an SP group generates the whole batch, sources "
            "sharded along the sequence (model.generate under SP: 1/sp of the encoder states and cross-attention "
            "K/V, or of the KV cache, per rank); never: each rank generates a slice of the batch's rows, whole; "
            "auto: SP when the batch's sources have at least sp_generate_min_tokens tokens.",
            "choices": list(GENERATE_CHOICES),
        },
    )
    sp_generate_min_tokens: int = field(
        default=AUTO_MIN_TOKENS,
        metadata={
            "help": "sp_generate=auto generates under SP from this source (or prompt) length on (padded tokens)."
        },
    )

    def __post_init__(self):
        self._post_init_layout()
        super().__post_init__()
        self._validate_layout()  # fail before any collective
        if self.sp_generate not in GENERATE_CHOICES:
            raise ValueError(f"sp_generate={self.sp_generate!r}: choose one of {', '.join(GENERATE_CHOICES)}")
        if self.sp_generate == "always" and self.tp_size > 1:
            raise ValueError(
                "sp_generate='always' with tp_size > 1: generation under SP does not run on a tensor-"
                "parallel model; use 'auto' or 'never' (a plain copy with the full weights generates)"
            )
        if not isinstance(self.sp_generate_min_tokens, int) or self.sp_generate_min_tokens < 1:
            raise ValueError(f"sp_generate_min_tokens must be a positive integer, got {self.sp_generate_min_tokens!r}")


def patch_options(args) -> dict:
    """patch_model's offload_activations and tiled_mlp from `--sp_offload_activations` / `--sp_tiled_mlp` (the
    defaults for arguments without them)."""
    value = str(getattr(args, "sp_tiled_mlp", "false")).lower()
    named = {"true": True, "false": False, "auto": "auto"}
    if value not in named and not (value.isdigit() and int(value) > 0):
        raise ValueError(f"sp_tiled_mlp={value!r}: use true, false, auto or a positive number of tokens per tile")
    return dict(
        offload_activations=bool(getattr(args, "sp_offload_activations", False)),
        tiled_mlp=named[value] if value in named else int(value),
    )
