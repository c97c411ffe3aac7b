"""Trainer callbacks that are safe under SP / TP: every rank takes the same decision."""

from __future__ import annotations

import logging
import time

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class TimeBudgetCallback(TrainerCallback):
    """Ends training after `minutes` of it (0: no limit); evaluation, prediction and saving then run
    as usual. The ranks agree on the step (any rank's budget spent stops all), so no rank is left
    waiting in a collective for one that stopped a step earlier."""

    def __init__(self, minutes: float):
        self.seconds, self.start = minutes * 60, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds > 0 and all_ranks_agree(time.time() - self.start > self.seconds, args.device):
            logger.info("time budget of %.1f minutes reached at step %d", self.seconds / 60, state.global_step)
            control.should_training_stop = True
            control.should_evaluate = args.eval_strategy != "no"  # a last evaluation, where there is one


def all_ranks_agree(flag: bool, device) -> bool:
    """True on every rank when `flag` is true on any rank (one all-reduce; no process group: `flag`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
