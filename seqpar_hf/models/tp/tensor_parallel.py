"""Megatron-style tensor + sequence parallelism (Korthikanti et al. 2022, arXiv 2205.05198) on torch's
DTensor tensor-parallel API, composed with Ulysses / ring.

Inside a TP group of t ranks (the "tp" dim of the layout's mesh):
- attention q/k/v and MLP up projections are column-parallel (each rank holds heads/t, ffn/t), the
  attention output and MLP down projections row-parallel;
- the regions TP leaves replicated (layer norms, dropout, residual adds) are sharded along the
  sequence: the residual stream of a rank is [b, s/(sp t), h]. Before an attention or MLP block the
  sequence is all-gathered over the TP group, after it the row-parallel projection reduce-scatters
  it back (`RowwiseParallel(output_layouts=Shard(1))`), which replaces TP's all-reduce. The gathered
  input is saved for the backward as the slice and gathered again there (`regather`);
- attention then runs on the rank's heads over its SP shard, so Ulysses / ring split the local
  heads (heads/t) over the SP group: TP inside, SP outside.

Embeddings and the LM head:
- decoder-only models: vocab-parallel, as Megatron does (`RowwiseParallel` embedding, `ColwiseParallel`
  head gathering the logits): the largest matrices of a model with a 100K+ vocabulary split t ways.
- encoder-decoder models: replicated. One embedding matrix is shared by the encoder, the decoder and
  the LM head, and added to absolute positions; kept whole (translation vocabularies are small), the
  embedding region runs on every TP rank and the first layer takes its sequence slice.

Plans come from the model's structure (transformers' `base_model_tp_plan` where it has one); layouts
that cannot work are refused with the numbers and the fix before any collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..families import ModelFamily
from . import regather

# transformers' plan strings this module implements (others are refused, naming the entry)
_COLWISE, _ROWWISE, _REPLICATED = "colwise", "rowwise", "replicated_with_grad_allreduce"


def _refuse(why: str, fix: str):
    raise ValueError(f"tensor parallelism: {why}. {fix}")


class _GatherSequence:
    """Forward pre-hook of an attention (or MLP) block: the named inputs, this rank's sequence slice
    [b, s/t, h], become the block's whole sequence as a replicated DTensor (one all-gather over the
    TP group; its backward reduce-scatters). Handles positional and keyword inputs. While the block
    runs, what it saves of the gathered inputs is kept as the slice and gathered again in the
    backward (`regather.BlockScope`, left by `_LeaveBlock`)."""

    def __init__(self, mesh, positions: tuple[int, ...] = (0,), names: tuple[str, ...] = ("hidden_states",)):
        self.mesh, self.positions, self.names = mesh, positions, names
        self.scopes: list[regather.BlockScope | None] = []

    def _gather(self, x, scope):
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        full = regather.gather(x, self.mesh)
        if scope is not None:
            scope.add(x, full)
        return full

    def __call__(self, module, args, kwargs):
        scope = regather.BlockScope() if torch.is_grad_enabled() else None
        args = tuple(self._gather(a, scope) if i in self.positions else a for i, a in enumerate(args))
        for name in self.names:
            if name in kwargs:
                kwargs[name] = self._gather(kwargs[name], scope)
        self.scopes.append(scope.__enter__() if scope is not None and scope.sources else None)
        return args, kwargs


class _LeaveBlock:
    """Forward hook (also when the forward raises) ending the block's `regather.BlockScope`."""

    def __init__(self, gather: _GatherSequence):
        self.gather = gather

    def __call__(self, module, args, kwargs, output):
        scope = self.gather.scopes.pop() if self.gather.scopes else None
        if scope is not None:
            scope.__exit__(None, None, None)


def _gather_block(module, mesh, names: tuple[str, ...]) -> None:
    hook = _GatherSequence(mesh, (0,), names)
    # prepend: before a parallel style's own input hook on the same module (fc1 is a ColwiseParallel linear)
    module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    module.register_forward_hook(_LeaveBlock(hook), with_kwargs=True, always_call=True)


class _SliceSequence:
    """Forward pre-hook of the first layer of a stack whose embedding region is replicated: keep this
    rank's slice of the sequence (backward: all-gather of the gradient)."""

    def __init__(self, mesh):
        self.mesh = mesh

    def __call__(self, module, args, kwargs):
        x = args[0]
        local = (
            DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
            .redistribute(self.mesh, [Shard(1)])
            .to_local()
        )
        return (local, *args[1:]), kwargs


class AllReduceGrad:
    """Gradient hook of a replicated parameter used on the rank's heads only (q/k norms): sum over TP."""

    def __init__(self, group):
        self.group = group

    def __call__(self, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=self.group)
        return grad


def _check_sizes(family: ModelFamily, tp: int, ulysses: int) -> None:
    config = family.pretrained.config
    for site in family.attention:
        if site.heads % tp or site.kv_heads % tp:
            _refuse(
                f"{site.name} has {site.heads} query and {site.kv_heads} key/value heads, not divisible by "
                f"tp_size={tp}",
                f"pick a tp_size dividing {site.kv_heads}",
            )
        if site.heads // tp < ulysses:
            _refuse(
                f"{site.name} keeps {site.heads // tp} heads per TP rank, fewer than the {ulysses} Ulysses ranks "
                "that split them",
                "use mode='ring' (or hybrid with a larger ring_size) or a smaller tp_size",
            )
    for name in ("intermediate_size", "encoder_ffn_dim", "decoder_ffn_dim"):
        width = getattr(config, name, None)
        if isinstance(width, int) and width % tp:
            _refuse(f"{name}={width} is not divisible by tp_size={tp}", "pick a tp_size that divides it")


def _layer_stacks(family: ModelFamily):
    return [s for s in family.layer_stacks if isinstance(getattr(s, "layers", None), nn.ModuleList)]


def decoder_only_plan(family: ModelFamily, group) -> dict:
    """Plan for a decoder-only backbone from transformers' `base_model_tp_plan`, with the sequence-
    parallel norm regions added."""
    config = family.pretrained.config
    base = getattr(config, "base_model_tp_plan", None) or {}
    if not base:
        _refuse(
            f"{type(family.pretrained).__name__} has no tensor-parallel plan in transformers",
            "use tp_size=1 (Ulysses / ring work for it)",
        )
    plan: dict[str, ParallelStyle] = {}
    for key, style in base.items():
        if key == "embed_tokens":  # transformers 5.17 adds it for tied embeddings; parallelised below (vocab-parallel)
            continue
        if style == _COLWISE:
            plan[key] = ColwiseParallel()
        elif style == _ROWWISE:
            plan[key] = RowwiseParallel(output_layouts=Shard(1))
        elif style != _REPLICATED:
            _refuse(
                f"{type(family.pretrained).__name__}'s plan entry {key!r}: {style!r} (fused or expert weights) is not "
                "supported",
                "use tp_size=1 (Ulysses / ring and FSDP work for it)",
            )
    return plan


def check(family: ModelFamily, layout) -> None:
    """Refuse a layout that cannot work, before anything is changed."""
    tp = layout.sizes.tp_size
    _check_sizes(family, tp, layout.ulysses_size)
    if family.kind == "causal":
        decoder_only_plan(family, None)
    else:
        for stack in _layer_stacks(family):
            for layer in stack.layers:
                if not (hasattr(layer, "fc1") and hasattr(layer, "fc2") and hasattr(layer, "self_attn")):
                    _refuse(
                        f"{type(layer).__name__} is not an encoder-decoder layer with self_attn, fc1 and fc2",
                        "use tp_size=1",
                    )


def parallelize(family: ModelFamily, layout) -> None:
    """Apply tensor + sequence parallelism over `layout.mesh["tp"]` to the model, in place. Call
    `check` first."""
    mesh = layout.mesh["tp"]
    backbone, pretrained = family.backbone, family.pretrained
    stacks = _layer_stacks(family)
    norm_types = (nn.LayerNorm,)

    def is_norm(module):
        return isinstance(module, norm_types) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))

    if family.kind == "causal":
        plan = decoder_only_plan(family, layout.tp_group)
        parallelize_module(backbone, mesh, plan, src_data_rank=None)
        embed = backbone.get_input_embeddings()
        parallelize_module(
            embed, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), src_data_rank=None
        )
        if family.has_lm_head:
            head = pretrained.get_output_embeddings()
            tied = head.weight is embed.weight or getattr(pretrained.config, "tie_word_embeddings", False)
            # input: the backbone's output, whole over the TP group (see gather_tp); logits replicated
            parallelize_module(head, mesh, ColwiseParallel(output_layouts=Replicate()), src_data_rank=None)
            if tied:
                embed.weight = head.weight  # both Shard(0) over the vocabulary: the tie survives
        for key, style in (getattr(pretrained.config, "base_model_tp_plan", None) or {}).items():
            if style == _REPLICATED:  # per-head norms (Qwen3 q_norm / k_norm): each rank sees its heads only
                for name, module in backbone.named_modules():
                    if _matches(name, key):
                        for p in module.parameters():
                            p.register_hook(AllReduceGrad(layout.tp_group))
    else:
        for stack in stacks:
            for layer in stack.layers:
                for name, child in layer.named_children():
                    if name in ("self_attn", "encoder_attn"):
                        for proj in ("q_proj", "k_proj", "v_proj"):
                            parallelize_module(getattr(child, proj), mesh, ColwiseParallel(), src_data_rank=None)
                        out = "out_proj" if hasattr(child, "out_proj") else "o_proj"
                        parallelize_module(
                            getattr(child, out), mesh, RowwiseParallel(output_layouts=Shard(1)), src_data_rank=None
                        )
                        names = ("hidden_states", "key_value_states") if name == "encoder_attn" else ("hidden_states",)
                        _gather_block(child, mesh, names)
                    elif name == "fc1":
                        parallelize_module(child, mesh, ColwiseParallel(), src_data_rank=None)
                        _gather_block(child, mesh, ("input",))
                    elif name == "fc2":
                        parallelize_module(child, mesh, RowwiseParallel(output_layouts=Shard(1)), src_data_rank=None)
            stack.layers[0].register_forward_pre_hook(_SliceSequence(mesh), with_kwargs=True)
        # the replicated LM head gets the backbone's output whole over the TP group (see gather_tp)
    # the sequence-parallel regions: every norm inside the layers, and the stacks' final norms
    for stack in stacks:
        for layer in stack.layers:
            for child in layer.children():
                if is_norm(child):
                    parallelize_module(child, mesh, SequenceParallel(use_local_output=True), src_data_rank=None)
        for name, child in stack.named_children():
            if name != "layers" and is_norm(child) and not name.startswith(("layernorm_embedding", "embed")):
                parallelize_module(child, mesh, SequenceParallel(use_local_output=True), src_data_rank=None)
    if family.kind == "causal":
        for stack in stacks:
            for layer in stack.layers:
                mlp = getattr(layer, "mlp", None)
                if mlp is not None:
                    _gather_block(mlp, mesh, ("hidden_states", "x"))
                attn = getattr(layer, "self_attn", None)
                if attn is not None:
                    _gather_block(attn, mesh, ("hidden_states",))


def gather_tp(x: torch.Tensor, mesh) -> torch.Tensor:
    """This rank's sequence slice [b, s/t, ...] -> the whole (SP-local) sequence [b, s, ...] as a plain
    tensor on every TP rank (backward: this rank's slice of the gradient, which is the same on every
    TP rank because what follows is replicated)."""
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _matches(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatch(name, pattern)
