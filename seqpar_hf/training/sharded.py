"""Models whose parameters are DTensors (tensor parallelism, FSDP2) in the Trainer: no DDP wrapper (the
gradients are averaged over dp x sp here, or by FSDP), their gradient norm per device mesh, and plain,
full checkpoints (`checkpoint`) instead of the Trainer's DDP / accelerate-FSDP paths."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import _compat
from . import checkpoint, fsdp


class ShardedModelMixin:
    """The DTensor parts of `SequenceParallelMixin`; every method falls back to the Trainer's for plain models."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        # a model with DTensor parameters (tensor parallelism) cannot go into DDP: the gradients are
        # averaged over the replicas here instead (training_step)
        prepare_model = self.accelerator.prepare_model

        def prepare(model, device_placement=None, evaluation_mode=False):
            if checkpoint.is_sharded(model):
                evaluation_mode = True  # accelerate's own words for "no DDP wrapper"
            return prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

        self.accelerator.prepare_model = prepare

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

    # ---- gradient norm ------------------------------------------------------------------------------

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

    # ---- checkpoints: plain, full ones --------------------------------------------------------------

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
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint_dir, _compat.SCHEDULER_NAME), weights_only=True)
        )

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):  # private Trainer hook, pinned
        model = model if model is not None else self.model
        if not checkpoint.is_sharded(model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from safetensors.torch import load_file

        state_dict = load_file(os.path.join(resume_from_checkpoint, _compat.SAFE_WEIGHTS_NAME))
        checkpoint.load_full_model_state_dict(
            self.accelerator.unwrap_model(model), state_dict, f"the checkpoint {resume_from_checkpoint}"
        )
