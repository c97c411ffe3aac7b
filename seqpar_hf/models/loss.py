"""Token-weighted cross-entropy over an SP group's full batch, from each rank's shard of logits.

The unpatched model's loss is sum(token losses) / (number of labelled tokens) over the full batch;
each rank holds some of the tokens, so both sums are reduced over the SP group. The result is the
same number on every rank of the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..parallel.comm import group_size, group_sum

IGNORE_INDEX = -100


def label_count(labels: torch.Tensor, group) -> torch.Tensor:
    """Labelled tokens of the SP group's full batch (labels: this rank's shard)."""
    count = (labels != IGNORE_INDEX).sum()
    if group_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count


def sequence_parallel_loss(logits: torch.Tensor, labels: torch.Tensor, group, grad_scale: float,
                           num_items_in_batch: int | torch.Tensor | None = None,
                           label_smoothing: float = 0.0) -> torch.Tensor:
    """logits [b, s_loc, V] and labels [b, s_loc] (this rank's shard, already aligned: labels[t] is
    the target of logits[t]) -> the group's mean loss.

    `num_items_in_batch` replaces the label count as denominator (gradient accumulation and data
    parallelism count tokens over several batches). `label_smoothing` matches transformers'
    LabelSmoother: (1 - eps) * nll + eps * mean over the vocabulary of -log p.
    `grad_scale` (= sp_size) makes world-averaging wrappers such as DDP sum over the SP group.
    """
    token_sum = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten().to(logits.device),
                                ignore_index=IGNORE_INDEX, reduction="sum", label_smoothing=label_smoothing)
    total = group_sum(token_sum, group, grad_scale)
    if num_items_in_batch is None:
        denominator = label_count(labels, group)
    else:
        denominator = torch.as_tensor(num_items_in_batch, device=total.device)
    return total / denominator.to(total.dtype)
