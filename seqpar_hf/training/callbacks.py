"""Training on a wall-clock budget, safely under SP / TP: every rank takes the same decision.

`TimeBudgetCallback(minutes)` measures the time spent training and agrees it across ranks once per step
(one all-reduce of one number: the slowest rank's), so that every rank stops on the same step,
evaluates on the same steps (`eval_every_minutes`) and, with `schedule`, uses the same learning rate.
A schedule that decays over the time budget rather than over a step count ends its decay exactly when
training ends, whatever the machine's speed: a run that is stopped by its budget is then annealed
instead of cut off mid-schedule.
"""

from __future__ import annotations

import logging
import time

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class TimeBudgetCallback(TrainerCallback):
    """Ends training after `minutes` of it (0: no limit); evaluation, prediction and saving then run as
    usual. `eval_every_minutes` > 0 also asks for an evaluation each time that much more time was spent.
    `fraction` is the spent part of the budget at the last step, the same number on every rank."""

    def __init__(self, minutes: float, eval_every_minutes: float = 0.0):
        if minutes < 0 or eval_every_minutes < 0:
            raise ValueError(
                f"TimeBudgetCallback(minutes={minutes}, eval_every_minutes={eval_every_minutes}): "
                "both must be >= 0 (0: no limit / no evaluation by time)"
            )
        self.seconds, self.every = minutes * 60, eval_every_minutes * 60
        self.start, self.elapsed, self.next_eval = None, 0.0, self.every

    @property
    def fraction(self) -> float:
        return min(1.0, self.elapsed / self.seconds) if self.seconds > 0 else 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start, self.elapsed, self.next_eval = time.time(), 0.0, self.every

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds <= 0 and self.every <= 0:
            return
        self.elapsed = agreed_max(time.time() - self.start, args.device)
        evaluating = args.eval_strategy != "no" or self.every > 0
        if self.every > 0 and self.elapsed >= self.next_eval:
            control.should_evaluate = True
            while self.next_eval <= self.elapsed:
                self.next_eval += self.every
        if self.seconds > 0 and self.elapsed > self.seconds:
            logger.info("time budget of %.1f minutes reached at step %d", self.seconds / 60, state.global_step)
            control.should_training_stop = True
            control.should_evaluate = evaluating  # a last evaluation, where there is one

    def schedule(self, optimizer, warmup_steps: int = 0, total_steps: int = 0) -> LambdaLR:
        """Linear warmup over `warmup_steps`, then linear decay to 0 at the end of the time budget, or at
        `total_steps` (> 0: the Trainer's step count, from its epochs or max_steps) if that comes first: a
        fast machine that runs out of epochs before the budget still ends annealed."""
        if self.seconds <= 0:
            raise ValueError("a schedule over the time budget needs a budget (minutes > 0)")

        def factor(step: int) -> float:
            warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
            spent = max(self.fraction, step / total_steps if total_steps > 0 else 0.0)
            return warm * max(0.0, 1.0 - spent)

        return LambdaLR(optimizer, factor)


def agreed_max(value: float, device) -> float:
    """The largest `value` over the ranks, on every rank (one all-reduce; no process group: `value`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
