"""Token-weighted cross-entropy over an SP group's full batch, from each rank's shard of logits.

The unpatched model's loss is sum(token losses) / (number of labelled tokens) over the full batch;
each rank holds some of the tokens, so both sums are reduced over the SP group. The result is the
same number on every rank of the group.

Tiled: at long lengths the logits dominate memory (a [tokens, vocab] fp32 tensor is 16 GB at 32K
tokens for a 128K vocabulary, and cross-entropy saves its log-softmax of the same size). The tiled
loss takes the LM head's input instead, keeps only the labelled tokens, and runs head + cross-entropy
over chunks of them under activation checkpointing: no [tokens, vocab] tensor is ever held, only one
chunk's, and backward recomputes each chunk's logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...parallel.comm import group_size, group_sum
from .labels import IGNORE_INDEX

# Defaults of patch_model's tiled-loss thresholds. Tiling is on (training, "auto") when this rank's logits
# would hold at least this many elements (2^26: 256 MiB in fp32, before cross-entropy's fp32 log-softmax
# and the gradient of the same size).
TILED_LOSS_MIN_ELEMENTS = 1 << 26
# Logit elements per chunk (2^24: 64 MiB in fp32): large enough that the head's matmul stays efficient.
TILED_LOSS_CHUNK_ELEMENTS = 1 << 24

# Gradient scaling, in one place. Each rank back-propagates only its own shard, and data-parallel wrappers
# (DDP, FSDP) AVERAGE gradients over every rank that holds the same weights: dp x sp of them.
# - Over the SP group, the loss is the sum of the ranks' partial token sums (`group_mean_loss` through
#   `comm.group_sum`), whose backward multiplies by sp: the wrapper's average over the group's ranks
#   becomes their sum, the gradient of the replica's loss.
# - Over data-parallel replicas, the trainer divides by the labelled tokens of the whole global batch
#   (`num_items_in_batch`, counted over every replica) and multiplies by dp (`global_batch_loss`): the
#   wrapper's average over replicas becomes their sum, the gradient of the global batch's mean loss.
#   Without the trainer (plain DDP, no num_items_in_batch), each replica's mean loss is averaged: plain DP.


def label_count(labels: torch.Tensor, group) -> torch.Tensor:
    """Labelled tokens of the SP group's full batch (labels: this rank's shard)."""
    count = (labels != IGNORE_INDEX).sum()
    if group_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Sum of this rank's token losses (logits [..., V], labels [...], -100 ignored), in fp32.
    `label_smoothing` matches transformers' LabelSmoother: (1 - eps) * nll + eps * mean over the
    vocabulary of -log p."""
    return F.cross_entropy(
        logits.float().flatten(0, -2),
        labels.flatten().to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=label_smoothing,
    )


def tiled_token_loss_sum(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
    label_smoothing: float = 0.0,
    chunk_elements: int = TILED_LOSS_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """`token_loss_sum(head(hidden), labels)` without the [tokens, vocab] logits: hidden [..., d] is the
    LM head's input, `head` maps [n, d] -> [n, V] logits (the model's head and what follows it)."""
    hidden = hidden.flatten(0, -2)
    keep = (labels.flatten() != IGNORE_INDEX).nonzero().squeeze(1).to(hidden.device)
    hidden, targets = hidden.index_select(0, keep), labels.flatten().to(hidden.device).index_select(0, keep)
    chunk = max(1, chunk_elements // vocab_size)
    total = None
    # at least one (maybe empty) chunk: the head's weights join the graph even with no labelled token
    for start in range(0, max(1, hidden.shape[0]), chunk):
        piece = checkpoint(
            _chunk_loss,
            hidden[start : start + chunk],
            targets[start : start + chunk],
            head,
            label_smoothing,
            use_reentrant=False,
        )
        total = piece if total is None else total + piece
    assert total is not None  # the loop above runs at least once
    return total


def _chunk_loss(hidden, targets, head, label_smoothing):
    return F.cross_entropy(head(hidden).float(), targets, reduction="sum", label_smoothing=label_smoothing)


def group_mean_loss(
    token_sum: torch.Tensor,
    labels: torch.Tensor,
    group,
    sp_size: int,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The group's mean loss from this rank's sum of token losses and its shard of the labels (see the
    scaling note above). `num_items_in_batch` replaces the label count as denominator (gradient
    accumulation and data parallelism count tokens over several batches)."""
    total = group_sum(token_sum, group, float(sp_size))
    if num_items_in_batch is None:
        denominator = label_count(labels, group)
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=total.device)
    return total / denominator.to(total.dtype)


def global_batch_loss(loss: torch.Tensor, dp_size: int) -> torch.Tensor:
    """A replica's share of the global batch's loss (num_items_in_batch counted over every replica), scaled
    so that the data-parallel wrapper's average over replicas is their sum (see the scaling note above)."""
    return loss * dp_size
