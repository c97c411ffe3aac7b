"""TRL's `GRPOTrainer` and `RLOOTrainer` with sequence parallelism (TRL itself refuses SP / CP for both).

    from seqpar_hf.training.trl import SequenceParallelGRPOConfig, SequenceParallelGRPOTrainer

    args = SequenceParallelGRPOConfig(output_dir="out", sp_size=2, ...)   # + every GRPOConfig field
    trainer = SequenceParallelGRPOTrainer(model=model, reward_funcs=..., args=args, train_dataset=...)

An SP group is one data-parallel replica: its ranks read the same generation batch. Scoring it (TRL's
`_generate_and_score_completions`) runs on each rank's contiguous slice of its rows, as if every rank
were one of TRL's processes: the slice is generated (transformers `generate` on the plain model),
decoded and rewarded once, and TRL's own gathers over the world put rewards, group advantages and the
logged metrics together for the whole global batch. The forwards that score log-probabilities (old
policy, reference) run sequence-parallel on the group's rows. The scored slices are then gathered into
the group's batch, and every rank computes TRL's loss on it, from the gathered backbone outputs (the
model is patched with `lm_loss=False`, as for SFT / DPO), with the accelerator seen as one process per
replica (`rl_batches.ReplicaAccelerator`). So loss, gradients and every metric are those of one process
holding the replica's batch. How it works, and its limits: README "GRPO and RLOO".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from accelerate.utils import set_seed
from transformers import ProcessorMixin
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

from .. import _compat
from ..models.forward.rng import per_rank_stream
from ..models.patch import is_patched, original_attn_implementation, patch_model, sp_disabled
from ..parallel.layout import ParallelLayout
from . import fsdp
from .arguments import SequenceParallelFields, patch_options
from .replica import ReplicaMixin, one_per_replica
from .rl_batches import ReplicaAccelerator, check_same_prompts, gather_rows, group_rows, rank_rows, sync_rng
from .trainer import SequenceParallelMixin


class _ReplicasAsProcesses(SequenceParallelFields):
    """TRL sizes the generation batch from `world_size` processes (per_device x processes x
    steps_per_generation); under SP a replica of sp x tp ranks is one of them."""

    _replicas_only = False

    @property
    def world_size(self):
        world = super().world_size
        return world // (self.sp_size * self.tp_size) if self._replicas_only else world

    def _post_init_rl(self, trl_post_init):
        self._post_init_layout()
        self._replicas_only = True
        try:
            trl_post_init()
        finally:
            self._replicas_only = False
        self._validate_layout()
        check_rl_args(self)


def check_rl_args(args) -> None:
    """Refuse, before any collective, what the SP GRPO / RLOO trainers cannot do."""
    name = type(args).__name__
    if args.tp_size > 1:
        raise ValueError(
            f"{name}: tp_size={args.tp_size} is not supported: each rank generates its slice with the "
            "plain model, which needs the full weights (a gathered copy per generation); use tp_size=1"
        )
    if args.use_vllm:
        raise ValueError(
            f"{name}: use_vllm=True (vllm_mode={args.vllm_mode!r}) is not supported with sp_size={args.sp_size}. "
            "Generation runs on each rank's slice of its SP group's rows with transformers `generate`; with vLLM the "
            "slices would go to the server once (server mode: gathered over the world, each completion once) or to "
            "an engine per rank (colocate mode: sp engines per replica, each holding the whole model), and the weight "
            "sync and importance-sampling correction are untested here. Set use_vllm=False"
        )
    if args.use_transformers_continuous_batching:
        raise ValueError(
            f"{name}: use_transformers_continuous_batching=True is not supported with SP (its paged "
            "attention forward bypasses the SP patch); set it to False to generate with `generate`"
        )
    if fsdp.fsdp_requested(args) or args.deepspeed:
        raise ValueError(
            f"{name}: FSDP / DeepSpeed are not supported with the SP GRPO / RLOO trainers yet: each rank "
            "generates its own slice, which would need the full parameters gathered per generation; "
            "train with DDP (the default)"
        )
    rows = args.per_device_train_batch_size * args.steps_per_generation
    if rows % args.sp_size:
        raise ValueError(
            f"{name}: a replica's generation batch (per_device_train_batch_size x steps_per_generation = "
            f"{args.per_device_train_batch_size} x {args.steps_per_generation} = {rows} rows) must be a multiple of "
            f"sp_size={args.sp_size}: each rank of an SP group generates and rewards an equal slice of it. Change "
            "per_device_train_batch_size or steps_per_generation (gradient_accumulation_steps)"
        )
    if args.eval_strategy != "no" and args.per_device_eval_batch_size % args.sp_size:
        raise ValueError(
            f"{name}: per_device_eval_batch_size={args.per_device_eval_batch_size} must be a multiple "
            f"of sp_size={args.sp_size} (each rank of an SP group generates an equal slice)"
        )


def check_eval_rows(args, eval_dataset) -> None:
    """Each prompt of an evaluation set makes num_generations rows; they must fill whole global eval batches
    (accelerate would fill a partial one with repeated rows, splitting prompt groups, on some replicas only)."""
    if eval_dataset is None or args.eval_strategy == "no":
        return
    sets = eval_dataset if isinstance(eval_dataset, dict) else {"eval": eval_dataset}
    replicas = args.world_size // (args.sp_size * args.tp_size)
    batch = args.per_device_eval_batch_size * replicas
    for name, data in sets.items():
        rows = len(data) * (args.num_generations_eval or args.num_generations) if hasattr(data, "__len__") else 0
        if rows % batch:
            raise ValueError(
                f"{type(args).__name__}: eval set {name!r} makes {rows} rows ({len(data)} prompts x "
                f"num_generations), not a multiple of the global eval batch (per_device_eval_batch_size x "
                f"replicas = {args.per_device_eval_batch_size} x {replicas} = {batch}); trim the eval set "
                "or change per_device_eval_batch_size"
            )


@dataclass
class SequenceParallelGRPOConfig(_ReplicasAsProcesses, GRPOConfig):
    """`GRPOConfig` plus the parallel layout (`--sp_size`, `--sp_mode`, `--sp_ring_size`); batch sizes are per
    replica (SP group), as `per_device_*` are per process in TRL."""

    def __post_init__(self):
        self._post_init_rl(super().__post_init__)


@dataclass
class SequenceParallelRLOOConfig(_ReplicasAsProcesses, RLOOConfig):
    """`RLOOConfig` plus the parallel layout; batch sizes are per replica (SP group)."""

    def __post_init__(self):
        self._post_init_rl(super().__post_init__)


class _RLSequenceParallel(SequenceParallelMixin):
    """What GRPO and RLOO share: slice-wise scoring, the group's batch for the loss, the reference model."""

    _scoring = False  # True while this rank scores its slice of the group's rows
    # what GRPOTrainer / RLOOTrainer set and define, declared for the type check (a mixin sets nothing)
    args: Any  # a GRPOConfig or an RLOOConfig (each trainer declares its own)
    temperature: float
    ref_model: Any
    add_callback: Callable[..., None]

    def _init_rl(self, trl_init, model, args, layout, ref_model, processing_class, eval_dataset, config_class):
        if not isinstance(args, config_class):
            raise TypeError(f"{type(self).__name__} needs args={config_class.__name__}(...)")
        check_eval_rows(args, eval_dataset)
        if isinstance(processing_class, ProcessorMixin):
            raise ValueError(
                f"{type(self).__name__}: multimodal processors are not supported under SP (image inputs "
                "are not sliced per rank); pass a tokenizer"
            )
        if ref_model is not None and getattr(args, "cast_lm_head_to_fp32", False):
            raise ValueError(
                "cast_lm_head_to_fp32=True with ref_model=...: TRL casts only a reference it loads "
                "itself; pass ref_model=None (TRL loads it from the policy's path) or cast it yourself"
            )
        self._setup_layout(model, args, layout)  # collective from here on (process groups)
        beta, sync = args.beta, getattr(args, "sync_ref_model", False)  # RLOO has no sync_ref_model
        take_ref = ref_model is not None and beta != 0.0
        if take_ref:  # TRL would load its own reference from the policy's path: let it load none
            args.beta = 0.0
            if sync:
                args.sync_ref_model = False
        try:
            trl_init()
        finally:
            args.beta = beta
            if sync:
                args.sync_ref_model = sync
        if take_ref:
            self.beta = beta
            self._take_reference(ref_model, sync)
        if not is_patched(self.model):  # a model TRL loaded or wrapped itself: only the backbone is sharded
            patch_model(self.model, self.layout, lm_loss=False, **patch_options(args))
        if not take_ref and self.ref_model is not None and not is_patched(self.ref_model):
            # TRL loaded the reference from the policy's path, with the policy's (patched) attention: give it
            # the policy's original one and shard it too (a long sequence is why SP is on)
            reference = self.accelerator.unwrap_model(self.ref_model)
            reference.set_attn_implementation(original_attn_implementation(self.model) or "sdpa")
            patch_model(reference, self.layout, lm_loss=False)
        # TRL seeds every process differently; the ranks of a replica must draw alike (shuffling, LayerDrop),
        # and generation draws per rank from its own stream (per_rank_stream)
        set_seed(args.seed + self.layout.dp_rank)

    def _take_reference(self, ref_model, sync: bool):
        """What TRL does to a reference it loads: no dropout, the fused LM head, placed, optionally synced.
        A patched copy of the policy runs sequence-parallel; an unpatched model runs whole on each slice."""
        if self.args.disable_dropout:
            disable_dropout_in_model(ref_model)
        add_fused_lm_head(ref_model, temperature=self.temperature)
        self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)
        if sync:
            self.add_callback(SyncRefModelCallback(ref_model=self.ref_model, accelerator=self.accelerator))

    def _gather_replicas(self, data):
        # Eval rows come in whole global batches (check_eval_rows): nothing to drop. (accelerate's remainder
        # counts the dataset's prompts, not the num_generations rows TRL's RepeatSampler makes of each.)
        return one_per_replica(self.accelerator.gather(data), self.layout)

    def _get_eval_sampler(self, eval_dataset):
        # TRL's RepeatSampler (num_generations copies of each prompt), not ReplicaMixin's sequential sampler
        return super(ReplicaMixin, self)._get_eval_sampler(eval_dataset)

    # ---- scoring: each rank its slice, TRL's world-level gathers put the global batch together -------------

    def _generate_and_score_completions(self, inputs):
        check_same_prompts(inputs, self.layout, self.accelerator.device)
        self._scoring = True
        try:
            mine = super()._generate_and_score_completions(inputs[rank_rows(len(inputs), self.layout)])
        finally:
            self._scoring = False
        batch = gather_rows(
            mine, self.layout, _compat.trl_tokenizer(self).pad_token_id
        )  # the group's rows, on every rank
        sync_rng(self.layout, self.accelerator.device)
        return batch

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        # This rank's slice of its SP group's rows, on the plain model, from its own random stream. The seam
        # for generation under SP: a sharded prefill would gather the group's prompts here, generate them
        # together, and return this rank's rows.
        with per_rank_stream(self.layout.sp_rank, self.accelerator.device), sp_disabled(self.model):
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **kwargs
    ):
        if not (self._scoring and is_patched(model)):  # the loss's rows, or a reference run whole on each rank
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs
            )
        # a sequence-parallel model runs the group's rows on every rank of the group; keep this rank's
        ids, mask, width, mine = group_rows(
            input_ids, attention_mask, logits_to_keep, self.layout, _compat.trl_tokenizer(self).pad_token_id
        )
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(
            model, ids, mask, width, batch_size, **kwargs
        )
        crop = lambda t: None if t is None else t[mine, :logits_to_keep]  # [sp * b, C_max] -> [b, C]
        return crop(logps), crop(entropies), aux

    # ---- the loss: the group's rows on every rank, one process per replica ---------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        accelerator, self.accelerator = self.accelerator, ReplicaAccelerator(self.accelerator, self.layout)
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self.accelerator = accelerator


class SequenceParallelGRPOTrainer(_RLSequenceParallel, GRPOTrainer):
    """TRL's `GRPOTrainer`, sequence-parallel over `args.sp_size` ranks: loss, grad_norm, KL, clip ratios,
    entropy, rewards and advantages of one process holding each replica's batch, every `loss_type`, with
    `peft_config=`, gradient checkpointing, gradient accumulation and `num_iterations > 1`.
    `ref_model=`: a patched copy of the policy (sequence-parallel) or a separate model (run whole on each
    rank's slice); by default TRL's (loaded from the policy's path, then patched) or the PEFT base model."""

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: SequenceParallelGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        *pargs,
        ref_model=None,
        layout: ParallelLayout | None = None,
        **kwargs,
    ):
        def trl_init():
            GRPOTrainer.__init__(self, model, reward_funcs, args, train_dataset, eval_dataset, *pargs, **kwargs)

        self._init_rl(
            trl_init,
            model,
            args,
            layout,
            ref_model,
            kwargs.get("processing_class"),
            eval_dataset,
            SequenceParallelGRPOConfig,
        )


class SequenceParallelRLOOTrainer(_RLSequenceParallel, RLOOTrainer):
    """TRL's `RLOOTrainer`, sequence-parallel over `args.sp_size` ranks (see `SequenceParallelGRPOTrainer`)."""

    def __init__(
        self,
        model,
        reward_funcs,
        args: SequenceParallelRLOOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        *pargs,
        ref_model=None,
        layout: ParallelLayout | None = None,
        **kwargs,
    ):
        def trl_init():
            RLOOTrainer.__init__(self, model, reward_funcs, args, train_dataset, eval_dataset, *pargs, **kwargs)

        self._init_rl(
            trl_init,
            model,
            args,
            layout,
            ref_model,
            kwargs.get("processing_class"),
            eval_dataset,
            SequenceParallelRLOOConfig,
        )
