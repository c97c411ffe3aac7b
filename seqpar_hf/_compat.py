"""The one place where seqpar_hf reaches private attributes of torch, transformers or accelerate.

Each access has a reason and a test in `tests/test_compat.py` that needs no process group, so an
upgrade that removes one fails there, by name, rather than in the middle of a run.
"""

from __future__ import annotations

import warnings

import torch

# --- torch -------------------------------------------------------------------------------------


def init_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def flatten_mesh(mesh, dims: tuple[str, ...], name: str):
    """`mesh[dims]` as one named dim (what torchtitan does for FSDP over dp x cp). Private in torch
    2.11-2.14 (`DeviceMesh._flatten`), with no public equivalent that keeps the name on the root mesh."""
    return mesh[dims]._flatten(name)


def outer_saved_tensors_hooks():
    """(pack, unpack) of the saved-tensors hooks active now (activation checkpointing's, a profiler's),
    or None. The TP re-gather (`models/tp/regather.py`) installs hooks of its own inside a block and hands
    every tensor it does not handle to these; torch has no public getter."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def group_timeout(group):
    """The timeout of a process group's collectives (None: unknown). torch has a public setter
    (`ProcessGroup.set_timeout`) but no getter: read from the backend's options (`Options._timeout`)."""
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def tensor_version(t: torch.Tensor) -> int:
    """A tensor's in-place modification counter (`Tensor._version`): the dry run tells which projections
    a model writes in place."""
    return t._version


# Private aten attention ops used by the ring blocks (forward returning the log-sum-exp, and the
# backward taking it). Checked once; without them the blocks use the math path, with one warning.
_RING_OPS = {
    "cpu": ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"),
    "cuda": ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"),
}
_checked: dict[str, tuple | None] = {}


def ring_kernel_ops(device_type: str):
    """(forward op, backward op) of the fused attention kernel for `device_type`, or None (math path)."""
    if device_type not in _checked:
        names = _RING_OPS.get(device_type)
        ops = None
        if names is not None:
            try:
                ops = tuple(getattr(torch.ops.aten, n) for n in names)
            except (AttributeError, RuntimeError):
                warnings.warn(
                    f"seqpar_hf: torch {torch.__version__} has no {names[0]}; ring attention on "
                    f"{device_type} uses the (slower, exact) math path",
                    stacklevel=2,
                )
        _checked[device_type] = ops
    return _checked[device_type]


_VARLEN: list = []


def varlen_attention():
    """torch's varlen flash kernel (`torch.nn.attention.varlen.varlen_attn`, public from 2.10) when it
    takes `scale` and `window_size` (2.11 on; 2.10's takes only `is_causal`), else None: packed
    attention then goes by document. Checked once."""
    if not _VARLEN:
        fn = None
        try:
            import inspect

            from torch.nn.attention.varlen import varlen_attn

            params = inspect.signature(varlen_attn).parameters
            if "scale" in params and "window_size" in params:
                fn = varlen_attn
        except (ImportError, ValueError, TypeError):
            pass
        _VARLEN.append(fn)
    return _VARLEN[0]


# --- accelerate ----------------------------------------------------------------------------------


def is_prepared_data_loader(data_loader) -> bool:
    """accelerate marks loaders it already prepared (`_is_accelerate_prepared`); preparing one again
    would shard it twice."""
    return bool(getattr(data_loader, "_is_accelerate_prepared", False))


def register_data_loader(accelerator, data_loader) -> None:
    """accelerate keeps the loaders it prepared in `Accelerator._dataloaders` (for checkpointing their
    state and for `gradient_state`); a loader prepared here must be registered the same way."""
    if data_loader not in accelerator._dataloaders:
        accelerator._dataloaders.append(data_loader)


# --- transformers ----------------------------------------------------------------------------------


def attn_implementation(config) -> str | None:
    """The attention implementation a model's config selects (`PretrainedConfig._attn_implementation`;
    transformers has a setter, `set_attn_implementation`, but no public getter)."""
    return config._attn_implementation


def set_attention(pretrained, backbone, name: str) -> None:
    """Make `name` the attention implementation of the backbone's layers: of the whole model where they
    share its config, else of the backbone's sub-config alone (a multimodal model's text model: its vision
    tower keeps its own attention). `set_attn_implementation` takes a nested dict keyed by sub-config."""
    value: str | dict = name
    for key in reversed(_sub_config_path(pretrained.config, getattr(backbone, "config", None)) or []):
        value = {key: value}
    pretrained.set_attn_implementation(value)


def backbone_attn_implementation(pretrained, backbone) -> str | None:
    """The attention implementation the backbone's layers run (`set_attention`'s scope)."""
    path = _sub_config_path(pretrained.config, getattr(backbone, "config", None))
    return attn_implementation(backbone.config if path else pretrained.config)


def _sub_config_path(top, config) -> list[str] | None:
    """The sub-config keys from `top` to `config` (the same object), None where it is not one of them."""
    queue: list[tuple[object, list[str]]] = [(top, [])]
    while queue:
        current, path = queue.pop(0)
        for key in getattr(current, "sub_configs", {}) or {}:
            sub = getattr(current, key, None)
            if sub is None:
                continue
            if sub is config:
                return [*path, key]
            queue.append((sub, [*path, key]))
    return None


def original_attention_function(module, implementation: str):
    """The attention function `module` runs under `implementation`, as its own forward picks it:
    `ALL_ATTENTION_FUNCTIONS.get_interface(name, eager_attention_forward)`, where "eager" is the function
    of that name in the module's modeling file (a transformers convention, not an exported name)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if implementation == "eager" and eager is None:
        raise NotImplementedError(f"{type(module).__name__}: no eager_attention_forward in its modeling file")
    # eager is None only for another implementation, which transformers then finds registered (or raises)
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)  # type: ignore[arg-type]


def prepare_generation_config(model, generation_config, kwargs: dict):
    """(the generation config `generate` will run with, the model kwargs left over):
    `GenerationMixin._prepare_generation_config`, which merges the call's arguments, the given config,
    the model's and transformers' defaults the way `generate` does."""
    return model._prepare_generation_config(generation_config, **kwargs)


def seq2seq_gen_kwargs(trainer) -> dict:
    """`Seq2SeqTrainer._gen_kwargs`: the generation kwargs `evaluate`/`predict` were called with."""
    return dict(getattr(trainer, "_gen_kwargs", None) or {})


# Trainer internals for checkpoints of DTensor models (tensor parallelism, FSDP2): the Trainer's own
# paths assume DDP / accelerate's FSDP plugin; and for checkpoints written under a temporary name, whose
# failed writes are reported on every rank, and whose missing weights are an error on resume
# (training/saving.py: `_save_checkpoint` writes to `_get_output_dir(trial)` / `checkpoint-<step>`).
# Overridden in SequenceParallelMixin; pinned by name and signature in tests/test_compat.py.
TRAINER_CHECKPOINT_HOOKS = (
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
    "_load_from_checkpoint",
    "_save",
    "_save_checkpoint",
    "_get_output_dir",
    "_save_scaler",
    "_save_rng_state",
    "_issue_warnings_after_load",
)
OPTIMIZER_NAME, SCHEDULER_NAME, SAFE_WEIGHTS_NAME = "optimizer.pt", "scheduler.pt", "model.safetensors"
TRAINER_STATE_NAME = "trainer_state.json"


def trainer_save(trainer, output_dir: str, state_dict: dict) -> None:
    """`Trainer._save(output_dir, state_dict)`: save_pretrained + tokenizer + training args (rank 0)."""
    trainer._save(output_dir, state_dict=state_dict)


def trl_tokenizer(trainer):
    """TRL's GRPO / RLOO trainers keep the tokenizer of their processing class in `_tokenizer` (a processor's
    own tokenizer for multimodal models): the pad id the group's rows are padded with."""
    return trainer._tokenizer


def unwrap_optimizer(optimizer):
    """accelerate's `AcceleratedOptimizer` keeps the torch optimizer in `.optimizer`."""
    return getattr(optimizer, "optimizer", optimizer)
