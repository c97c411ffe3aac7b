"""Trainer integration: `SequenceParallelArguments`, `SequenceParallelMixin`, `SequenceParallelTrainer`.

The ranks of one replica (an SP group, times TP when used) are one data-parallel replica: they
read the same batches (the data is split over `dp_size` replicas, not over the world), count as one
replica in steps per epoch and in the learning-rate schedule, and report each evaluation example
once. `SequenceParallelMixin` does that for any transformers `Trainer` subclass (the TRL trainers in
`seqpar_hf.training.trl` use it); `SequenceParallelTrainer` adds a loss that is token-weighted over
the whole accumulated global batch, computed on each rank's shard of the logits, so every mix of
gradient accumulation, data parallelism and sequence parallelism logs the number one process with
the same global batch logs.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import recursively_apply
from torch.utils.data import SequentialSampler
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
from transformers.trainer_utils import has_length

from .. import _compat
from ..models.loss import IGNORE_INDEX
from . import checkpoint, fsdp
from ..models.patch import gather_logits, is_patched, model_kind, patch_model
from ..parallel.comm import group_size
from ..parallel.layout import MODES, ParallelLayout, validate_sizes


def _has_accelerator() -> bool:
    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


@dataclass
class SequenceParallelFields:
    """The layout fields every sequence-parallel training-arguments class carries."""

    sp_size: int = field(default=1, metadata={"help": "Ranks that split each sequence (an SP group). The world "
                                                      "size must be a multiple of sp_size x tp_size; data parallelism "
                                                      "runs over the rest. 1 disables SP."})
    sp_mode: str = field(default="ulysses", metadata={
        "help": "ulysses: all-to-all of heads (needs sp_size <= attention heads); ring: K/V blocks passed around "
                "a ring (any sp_size); hybrid: Ulysses inside groups of sp_size // sp_ring_size, ring across them.",
        "choices": list(MODES)})
    sp_ring_size: int | None = field(default=None, metadata={"help": "Ring size for sp_mode=hybrid (divides sp_size)."})
    tp_size: int = field(default=1, metadata={"help": "Megatron-style tensor + sequence parallelism over this many "
                                                      "consecutive ranks (heads and MLP columns split, norms sharded "
                                                      "along the sequence). 1 disables it."})

    def _post_init_layout(self):
        if not self.use_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _has_accelerator():
            # a multi-process launch on a machine without GPUs: run the processes on CPU (gloo) rather than
            # as unrelated single processes (accelerate does that unless ACCELERATE_USE_CPU=1 is set)
            self.use_cpu = True

    def _validate_layout(self):
        validate_sizes(self.world_size, self.sp_size, self.sp_mode, self.sp_ring_size, self.tp_size)


@dataclass
class SequenceParallelArguments(SequenceParallelFields, Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` plus the parallel layout (`--sp_size 2` on the command line)."""

    # transformers' default is 1800 s. A rank that dies mid-collective leaves the others waiting this long
    # (when no launcher kills them first): 10 minutes still covers a checkpoint save on rank 0.
    ddp_timeout: int = field(default=600, metadata={"help": "Timeout (s) of the process group's collectives."})

    def __post_init__(self):
        self._post_init_layout()
        super().__post_init__()
        self._validate_layout()  # fail before any collective


def prepare_replica_data_loader(accelerator, layout: ParallelLayout, data_loader, device_placement=None,
                                slice_fn_for_dispatch=None):
    """accelerate's `prepare_data_loader`, with each replica (SP x TP group) as one process: its ranks
    get the same batches, in the order one process with the same global batch would see them."""
    if _compat.is_prepared_data_loader(data_loader):
        _compat.register_data_loader(accelerator, data_loader)
        return data_loader
    prepared = prepare_data_loader(
        data_loader, accelerator.device, num_processes=layout.dp_size, process_index=layout.dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=accelerator.device_placement if device_placement is None else device_placement,
        rng_types=accelerator.rng_types.copy(), dispatch_batches=False, even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking, use_stateful_dataloader=accelerator.use_stateful_dataloader)
    _compat.register_data_loader(accelerator, prepared)
    return prepared


class SequenceParallelMixin:
    """Makes a replica of SP (x TP) ranks one data-parallel replica in any transformers `Trainer`.

    Put it before the Trainer class (`class MyTrainer(SequenceParallelMixin, Trainer)`) and call
    `self._setup_layout(model, args, layout)` before `Trainer.__init__`.
    """

    layout: ParallelLayout

    eval_data_collator = None  # evaluation / prediction batches (None: the training collator)

    def _setup_layout(self, model, args, layout: ParallelLayout | None):
        if args is None or not hasattr(args, "sp_size"):
            raise TypeError(f"{type(self).__name__} needs sequence-parallel training arguments "
                            "(SequenceParallelArguments, or the TRL configs in seqpar_hf.training.trl)")
        args.device  # sets up the process group when launched distributed (accelerate / torchrun)
        self.layout = layout or ParallelLayout(args.sp_size, args.sp_mode, args.sp_ring_size, args.tp_size)
        if model is not None and not isinstance(model, str) and not is_patched(model):
            patch_model(model, self.layout)
        self.fsdp_summary = None
        if model is not None and not isinstance(model, str) and fsdp.fsdp_requested(args):
            # FSDP2 over dp x sp, also on CPU, where the Trainer would silently ignore the request
            self.fsdp_summary = fsdp.shard_model(model, self.layout)
        self._eval_steps: dict[str, int] = {}  # eval steps the last loop ran, per metric prefix
        self._eval_step_count = 0

    # ---- data: shard over data-parallel replicas, not over the world ----------------------------------

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        # this trainer's accelerator only
        self.accelerator.prepare_data_loader = functools.partial(prepare_replica_data_loader, self.accelerator,
                                                                 self.layout)
        # metrics gathered by the Trainer and by subclasses (TRL) count each replica once
        original = self.accelerator.gather_for_metrics
        self.accelerator.gather_for_metrics = functools.partial(self._gather_for_metrics, original)
        self.gather_function = self.accelerator.gather_for_metrics
        # a model with DTensor parameters (tensor parallelism) cannot go into DDP: the gradients are
        # averaged over the replicas here instead (training_step)
        prepare_model = self.accelerator.prepare_model
        self.accelerator.prepare_model = functools.partial(self._prepare_model, prepare_model)

    def _prepare_model(self, original, model, device_placement=None, evaluation_mode=False):
        if checkpoint.is_sharded(model):
            evaluation_mode = True  # accelerate's own words for "no DDP wrapper"
        return original(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.accelerator.sync_gradients and checkpoint.is_sharded(model) and not fsdp.is_fully_sharded(model):
            self._average_gradients(model)  # FSDP2 reduce-scatters (and averages) in its backward hooks
        return loss

    def _average_gradients(self, model):
        """What DDP does, for a tensor-parallel model without FSDP: average each gradient (a DTensor's local shard)
        over the ranks that hold the same weights (dp x sp), once per optimizer step."""
        n = self.layout.dp_size * self.layout.sp_size
        if n == 1:
            return
        for p in model.parameters():
            if p.grad is not None:
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(local, group=self.layout.dp_sp_group)
                local.div_(n)

    # ---- gradient norm of DTensor models -----------------------------------------------------------

    def _clip_grad_norm(self, model):  # private Trainer hook, pinned in test_compat
        if not checkpoint.is_sharded(model):
            return super()._clip_grad_norm(model)
        return self._sharded_grad_norm(model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):  # private Trainer hook, pinned in test_compat
        if grad_norm is None and checkpoint.is_sharded(model):
            grad_norm = self._sharded_grad_norm(model, float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    @staticmethod
    def _sharded_grad_norm(model, max_norm: float) -> torch.Tensor:
        """Norm (and clip) of gradients that live on several meshes (TP DTensors, FSDP's, plain ones): one
        norm per mesh with torch's placement-aware `get_total_norm` (a replicated DTensor counts once),
        then their norm. transformers 5.17's Trainer summed every DTensor's local norm over the mesh, which
        counts TP's replicated norm weights t times."""
        from torch.distributed.tensor import DTensor
        from torch.nn.utils import clip_grads_with_norm_, get_total_norm

        groups: dict = {}
        for p in model.parameters():
            if p.grad is not None:
                groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
        norms = []
        for params in groups.values():
            norm = get_total_norm([p.grad for p in params])
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms))
        if max_norm != float("inf"):
            for params in groups.values():
                clip_grads_with_norm_(params, max_norm, total)
        return total

    # ---- checkpoints of DTensor models: plain, full ones --------------------------------------------

    def save_model(self, output_dir=None, _internal_call=False):
        if not checkpoint.is_sharded(self.model):
            return super().save_model(output_dir, _internal_call)
        state_dict = checkpoint.full_model_state_dict(self.model)  # collective: every rank
        _compat.trainer_save(self, output_dir or self.args.output_dir, state_dict)

    def _save_optimizer_and_scheduler(self, output_dir):  # private Trainer hook, pinned in test_compat
        if not checkpoint.is_sharded(self.model):
            return super()._save_optimizer_and_scheduler(output_dir)
        state = checkpoint.full_optimizer_state_dict(self.model, _compat.unwrap_optimizer(self.optimizer))
        if self.args.should_save:
            torch.save(state, os.path.join(output_dir, _compat.OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _compat.SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint_dir):  # private Trainer hook, pinned in test_compat
        if checkpoint_dir is None:
            return None
        if not checkpoint.is_sharded(self.model):
            if self.args.device.type == "cpu" and self.args.world_size > 1 and not self.is_fsdp_enabled:
                # transformers 5.17 maps the optimizer state to args.device, "cpu:0" under a CPU process
                # group, which torch.load cannot restore; the state is the same on every rank: load on "cpu"
                optimizer_file = os.path.join(checkpoint_dir, _compat.OPTIMIZER_NAME)
                scheduler_file = os.path.join(checkpoint_dir, _compat.SCHEDULER_NAME)
                if os.path.isfile(optimizer_file) and os.path.isfile(scheduler_file):
                    self.optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu", weights_only=True))
                    self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
                return None
            return super()._load_optimizer_and_scheduler(checkpoint_dir)
        state = torch.load(os.path.join(checkpoint_dir, _compat.OPTIMIZER_NAME), weights_only=True)
        checkpoint.load_full_optimizer_state_dict(self.model, _compat.unwrap_optimizer(self.optimizer), state)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint_dir, _compat.SCHEDULER_NAME),
                                                     weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):  # private Trainer hook, pinned
        model = model if model is not None else self.model
        if not checkpoint.is_sharded(model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from safetensors.torch import load_file
        state_dict = load_file(os.path.join(resume_from_checkpoint, _compat.SAFE_WEIGHTS_NAME))
        checkpoint.load_full_model_state_dict(self.accelerator.unwrap_model(model), state_dict)

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

    def get_total_train_batch_size(self, args) -> int:
        # one replica counts once (transformers' own SP size is tied to accelerate's SP, whose dataloader
        # adapter changes the epoch length, so it stays 1 here)
        return super().get_total_train_batch_size(args) // self.layout.replica_size

    # ---- evaluation ---------------------------------------------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        self._eval_step_count += 1
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)

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
        gathered = self.accelerator.gather(data)
        world, replica = self.layout.world_size, self.layout.replica_size

        def one_per_replica(t):
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            blocks = t.reshape(world, -1, *t.shape[1:])  # rank-major blocks
            return blocks[::replica].reshape(-1, *t.shape[1:])

        data = recursively_apply(one_per_replica, gathered) if replica > 1 else gathered
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            data = recursively_apply(lambda t: t[:state.remainder], data)
        return data

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self.gather_function = self.accelerator.gather_for_metrics  # the Trainer resets it after the loop
        self._eval_step_count = 0
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                         metric_key_prefix)
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


class SequenceParallelTrainer(SequenceParallelMixin, Seq2SeqTrainer):
    """A `Seq2SeqTrainer` whose model is sequence-parallel over `args.sp_size` ranks.

    Builds the `ParallelLayout` from `args` (or takes `layout=`), patches the model if needed, and
    adapts data loading, loss, evaluation gathering and throughput metrics to SP groups. Works for
    causal LMs as well as encoder-decoder models. Generation (`predict_with_generate`) runs without
    SP: each rank of a group generates a slice of the group's batch and the slices are gathered in
    order.

    `eval_data_collator` collates evaluation and prediction batches (e.g. one sentence per row for
    generation while training on packed rows); `generation_kwargs_fn(inputs) -> dict` adds per-batch
    `generate` arguments (e.g. a length limit from each source's length).
    """

    def __init__(self, model=None, args: SequenceParallelArguments | None = None, *pargs,
                 layout: ParallelLayout | None = None, eval_data_collator=None, generation_kwargs_fn=None,
                 **kwargs):
        if args is None or not isinstance(args, SequenceParallelArguments):
            raise TypeError("SequenceParallelTrainer needs args=SequenceParallelArguments(...)")
        self.eval_data_collator, self.generation_kwargs_fn = eval_data_collator, generation_kwargs_fn
        self._setup_layout(model, args, layout)
        self._eval_batch_losses = []
        super().__init__(model, args, *pargs, **kwargs)
        # compute_loss normalises over the accumulated global batch itself (documented Trainer attributes)
        self.model_accepts_loss_kwargs = True
        self.loss_is_scaled_for_ga = True

    # ---- loss ---------------------------------------------------------------------------------------

    def _labelled_tokens(self, batches: list[dict]) -> torch.Tensor | None:
        """Labelled tokens of these batches over all data-parallel replicas (causal LMs: shifted)."""
        if not batches or "labels" not in batches[0]:
            return None
        shift = model_kind(self.accelerator.unwrap_model(self.model)) == "causal"
        count = sum(((b["labels"][..., 1:] if shift else b["labels"]) != IGNORE_INDEX).sum() for b in batches)
        count = torch.as_tensor(count, device=self.args.device)
        if group_size(self.layout.dp_group) > 1:
            dist.all_reduce(count, group=self.layout.dp_group)
        return count

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, self._labelled_tokens(batches)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """sum of token losses of this global batch / its labelled tokens, times dp_size: the Trainer
        and DDP average over the world, and the ranks of a replica already hold their replica's value."""
        if "labels" not in inputs:
            raise ValueError("SequenceParallelTrainer needs `labels` in the batch to compute a loss")
        if num_items_in_batch is None:
            num_items_in_batch = self._labelled_tokens([inputs])
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch,
                        label_smoothing=self.args.label_smoothing_factor)
        loss = outputs.loss * self.layout.dp_size
        return (loss, outputs) if return_outputs else loss

    # ---- evaluation ---------------------------------------------------------------------------------

    def _real_rows(self, batch_rows: int) -> int:
        """Rows of this rank's batch that are real examples: on the last global batch, accelerate
        fills the replicas' batches up by repeating examples from the start."""
        state = self.accelerator.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return batch_rows
        start = self.layout.dp_rank * self.args.eval_batch_size
        return max(0, min(batch_rows, state.remainder - start))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        self._eval_step_count += 1
        inputs = {k: v.to(self.args.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        labels = inputs.get("labels")
        loss = logits = None
        with torch.no_grad():
            if labels is not None:
                real = self._real_rows(labels.shape[0])
                counted = labels.clone()
                counted[real:] = IGNORE_INDEX  # repeated examples do not count in the loss
                forward_inputs = {**inputs, "labels": counted}
                loss, outputs = self.compute_loss(model, forward_inputs, return_outputs=True)
                loss = loss.detach()
                if group_size(self.layout.dp_group) > 1:  # the global batch's loss, on every rank
                    dist.all_reduce(loss, group=self.layout.dp_group)
                loss = loss / self.layout.dp_size
                self._eval_batch_losses.append(loss.item())
            else:
                outputs = model(**inputs) if not self.args.predict_with_generate or prediction_loss_only else None
            if not prediction_loss_only:
                if self.args.predict_with_generate:
                    logits = self._generate(inputs, gen_kwargs)
                else:
                    logits = gather_logits(self.accelerator.unwrap_model(model), outputs.logits)
        if prediction_loss_only:
            return loss, None, None
        return loss, logits, labels  # different lengths across batches and ranks are padded by the loop

    def _generate(self, inputs, gen_kwargs) -> torch.Tensor:
        """Generate without SP: this SP rank takes its slice of the group's batch; slices are
        gathered in order, so every rank of the group returns the whole batch's tokens."""
        if len(gen_kwargs) == 0:
            gen_kwargs = _compat.seq2seq_gen_kwargs(self)
        gen_kwargs = {k: v for k, v in gen_kwargs.items() if v is not None}
        generation_inputs = {k: v for k, v in inputs.items()
                             if k not in ("labels", "decoder_input_ids", "decoder_attention_mask")}
        rows = next(iter(generation_inputs.values())).shape[0]
        sp, rank = self.layout.sp_size, self.layout.sp_rank
        bounds = [rows * i // sp for i in range(sp + 1)]  # contiguous slices keep the order
        mine = {k: v[bounds[rank]:bounds[rank + 1]] for k, v in generation_inputs.items()}
        if self.generation_kwargs_fn is not None and bounds[rank + 1] > bounds[rank]:
            gen_kwargs = {**gen_kwargs, **self.generation_kwargs_fn(mine)}
        model = self.accelerator.unwrap_model(self.model)
        if self.layout.sizes.tp_size > 1:
            # Under TP the norms are sharded along the sequence, which one decoding step (1 token) cannot
            # be: generate with a plain copy holding the full weights (collective: every rank, here)
            model = _plain_copy(model)
        with fsdp.full_parameters(model):  # collective: every rank, before the ranks' generations diverge
            tokens = model.generate(**mine, **gen_kwargs) if bounds[rank + 1] > bounds[rank] else None
        if sp == 1:
            return tokens
        pieces = [None] * sp
        dist.all_gather_object(pieces, None if tokens is None else tokens.cpu(), group=self.layout.sp_group)
        pieces = [p for p in pieces if p is not None]
        width = max(p.shape[-1] for p in pieces)
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        pieces = [torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=pad) for p in pieces]
        return torch.cat(pieces).to(self.args.device)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self._eval_batch_losses = []
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                         metric_key_prefix)
        losses = np.array(self._eval_batch_losses)
        if f"{metric_key_prefix}_loss" in output.metrics and losses.size:
            # One process averages its batches' losses with equal weight; each of our steps is one
            # global batch, whose loss is the same on every rank.
            finite = np.isfinite(losses)
            if self.args.logging_nan_inf_filter and finite.any():
                losses = losses[finite]
            output.metrics[f"{metric_key_prefix}_loss"] = float(losses.mean())
        return output


def _plain_copy(model):
    """An unpatched, non-parallel copy of a tensor-parallel model with its full weights (for generation)."""
    import copy as _copy

    from ..models.patch import _state_of

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # full on every rank
    config = _copy.deepcopy(model.config)
    patched = _state_of(model)
    plain = type(model)(config)
    plain.set_attn_implementation(patched.attn_implementation if patched is not None else "sdpa")
    plain.load_state_dict(state, strict=False)
    plain.generation_config = _copy.deepcopy(model.generation_config)
    return plain.to(next(model.parameters()).device).eval()
