"""A replica (the sp x tp ranks that hold one copy of the model) is ONE data-parallel replica in the
Trainer: its ranks read the same batches (the data is split over dp_size replicas, not over the world),
it counts once in steps per epoch and the learning-rate schedule, and every gathered metric and
prediction holds each example once, in dataset order."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import recursively_apply
from torch.utils.data import SequentialSampler
from transformers.trainer_utils import has_length

from .. import _compat
from ..parallel.agree import explain_timeout
from ..parallel.comm import all_gather_into
from ..parallel.layout import ParallelLayout

# Training-argument fields that may differ per rank: where a process writes and what it prints or reports.
# Every other field changes the numbers or the collectives of training and must be the same on every rank.
_PER_PROCESS = (
    "output_dir",
    "logging_dir",
    "run_name",
    "local_rank",
    "log_level",
    "log_level_replica",
    "log_on_each_node",
    "disable_tqdm",
    "report_to",
    "project",
    "push_to_hub",
    "resume_from_checkpoint",
    "skip_memory_metrics",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "dataloader_persistent_workers",
    "dataloader_prefetch_factor",
    "ddp_timeout",
    "log_completions",
    "log_completions_hub_repo",
    "num_completions_to_print",
    "log_unique_prompts",
    "log_multimodal",
)
_PER_PROCESS_PREFIXES = ("hub_", "trackio_")


def _argument_values(args) -> dict:
    return {
        k: v for k, v in args.to_dict().items() if k not in _PER_PROCESS and not k.startswith(_PER_PROCESS_PREFIXES)
    }


def _as_text(value) -> str:
    # objects by type: their reprs hold addresses that differ per process
    return json.dumps(value, sort_keys=True, default=lambda o: type(o).__qualname__)


def check_same_arguments(args, device) -> None:
    """Raise ValueError on every rank unless every rank trains with the same arguments (those of
    `_PER_PROCESS` aside): an optimizer setting that differs per rank steps the ranks of a replica apart
    (their weights would differ at the next forward), a GRPO / RLOO group setting scores different groups
    on each rank. One all-gather of a 64-bit hash; the values only when they differ."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    values = _argument_values(args)
    digest = hashlib.sha256(_as_text(values).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.long, device=device)
    everyone = mine.new_empty(dist.get_world_size())
    with explain_timeout("comparing the training arguments across ranks"):
        all_gather_into(everyone, mine)  # [world]
    if len(set(everyone.tolist())) == 1:
        return
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, json.loads(_as_text(values)))
    keys = sorted(k for k in set().union(*every) if len({_as_text(e.get(k)) for e in every}) > 1)
    raise ValueError(
        f"ranks disagree on the training arguments ({type(args).__name__}: "
        + "; ".join(f"{k}: " + ", ".join(f"rank {r}: {e.get(k)!r}" for r, e in enumerate(every)) for k in keys[:8])
        + "). Every "
        "rank must train with the same arguments (only paths, names, logging and reporting may differ): per-rank "
        "optimizer settings would step the ranks of a replica apart, per-rank GRPO / RLOO settings would score "
        "different groups. Pass the same arguments on every rank."
    )


def prepare_replica_data_loader(accelerator, layout: ParallelLayout, data_loader, device_placement=None):
    """accelerate's `prepare_data_loader`, with each replica (SP x TP group) as one process: its ranks
    get the same batches, in the order one process with the same global batch would see them."""
    if _compat.is_prepared_data_loader(data_loader):
        _compat.register_data_loader(accelerator, data_loader)
        return data_loader
    prepared = prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=layout.dp_size,
        process_index=layout.dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=accelerator.device_placement if device_placement is None else device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
    _compat.register_data_loader(accelerator, prepared)
    return prepared


def one_per_replica(gathered, layout: ParallelLayout):
    """Of tensors gathered over the world (rank-major, the ranks of a replica holding the same values),
    the blocks of the first rank of each replica: what a gather over the data-parallel replicas gives."""
    world, replica = layout.world_size, layout.replica_size

    def first_ranks(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        blocks = t.reshape(world, -1, *t.shape[1:])  # [world * n, ...] -> [world, n, ...], rank-major
        return blocks[::replica].reshape(-1, *t.shape[1:])  # -> [dp * n, ...]

    return recursively_apply(first_ranks, gathered) if replica > 1 else gathered


class ReplicaMixin:
    """The data, metric and evaluation-speed parts of `SequenceParallelMixin`."""

    layout: ParallelLayout
    eval_data_collator = None  # evaluation / prediction batches (None: the training collator)

    def _setup_replica(self) -> None:
        self._eval_steps: dict[str, int] = {}  # eval steps the last loop ran, per metric prefix
        self._eval_step_count = 0

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        # this trainer's accelerator only
        self.accelerator.prepare_data_loader = functools.partial(
            prepare_replica_data_loader, self.accelerator, self.layout
        )
        # metrics gathered by the Trainer and by subclasses (TRL) count each replica once
        original = self.accelerator.gather_for_metrics
        self.accelerator.gather_for_metrics = functools.partial(self._gather_for_metrics, original)
        self.gather_function = self.accelerator.gather_for_metrics

    def get_total_train_batch_size(self, args) -> int:
        # one replica counts once (transformers' own SP size is tied to accelerate's SP, whose dataloader
        # adapter changes the epoch length, so it stays 1 here)
        # a mixin: the Trainer follows it in the method resolution order
        return super().get_total_train_batch_size(args) // self.layout.replica_size  # type: ignore[misc]

    # ---- evaluation batches: their own collator, the dataset's order ----------------------------------

    @contextlib.contextmanager
    def _eval_collator(self):
        if self.eval_data_collator is None:
            yield
            return
        train_collator, self.data_collator = self.data_collator, self.eval_data_collator
        try:
            yield
        finally:
            self.data_collator = train_collator

    def get_eval_dataloader(self, eval_dataset=None):
        with self._eval_collator():
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        with self._eval_collator():
            return super().get_test_dataloader(test_dataset)

    def _get_eval_sampler(self, eval_dataset):
        # Evaluation and prediction keep the dataset's order (transformers would group them by length
        # under train_sampling_strategy="group_by_length"), so predictions line up with the dataset.
        # A private Trainer hook, pinned in tests/test_compat.py.
        if eval_dataset is None or not has_length(eval_dataset):
            return None
        return SequentialSampler(eval_dataset)

    # ---- gathered metrics: one rank per replica, each example once ------------------------------------

    def _gather_for_metrics(self, original, input_data, use_gather_object=False):
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
        except TypeError:
            use_gather_object = True
        if use_gather_object or self.layout.replica_size == 1:
            return original(input_data, use_gather_object=use_gather_object)
        return self._gather_replicas(input_data)

    def _gather_replicas(self, data):
        """gather_for_metrics over data-parallel replicas: all-gather over the world, keep one rank per
        replica, then drop the repeated examples of the last batch."""
        data = one_per_replica(self.accelerator.gather(data), self.layout)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = recursively_apply(lambda t: t[: state.remainder], data)
        return data

    # ---- evaluation speed: the steps a replica ran together --------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        self._eval_step_count += 1
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        self.gather_function = self.accelerator.gather_for_metrics  # the Trainer resets it after the loop
        self._eval_step_count = 0
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        self._eval_steps[metric_key_prefix] = self._eval_step_count
        return output

    def _fix_speed_metrics(self, metrics: dict):
        """The Trainer counts eval steps as samples / (batch * world); a replica takes one step per
        global batch together, so the real count is what the loop ran."""
        for prefix, steps in self._eval_steps.items():
            runtime = metrics.get(f"{prefix}_runtime")
            if runtime and f"{prefix}_steps_per_second" in metrics:
                metrics[f"{prefix}_steps_per_second"] = round(steps / runtime, 3)

    def log(self, logs, *args, **kwargs):
        self._fix_speed_metrics(logs)
        return super().log(logs, *args, **kwargs)

    def predict(self, *args, **kwargs):
        output = super().predict(*args, **kwargs)
        self._fix_speed_metrics(output.metrics)
        return output
