"""Checkpoints every rank can trust: a failed save is an error on every rank, a checkpoint appears under its
name only once complete, and resuming from one that misses weights is an error.

- The Trainer's `_save_checkpoint` writes into `<run dir>/.checkpoint-N.incomplete/checkpoint-N` (its
  own code, unchanged, pointed at that folder through `_get_output_dir`); the folder is renamed to
  `<run dir>/checkpoint-N` when every rank wrote its part. A process killed half-way leaves only the hidden
  folder, which `get_last_checkpoint`, `resume_from_checkpoint=True` and the checkpoint rotation never
  see (the next save of that step removes it).
- A write that fails (an unwritable folder, a full disk) on one rank would leave the others in the next
  collective: inside a checkpoint the error is kept and the save goes on through its collectives (the
  gathers of sharded models, the Trainer's barrier), then every rank learns who failed (one all-reduce,
  and on failure one all-gather of the messages) and raises the same error. `save_model` does the
  same: call it on every rank (it is collective for TP and FSDP models anyway).
- Resuming: missing or unexpected keys raise (`checkpoint.check_keys`) where transformers only warns. Every
  checkpoint records the layout it was written at; before loading, every rank checks the checkpoint's files
  and its optimizer state against this run's layout, and state written at another layout is converted
  (`resume`).
"""

from __future__ import annotations

import builtins
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

from .. import _compat
from ..parallel.agree import explain_timeout
from . import checkpoint, resume


class SafeCheckpointMixin:
    """The checkpoint-saving and resuming parts of `SequenceParallelMixin` (any model)."""

    args: TrainingArguments  # (the Trainer's, declared for the type check: a mixin sets nothing)
    state: TrainerState
    _staging: str | None = None  # the run dir the Trainer's _save_checkpoint writes into, during one save
    _save_errors: list | None = None  # this rank's failed writes during one checkpoint

    def _get_output_dir(self, trial):  # private Trainer hook, pinned in test_compat
        return self._staging if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):  # private Trainer hook, pinned in test_compat
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final, staging = os.path.join(run_dir, name), os.path.join(run_dir, f".{name}.incomplete")
        self._agree(attempt(self._prepare, staging) if self.args.should_save else None, f"preparing {final}")
        self._staging, self._save_errors = staging, []
        try:
            super()._save_checkpoint(model, trial)
            if self.args.should_save and getattr(self, "layout", None) is not None:
                record = resume.describe(self.layout, self.model, _compat.unwrap_optimizer(self.optimizer))
                resume.write_record(os.path.join(staging, name), record)
        except Exception as exc:  # noqa: BLE001 - after the save's last collective; reported on every rank below
            self._save_errors.append(exc)
        finally:
            self._staging, errors, self._save_errors = None, self._save_errors, None
        try:
            self._agree(errors[0] if errors else None, f"saving {final}", f" (nothing was written to {final})")
        except Exception:
            shutil.rmtree(staging, ignore_errors=True)  # once every rank stopped writing into it
            raise
        error = attempt(self._publish, staging, final, run_dir) if self.args.should_save else None
        self._agree(error, f"renaming the complete checkpoint to {final}")
        if self.state.best_model_checkpoint == os.path.join(staging, name):  # every rank's state, for the end
            self.state.best_model_checkpoint = final
        if os.path.isdir(os.path.join(staging, name)):  # no shared file system: this node's part
            attempt(self._publish, staging, final, None)

    @staticmethod
    def _prepare(staging: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
        os.makedirs(staging, exist_ok=True)  # exist_ok: save_on_each_node on a shared file system

    def _publish(self, staging: str, final: str, run_dir: str | None) -> None:
        """Move the complete checkpoint to its name; fix the best-checkpoint path the Trainer saw in staging."""
        written = os.path.join(staging, os.path.basename(final))
        if run_dir is None:  # other nodes: add this node's files (rng states) to the checkpoint
            os.makedirs(final, exist_ok=True)
            for entry in os.listdir(written):
                os.replace(os.path.join(written, entry), os.path.join(final, entry))
            shutil.rmtree(staging, ignore_errors=True)
            return
        if not os.path.isdir(written) and os.path.isdir(final):
            return  # save_on_each_node on a shared file system: another node's first rank published it
        if os.path.isdir(final):
            shutil.rmtree(final)  # the Trainer overwrites a checkpoint of the same step too
        os.replace(written, final)
        shutil.rmtree(staging, ignore_errors=True)
        if self.state.best_model_checkpoint == written:
            self.state.best_model_checkpoint = final
            if os.path.isfile(os.path.join(final, _compat.TRAINER_STATE_NAME)):
                self.state.save_to_json(os.path.join(final, _compat.TRAINER_STATE_NAME))
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    # ---- the writes inside a checkpoint: kept, so the save goes on through its collectives ----------

    def _deferred(self, write, *args):
        if self._save_errors is None:
            return write(*args)
        error = attempt(write, *args)
        if error is not None:
            self._save_errors.append(error)

    def save_model(self, output_dir=None, _internal_call=False):
        if self._save_errors is not None:
            return self._deferred(super().save_model, output_dir, _internal_call)
        error = attempt(super().save_model, output_dir, _internal_call)
        self._agree(error, f"saving the model to {output_dir or self.args.output_dir}")

    def _save_optimizer_and_scheduler(self, output_dir):  # private Trainer hook, pinned in test_compat
        return self._deferred(super()._save_optimizer_and_scheduler, output_dir)

    def _save_scaler(self, output_dir):  # private Trainer hook, pinned in test_compat
        return self._deferred(super()._save_scaler, output_dir)

    def _save_rng_state(self, output_dir):  # private Trainer hook, pinned in test_compat
        return self._deferred(super()._save_rng_state, output_dir)

    # ---- every rank learns who failed --------------------------------------------------------------

    def _agree(self, error: BaseException | None, doing: str, after: str = "") -> None:
        agree(error, doing, self.args.device, after)

    # ---- resuming: unreadable files, missing or unexpected weights are errors; other layouts convert ----

    _resuming: str | None = None

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        folder = get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True else resume_from_checkpoint
        if isinstance(folder, str) and getattr(self, "layout", None) is not None and self.model is not None:
            current = resume.describe(self.layout, self.model)
            self._agree(attempt(resume.check, folder, current), f"resuming from {folder}")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_optimizer_and_scheduler(self, checkpoint_dir):  # private Trainer hook, pinned in test_compat
        if checkpoint_dir is None or getattr(self, "layout", None) is None:
            return super()._load_optimizer_and_scheduler(checkpoint_dir)
        if not resume.has_optimizer_state(checkpoint_dir):
            return None  # both start fresh, as in the Trainer (`train` warned)
        optimizer = _compat.unwrap_optimizer(self.optimizer)
        state = resume.converted(checkpoint_dir, self.model, optimizer, resume.describe(self.layout, self.model))
        if state is None:  # keyed and grouped as this run's: the Trainer's own loading
            return super()._load_optimizer_and_scheduler(checkpoint_dir)
        checkpoint.load_full_optimizer_state_dict(self.model, optimizer, state[0])
        self.lr_scheduler.load_state_dict(state[1])

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):  # private Trainer hook, pinned
        self._resuming = resume_from_checkpoint
        try:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        finally:
            self._resuming = None

    def _issue_warnings_after_load(self, load_result):  # private Trainer hook, pinned in test_compat
        checkpoint.check_keys(
            self.model,
            list(load_result.missing_keys),
            list(load_result.unexpected_keys),
            f"the checkpoint {self._resuming or ''}".rstrip(),
        )
        if load_result.missing_keys:
            self.model.tie_weights()  # what the Trainer does when only tied or ignored keys are missing


def agree(error: BaseException | None, doing: str, device, after: str = "") -> None:
    """Raise on every rank if `error` happened on any rank (one all-reduce; on failure one all-gather of the
    messages), with the failing rank's error class when it is a builtin OSError / RuntimeError / ValueError."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    failed = torch.tensor([int(error is not None)], device=device)
    with explain_timeout(f"after {doing}"):
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, None if error is None else (type(error).__name__, str(error)))
    ranks = [r for r, rep in enumerate(reports) if rep is not None]
    cls_name, first = reports[ranks[0]]
    cls = getattr(builtins, cls_name, None)
    cls = cls if isinstance(cls, type) and issubclass(cls, (OSError, RuntimeError, ValueError)) else RuntimeError
    raise cls(
        f"{doing} failed on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}{after}: "
        f"rank {ranks[0]}: {cls_name}: {first}"
    ) from error


def attempt(fn, *args, **kwargs) -> BaseException | None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - handed to _agree, which raises it on every rank
        return exc
    return None
