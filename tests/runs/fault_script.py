"""Launched by tests/test_fault.py under torchrun: rank 1 raises at step 2 of an SP training run."""

import os
import sys
import time

# the repository instead of this script's folder (whose modules would shadow packages)
sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import TrainerCallback  # noqa: E402 - after sys.path[0] is the repository

from tests.runs.trainer import make_trainer  # noqa: E402 - likewise


class Inject(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2 and args.process_index == 1:
            with open(os.environ["FAULT_STAMP"], "w") as f:
                f.write(str(time.time()))
            raise RuntimeError("injected failure (an out-of-memory, say) on rank 1")


if __name__ == "__main__":
    trainer, _ = make_trainer(sp=2, steps=50, extra=dict(eval_strategy="no"))
    trainer.add_callback(Inject())
    trainer.train()
