"""Per-instance state of a patched model: its layout and structure, the settings it was patched with, the
switches a forward reads, and the record of what `patch_model` changed (so that `unpatch_model` undoes
exactly that). One `PatchState` per patched model, reachable from the model, its transformers model and
its backbone (each patched attention module holds its own site: `sites`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ... import _compat
from ...memory.offload import LayerInputOffload, OffloadLayers
from ...parallel.layout import ParallelLayout
from ...parallel.sharding import ShardPlan
from ..families import ModelFamily, pad_token_id, unwrap
from . import front_masks
from .context import ForwardContext
from .loss import TILED_LOSS_CHUNK_ELEMENTS, TILED_LOSS_MIN_ELEMENTS
from .rng import LayerDropSync

ATTN_NAME = "seqpar_hf"  # the attention implementation a patched model's own config selects
ATTN_DECODE_NAME = "seqpar_hf_decode"  # selected while `generate` runs under SP (same attention, deferred masks)
_STATE = "_seqpar_state"  # on the patched model, its transformers model and its backbone


@dataclass(frozen=True)
class TiledLoss:
    """When the training loss runs the LM head in checkpointed chunks (see `seqpar_hf.models.forward.loss`)."""

    setting: bool | str = "auto"  # True, False, or "auto": when this rank's logits would hold >= min_elements
    min_elements: int = TILED_LOSS_MIN_ELEMENTS
    chunk_elements: int = TILED_LOSS_CHUNK_ELEMENTS


@dataclass(frozen=True)
class Request:
    """What a language-model forward asks of the backbone forward it runs: keep this rank's shard of the
    outputs (the caller computes the loss on it); `checked`: the batch was already compared across ranks."""

    checked: bool = True
    use_cache: bool = False  # the caller's, before the LM forward turned the cache off (packed rows depend on it)


class PatchState:
    def __init__(
        self,
        layout: ParallelLayout,
        family: ModelFamily,
        attn_implementation: str,
        check_inputs: bool,
        tiled: TiledLoss,
        requested: ParallelLayout | None = None,
    ):
        self.layout, self.family, self.attn_implementation = layout, family, attn_implementation
        # the layout patch_model was given: `layout` itself, or the mode="auto" layout `layout` was resolved from
        self.requested = requested if requested is not None else layout
        self.check_inputs, self.tiled = check_inputs, tiled
        self.pad_id = pad_token_id(family.pretrained.config)
        self.default_positions = family.default_positions  # the positions the backbone makes itself
        self.keep_ids = any(p.kind == "m2m100" for p in family.positions)
        # The sharded backbone forward running now. Position modules read it from their hooks: transformers
        # calls them with no way to pass the context along (the layers get it through their kwargs).
        self.active: ForwardContext | None = None
        self.mixers: dict = {}  # mixer path -> "heads" or why it runs whole (models/mixers/install.py)
        self.image_shards: list = []  # the vision towers encoding 1/sp of the images (forward/images.py)
        # Plans of the last forward's outputs when they were this rank's shard (None: returned whole), for
        # gather_logits / gather_sequence; set by whichever wrapper returned them to the caller.
        self.outputs: dict[str, ShardPlan] | None = None
        self.request: Request | None = None  # handed from the LM forward to the backbone forward, one call
        self.plain_depth = 0  # > 0 while running without SP (sp_disabled, tensor-parallel generation)
        # Sequence-parallel generation running now (`generation.decoding.DecodeSession`), and its current decoding step
        # (`generation.decoding.DecodeStep`, for attention modules that get no kwargs from their backbone)
        self.decoding = None
        self.step = None
        self.detached = False  # set by unpatch_model: wrappers someone still holds become pass-through
        self.hooks: list = []  # handles with remove(): the position modules' hooks, the memory options'
        self.offload: LayerInputOffload | None = None  # when the checkpointed layer inputs are offloaded
        self.tiled_mlps: list[str] = []  # the MLPs computed over sequence tiles (memory/tiled_mlp.py)
        self.tiled_mlp_setting = 0  # patch_model's tiled_mlp as a number (0: off), compared across the replica
        self.offload_layers: OffloadLayers | None = None  # the backbone's pre-hook installing it (memory/offload.py)
        self.replaced: list[tuple[object, str, bool, object]] = []  # (object, attribute, had one, previous value)
        self.layerdrop = LayerDropSync(family.layer_stacks)

    def __getstate__(self):  # deepcopy: a copy starts with no forward running
        return {**self.__dict__, "active": None, "outputs": None, "request": None, "decoding": None, "step": None}

    @contextlib.contextmanager
    def without_sp(self):
        """Run the plain model (its original attention implementation) on this rank's data."""
        model = self.family.pretrained
        if self.plain_depth == 0:
            _compat.set_attention(model, self.family.backbone, self.attn_implementation)
        self.plain_depth += 1
        try:
            yield
        finally:
            self.plain_depth -= 1
            if self.plain_depth == 0:
                name = ATTN_NAME if self.decoding is None else ATTN_DECODE_NAME
                _compat.set_attention(model, self.family.backbone, name)

    @contextlib.contextmanager
    def generating(self, session):
        """Run `generate` under SP: the decode implementation (sequence-parallel attention whose masks are
        built only where a decoding step needs the original ones) and the session, for this call."""
        model = self.family.pretrained
        _compat.set_attention(model, self.family.backbone, ATTN_DECODE_NAME)
        self.decoding = session
        try:
            yield
        finally:
            self.decoding = self.step = None
            _compat.set_attention(model, self.family.backbone, ATTN_NAME)

    @contextlib.contextmanager
    def stepping(self, step):
        previous, self.step = self.step, step
        try:
            yield
        finally:
            self.step = previous

    @contextlib.contextmanager
    def handing(self, request: Request):
        """Hand `request` to the next backbone forward (which takes it, for that call only)."""
        previous, self.request = self.request, request
        try:
            yield
        finally:
            self.request = previous

    def take_request(self) -> Request | None:
        request, self.request = self.request, None
        return request

    @contextlib.contextmanager
    def running(self, ctx: ForwardContext):
        previous, self.active = self.active, ctx
        token = front_masks.SHARDED.set(True)  # the masks made inside need none (`registry.sp_mask`)
        try:
            yield
        finally:
            front_masks.SHARDED.reset(token)
            self.active = previous


def state_of(model) -> PatchState | None:
    """The live patch state of a model (or of the transformers model inside a PEFT wrapper), or None."""
    for obj in (model, unwrap(model), getattr(unwrap(model), "base_model", None)):
        state = getattr(obj, _STATE, None) if obj is not None else None
        if state is not None and not state.detached:
            return state
    return None


def attach(state: PatchState, objects) -> None:
    for obj in {id(o): o for o in objects}.values():
        setattr(obj, _STATE, state)


def detach(state: PatchState, objects) -> None:
    for obj in objects:
        if getattr(obj, _STATE, None) is state:
            delattr(obj, _STATE)
