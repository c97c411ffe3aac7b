"""Trainer integration: `SequenceParallelMixin` and `SequenceParallelTrainer`.

The ranks of one replica (an SP group, times TP when used) are one data-parallel replica (`replica`);
models with DTensor parameters get their gradients and checkpoints handled here (`sharded`).
`SequenceParallelMixin` does both for any transformers `Trainer` subclass (the TRL trainers in
`seqpar_hf.training.trl` use it); `SequenceParallelTrainer` adds a loss that is token-weighted over the
whole accumulated global batch, computed on each rank's shard of the logits, so every mix of gradient
accumulation, data parallelism and sequence parallelism logs the number one process with the same
global batch logs.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from transformers import Seq2SeqTrainer

from .. import _compat
from ..models.forward import labels as labels_
from ..models.forward.loss import global_batch_loss
from ..models.patch import gather_logits, is_patched, layout_of, model_kind, patch_model
from ..parallel import announce
from ..parallel.comm import group_size
from ..parallel.layout import ParallelLayout
from . import fsdp
from .arguments import SequenceParallelArguments, patch_options
from .generation import generate_in_slices, generate_under_sp, use_sp
from .replica import ReplicaMixin, check_same_arguments
from .saving import SafeCheckpointMixin, agree, attempt
from .sharded import ShardedModelMixin


class SequenceParallelMixin(ReplicaMixin, SafeCheckpointMixin, ShardedModelMixin):
    """Makes a replica of SP (x TP) ranks one data-parallel replica in any transformers `Trainer`.

    Put it before the Trainer class (`class MyTrainer(SequenceParallelMixin, Trainer)`) and call
    `self._setup_layout(model, args, layout)` before `Trainer.__init__`.
    """

    layout: ParallelLayout

    def _setup_layout(self, model, args, layout: ParallelLayout | None):
        if args is None or not hasattr(args, "sp_size"):
            raise TypeError(
                f"{type(self).__name__} needs sequence-parallel training arguments "
                "(SequenceParallelArguments, or the TRL configs in seqpar_hf.training.trl)"
            )
        _ = args.device  # sets up the process group when launched distributed (accelerate / torchrun)
        _honor_precision_flags(args)
        announce.show_in_runs(args.should_log)  # the layout line, as transformers shows its own logs
        # the Trainer creates output_dir on the saving rank only: an unwritable one is an error on every rank
        agree(
            attempt(os.makedirs, args.output_dir, exist_ok=True) if args.should_save else None,
            f"creating output_dir {args.output_dir!r}",
            args.device,
        )
        self.layout = layout or ParallelLayout(
            args.sp_size,
            args.sp_mode,
            args.sp_ring_size,
            args.tp_size,
            head_chunks=args.head_chunks(),
            mixer_split=getattr(args, "sp_mixer_split", "auto"),
        )
        check_same_arguments(args, args.device)  # after the layout's own check, which names its fields better
        # the layout's groups wait as long as the default group (ddp_timeout), not torch's 30 minutes
        if model is not None and not isinstance(model, str):
            if not is_patched(model):
                patch_model(model, self.layout, **patch_options(args))
            if self.layout.mode == "auto":  # the layout chosen for this model (an auto layout has no groups)
                self.layout = layout_of(model) or self.layout
        self.fsdp_summary = None
        if model is not None and not isinstance(model, str) and fsdp.fsdp_requested(args):
            # FSDP2 over dp x sp, also on CPU, where the Trainer would silently ignore the request
            self.fsdp_summary = fsdp.shard_model(model, self.layout)
        self._setup_replica()


def _honor_precision_flags(args) -> None:
    """TrainingArguments turns `bf16` / `fp16` into `mixed_precision` in `__post_init__`, and the Trainer's
    Accelerator reads only that: a flag set on the arguments afterwards would train in fp32 while the logs
    and the saved arguments say bf16. Set it now, before the Accelerator exists."""
    for flag in ("bf16", "fp16"):
        if getattr(args, flag, False) and getattr(args, "mixed_precision", flag) != flag:
            args.mixed_precision = flag
            return


class SequenceParallelTrainer(SequenceParallelMixin, Seq2SeqTrainer):
    """A `Seq2SeqTrainer` whose model is sequence-parallel over `args.sp_size` ranks.

    Builds the `ParallelLayout` from `args` (or takes `layout=`), patches the model if needed, and
    adapts data loading, loss, evaluation gathering and throughput metrics to SP groups. Works for
    causal LMs as well as encoder-decoder models. Generation (`predict_with_generate`, `--sp_generate`)
    runs under SP (every rank the whole batch, sources sharded along the sequence) or in slices (each rank
    some rows, without SP, gathered in order); `auto` picks SP for long sources.

    `eval_data_collator` collates evaluation and prediction batches (e.g. one sentence per row for
    generation while training on packed rows); `generation_kwargs_fn(inputs) -> dict` adds per-batch
    `generate` arguments (e.g. a length limit from each source's length).
    """

    args: SequenceParallelArguments  # (the Trainer sets it; its type narrowed for the type check)

    def __init__(
        self,
        model=None,
        args: SequenceParallelArguments | None = None,
        *pargs,
        layout: ParallelLayout | None = None,
        eval_data_collator=None,
        generation_kwargs_fn=None,
        **kwargs,
    ):
        if args is None or not isinstance(args, SequenceParallelArguments):
            raise TypeError("SequenceParallelTrainer needs args=SequenceParallelArguments(...)")
        self.eval_data_collator, self.generation_kwargs_fn = eval_data_collator, generation_kwargs_fn
        self._setup_layout(model, args, layout)
        self._eval_batch_losses: list[float] = []
        super().__init__(model, args, *pargs, **kwargs)
        # compute_loss normalises over the accumulated global batch itself (documented Trainer attributes)
        self.model_accepts_loss_kwargs = True
        self.loss_is_scaled_for_ga = True

    # ---- loss ---------------------------------------------------------------------------------------

    def _labelled_tokens(self, batches: list[dict]) -> torch.Tensor | None:
        """Labelled tokens of these batches over all data-parallel replicas (causal LMs: shifted)."""
        if not batches or "labels" not in batches[0]:
            return None
        kind = model_kind(self.accelerator.unwrap_model(self.model))
        count = torch.as_tensor(sum(labels_.count(kind, b["labels"]) for b in batches), device=self.args.device)
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
        """sum of token losses of this global batch / its labelled tokens (see `global_batch_loss`)."""
        if "labels" not in inputs:
            raise ValueError("SequenceParallelTrainer needs `labels` in the batch to compute a loss")
        if num_items_in_batch is None:
            num_items_in_batch = self._labelled_tokens([inputs])
        outputs = model(
            **inputs, num_items_in_batch=num_items_in_batch, label_smoothing=self.args.label_smoothing_factor
        )
        loss = global_batch_loss(outputs.loss, self.layout.dp_size)
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
                counted[real:] = labels_.IGNORE_INDEX  # repeated examples do not count in the loss
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

    def _generate(self, inputs, gen_kwargs) -> torch.Tensor | None:
        if len(gen_kwargs) == 0:
            gen_kwargs = _compat.seq2seq_gen_kwargs(self)
        gen_kwargs = {k: v for k, v in gen_kwargs.items() if v is not None}
        generation_inputs = {
            k: v for k, v in inputs.items() if k not in ("labels", "decoder_input_ids", "decoder_attention_mask")
        }
        model = self.accelerator.unwrap_model(self.model)
        if use_sp(self.layout, self.args.sp_generate, self.args.sp_generate_min_tokens, generation_inputs):
            return generate_under_sp(model, generation_inputs, gen_kwargs, self.generation_kwargs_fn)
        return generate_in_slices(
            model, self.layout, generation_inputs, gen_kwargs, self.generation_kwargs_fn, self.args.device
        )

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        self._eval_batch_losses = []
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        losses = np.array(self._eval_batch_losses)
        if f"{metric_key_prefix}_loss" in output.metrics and losses.size:
            # One process averages its batches' losses with equal weight; each of our steps is one
            # global batch, whose loss is the same on every rank.
            finite = np.isfinite(losses)
            if self.args.logging_nan_inf_filter and finite.any():
                losses = losses[finite]
            output.metrics[f"{metric_key_prefix}_loss"] = float(losses.mean())
        return output
