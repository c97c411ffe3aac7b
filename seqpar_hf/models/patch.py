"""The public API of the transformers adapter: patch one model instance so that it runs sequence-parallel,
and undo it.

Touches transformers only through public hooks, per instance, reversibly: an attention function and a
mask function registered under "seqpar_hf" (`registry`) and selected by this model's own copy of its
config; instance `forward` / `generate` wrappers (`forwards`, `generation`); forward hooks on position embeddings
(`positions`). Every piece is an object rather than a closure, so `copy.deepcopy` of a patched model is a
patched model on the same layout.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch

from .. import _compat
from ..attention.ulysses import split_heads
from ..memory.offload import LayerInputOffload, OffloadLayers
from ..memory.tiled_mlp import TiledMLPs
from ..parallel import announce, auto
from ..parallel.comm import all_gather_cat
from ..parallel.layout import ParallelLayout
from .families import ModelFamily
from .forward import images, positions
from .forward.forwards import BackboneForward, LMForward, Wrapper
from .forward.loss import TILED_LOSS_CHUNK_ELEMENTS, TILED_LOSS_MIN_ELEMENTS
from .forward.relative_bias import BiasSource
from .forward.sites import AttentionSite, LocalSite, set_site
from .forward.state import ATTN_NAME, PatchState, TiledLoss, attach, detach, state_of
from .generation.generate import GenerateSP
from .mixers import install as mixers
from .proof.inspection import inspect_model
from .proof.mlps import find_mlps
from .registry import register
from .tp import tensor_parallel, tp_checks


def patch_model(
    model,
    layout: ParallelLayout,
    check_inputs: bool = True,
    lm_loss: bool = True,
    tiled_loss: bool | str = "auto",
    tiled_min_elements: int = TILED_LOSS_MIN_ELEMENTS,
    tiled_chunk_elements: int = TILED_LOSS_CHUNK_ELEMENTS,
    offload_activations: bool = False,
    tiled_mlp: bool | int | str = False,
):
    """Make `model` (this instance) sequence-parallel over `layout`'s SP group and return it.

    `model` is a causal or encoder-decoder LM (or its backbone, or a PEFT model wrapping one). Every
    rank of an SP group must then pass the same, full batch; the model shards it along the sequence
    itself. With labels, `out.loss` is the loss of the group's full batch (the unpatched model's
    number) on every rank and `out.logits` is this rank's shard ([b, s_local, vocab], padding
    included; `gather_logits(model, out.logits)` returns the full logits). Without labels the outputs
    are the unpatched model's (full sequence). Gradients are complete once a data-parallel wrapper
    (DDP/FSDP/accelerate) averages them over the world. `check_inputs` verifies, with one tiny
    all-gather per forward, that the ranks of the group got the same batch, and raises on every rank
    otherwise. `lm_loss=False` leaves the language model's own forward alone (only the backbone is
    sharded, its outputs always gathered): for a model whose forward another library has replaced.
    `tiled_loss` (training with labels only): compute the LM head and cross-entropy over checkpointed
    chunks of `tiled_chunk_elements` logits of the labelled tokens, never holding this rank's
    [tokens, vocab] logits; `out.logits` is then None. "auto": when those logits would have at least
    `tiled_min_elements` (2^26) elements; True: always; False: never. Evaluation never tiles.
    A `mode="auto"` layout is resolved for this model's heads into a new layout (`layout_of(model)`; the
    reason is logged and kept in its `auto_choice`); `layout` itself stays as built.
    `offload_activations`: the layer inputs gradient checkpointing keeps go to host memory in the forward and
    come back for the backward's recompute (bit-identical; needs gradient checkpointing: a training forward
    without it raises). `tiled_mlp`: every layer's MLP runs over sequence tiles, its [tokens, ffn]
    intermediates one tile's (exact within fp32 rounding; `memory/tiled_mlp.py`): True (tiles of hidden-size
    tokens; refuses a layer whose MLP cannot be shown token-local), an int (tokens per tile), "auto" (where a
    rank's intermediate would hold >= 2^26 elements, MLPs that cannot be tiled left whole with a warning), or
    False (the default: a tiled MLP runs its forward once more in the backward, worth it only at lengths
    where the intermediates, not the layer inputs, are what does not fit).
    """
    state = state_of(model)
    if state is not None:
        if layout is state.layout or layout is state.requested:
            return model
        raise ValueError(
            f"this model is already patched with {state.layout}; call seqpar_hf.unpatch_model(model) "
            f"before patching it with {layout}"
        )
    requested, sizes = layout, layout.sizes
    split = sizes.sp_size * sizes.tp_size > 1
    family = inspect_model(model, split=split, ring=(sizes.ring_size or 1) > 1)  # ring_size None: mode "auto"
    # from here on, the layout this model runs on: mode "auto" resolved for its heads (a new layout)
    layout = auto.resolve(requested, [(site.heads, site.kv_heads) for site in family.attention])
    if layout is not requested and (layout.sizes.ring_size or 1) > 1:
        family = inspect_model(model, split=split, ring=True)  # "auto" chose a ring: prove its zigzag order too
    tp = layout.sizes.tp_size
    if tiled_loss not in (True, False, "auto"):
        raise ValueError(f"tiled_loss={tiled_loss!r}: use True, False or 'auto'")
    for name, value in (("tiled_min_elements", tiled_min_elements), ("tiled_chunk_elements", tiled_chunk_elements)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if tiled_loss is True and tp > 1:
        raise ValueError(
            f"tiled_loss=True with tp_size={tp}: the tiled loss does not work with a tensor-parallel LM "
            "head (a DTensor module; its logits are gathered whole on every TP rank); use "
            "tiled_loss='auto' (off under TP) or False"
        )
    _check_tiled_head(family, tiled_loss)
    mlps = _tiled_mlps(family, tiled_mlp, tp, offload_activations)
    if tp > 1 and family.mixers:
        name = sorted(family.mixers)[0]
        raise ValueError(
            f"seqpar_hf cannot shard {type(family.pretrained).__name__} with tensor parallelism: "
            f"{name} ({type(family.backbone.get_submodule(name)).__name__}) mixes tokens outside attention (a "
            "convolution or a scan), which seqpar_hf splits along the sequence or by heads over the SP group but "
            "not under tensor parallelism. Use tp_size=1 (sp_size alone splits it)"
        )
    if tp > 1:
        tensor_parallel.check(family, layout)
        tp_checks.check(family, layout)
        if any(site.bias is not None and site.bias[0] == "relative" for site in family.attention):
            raise ValueError(
                f"tp_size={tp}: {type(model).__name__}'s relative position bias is one table for all heads, which "
                "tensor parallelism would shard by head; use tp_size=1 (Ulysses, ring or hybrid)"
            )
    for site in family.attention:  # refuse head counts Ulysses cannot split (TP's share), before any forward
        split_heads(site.heads // tp, site.kv_heads // tp, layout.ulysses_size)
    decided = mixers.decide(family, layout)  # proven (or refused) before anything is patched
    register()
    pretrained = family.pretrained
    attn_implementation = _compat.backbone_attn_implementation(pretrained, family.backbone)
    assert attn_implementation is not None  # inspect_model checked it is one of ATTENTION_IMPLEMENTATIONS
    _own_config(pretrained)
    state = PatchState(
        layout,
        family,
        attn_implementation,
        check_inputs,
        TiledLoss(tiled_loss, tiled_min_elements, tiled_chunk_elements),
        requested,
    )
    for site in family.attention:
        assert site.q_side is not None and site.kv_side is not None  # along a sequence (else in local_attention)
        set_site(site.module, AttentionSite(state, site.name, site.q_side, site.kv_side, site.pattern, site.bias))
    for owner in {id(s.bias[1]): s.bias[1] for s in family.attention if s.bias and s.bias[0] == "relative"}.values():
        _replace(state, owner, "compute_bias", BiasSource(state, owner.compute_bias))  # relative position biases
    for site in family.local_attention:
        set_site(site.module, LocalSite(site.name, attn_implementation))
    state.hooks = positions.install(state, family, state.pad_id)
    state.mixers = mixers.install(state, family, layout, decided)
    state.image_shards = images.install(state, family, _replace)  # each rank encodes 1/sp of the images
    _install_memory(state, family, mlps, tiled_mlp, offload_activations)
    _replace(state, family.backbone, "forward", BackboneForward(state, family.backbone.forward))
    if family.has_lm_head and lm_loss:
        _replace(state, model, "forward", LMForward(state, model.forward))
        model.accepts_loss_kwargs = True  # the Trainer passes num_items_in_batch (its own attribute name)
    for obj in {id(o): o for o in (model, pretrained)}.values():
        if callable(getattr(obj, "generate", None)):
            _replace(state, obj, "generate", GenerateSP(state, obj.generate, outer=obj is not pretrained))
    attach(state, (model, pretrained, family.backbone))
    _compat.set_attention(pretrained, family.backbone, ATTN_NAME)
    if tp > 1:
        tensor_parallel.parallelize(family, layout)
        tp_checks.complete(family, layout, tensor_parallel.AllReduceGrad)
    announce.layout_applied(layout, model)
    return model


def unpatch_model(model):
    """Undo `patch_model`: the instance runs the plain transformers code again. Only what
    `patch_model` added is removed: a wrapper that another library installed over ours stays, and
    ours inside it becomes a pass-through."""
    state = state_of(model)
    if state is None:
        return model
    if state.layout.sizes.tp_size > 1:
        raise ValueError(
            "a tensor-parallel model cannot be unpatched in place (its weights are sharded over the TP "
            "group); save it with seqpar_hf.training.checkpoint.full_model_state_dict / the trainer's "
            "save_model and load the checkpoint into a fresh model"
        )
    family = state.family
    _compat.set_attention(family.pretrained, family.backbone, state.attn_implementation)
    for handle in state.hooks:
        handle.remove()
    state.layerdrop.remove()
    for site in family.attention + family.local_attention:
        set_site(site.module, None)
    for obj, name, had, previous in reversed(state.replaced):
        current = obj.__dict__.get(name)
        if isinstance(current, Wrapper) and current.state is state:
            if had:
                setattr(obj, name, previous)
            else:
                del obj.__dict__[name]
    if "accepts_loss_kwargs" in model.__dict__:
        del model.__dict__["accepts_loss_kwargs"]
    state.detached = True
    detach(state, (model, family.pretrained, family.backbone))
    return model


def is_patched(model) -> bool:
    return state_of(model) is not None


def sp_disabled(model):
    """Context manager: inside it, a patched model runs without SP on this rank's own data (its forward, and
    `generate`, which otherwise runs sequence-parallel on the group's full batch)."""
    state = state_of(model)
    return contextlib.nullcontext() if state is None else state.without_sp()


def gather_sequence(model, tensor: torch.Tensor, side: str = "decoder", dim: int = 1) -> torch.Tensor:
    """The full, unpadded sequence of an output of the last forward (e.g. logits [b, s_loc, V]), on
    every rank of the SP group; `side="encoder"` for encoder outputs. No gradient. Outputs that the
    forward already returned whole (no labels) are returned as they are."""
    state = state_of(model)
    if state is None or state.outputs is None:
        return tensor
    if side not in state.outputs:
        raise ValueError(f"no sharded {side!r} sequence in the last forward of this model")
    plan = state.outputs[side]
    return plan.unshard(all_gather_cat(tensor, state.layout.sp_group, dim), dim)  # [.., s/sp, ..] -> [.., s, ..]


def gather_logits(model, logits: torch.Tensor) -> torch.Tensor:
    """Full logits [b, s, V] from this rank's shard of the last forward's logits."""
    return gather_sequence(model, logits, "decoder")


def layout_of(model) -> ParallelLayout | None:
    """The layout a patched model runs on (for `mode="auto"`: the one chosen for this model, its reason in
    `.auto_choice`), or None if the model is not patched."""
    state = state_of(model)
    return None if state is None else state.layout


def family_of(model) -> ModelFamily:
    """The SP-relevant structure of a patched model (its backbone, layer stacks, attention modules)."""
    state = state_of(model)
    if state is None:
        raise ValueError("the model is not patched by seqpar_hf; call seqpar_hf.patch_model(model, layout) first")
    return state.family


def model_kind(model) -> str:
    """'seq2seq' or 'causal' for a patched model (which labels it shifts)."""
    state = state_of(model)
    if state is None:
        raise ValueError("the model is not patched by seqpar_hf")
    return state.family.kind


def original_attn_implementation(model) -> str | None:
    """The attention implementation a patched model had before patching (None: not patched)."""
    state = state_of(model)
    return None if state is None else state.attn_implementation


def _check_tiled_head(family: ModelFamily, tiled_loss) -> None:
    """The tiled loss reproduces what the forward does after the LM head only where the dry run proved it
    (models/forward/head.py); otherwise it is refused (True) or not used (auto, with a warning)."""
    if not family.has_lm_head or family.head_post is not None or tiled_loss is False:
        return
    why = (
        f"{type(family.pretrained).__name__}'s forward post-processes the LM head's output in a way the tiled loss "
        "does not reproduce (checked on the dry run's logits)"
    )
    if tiled_loss is True:
        raise ValueError(f"tiled_loss=True: {why}; use tiled_loss=False")
    warnings.warn(
        f"seqpar_hf: {why}; the loss is computed from full logits (tiled_loss='auto' does not tile this model)",
        stacklevel=3,
    )


def _tiled_mlps(family: ModelFamily, tiled_mlp, tp: int, offload_activations) -> list:
    """Validate the memory options; the MLPs to tile (models/proof/mlps.py)."""
    if not isinstance(offload_activations, bool):
        raise ValueError(f"offload_activations must be True or False, got {offload_activations!r}")
    is_int = isinstance(tiled_mlp, int) and not isinstance(tiled_mlp, bool)
    if not (
        isinstance(tiled_mlp, bool)
        or (isinstance(tiled_mlp, str) and tiled_mlp == "auto")
        or (is_int and tiled_mlp >= 1)
    ):
        raise ValueError(f"tiled_mlp={tiled_mlp!r}: use True, False, 'auto' or a positive number of tokens per tile")
    if tiled_mlp is False:
        return []
    mlps, skipped = find_mlps(family, required=tiled_mlp != "auto")
    if skipped:
        warnings.warn(f"seqpar_hf: tiled_mlp='auto' leaves these MLPs whole: {'; '.join(skipped)}", stacklevel=4)
    return mlps


def _install_memory(state: PatchState, family: ModelFamily, mlps: list, tiled_mlp, offload: bool) -> None:
    """The tiled MLPs and the offload of checkpointed layer inputs (seqpar_hf/memory/); undone by unpatch_model."""
    if mlps:
        tiled = TiledMLPs()
        tile = None if isinstance(tiled_mlp, bool) or isinstance(tiled_mlp, str) else int(tiled_mlp)
        state.tiled_mlp_setting = {True: -1, "auto": -2}.get(tiled_mlp, tile or 0)  # compared across the replica
        for _, module in mlps:
            width = max(size for p in module.parameters() for size in p.shape)  # the intermediate's width
            tiled.install(module, tile, tiled_mlp == "auto", width, state.layout.sizes.tp_size)
        state.tiled_mlps = [name for name, _ in mlps]
        state.hooks.append(tiled)
    if offload:
        layers = [m for m in family.backbone.modules() if hasattr(m, "gradient_checkpointing")]
        state.offload = LayerInputOffload()
        installer = state.offload_layers = OffloadLayers(state.offload, layers, type(family.pretrained).__name__)
        state.hooks.append(family.backbone.register_forward_pre_hook(installer, with_kwargs=True))
        state.hooks.append(installer)


def _replace(state: PatchState, obj, name: str, value) -> None:
    state.replaced.append((obj, name, name in obj.__dict__, obj.__dict__.get(name)))
    setattr(obj, name, value)


def _own_config(model):
    """Give the model its own config object, so switching its attention does not touch another
    model built from the same config."""
    old = model.config
    new = copy.deepcopy(old)
    # sub-configs too: a multimodal model's text and vision towers hold its text_config / vision_config
    pairs, queue = {id(old): new}, [(old, new)]
    while queue:
        a, b = queue.pop()
        for key in getattr(a, "sub_configs", {}) or {}:
            if getattr(a, key, None) is not None and id(getattr(a, key)) not in pairs:
                pairs[id(getattr(a, key))] = getattr(b, key)
                queue.append((getattr(a, key), getattr(b, key)))
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) in pairs:
            module.config = pairs[id(config)]
