"""Masks a multimodal model's front prepares for its text model (Gemma 3: a full and a sliding mask in which
each image's tokens also see each other both ways), outside the sharded forward.

Under SP the mask function hands them out deferred (`decoding.DeferredMask`: its arguments, built only if
asked). The text model's sharded forward takes from them what they were made of: the padding mask and the
blocks that attend both ways, read off each mask function (`attention/mask_patterns.py` `read_blocks`) and
required to agree between the masks; the sharded attention applies them (`attention/masks.py`). A forward
that runs without SP (a cache its caller made) builds them with the model's own implementation instead.
"""

from __future__ import annotations

import contextvars
import inspect

import torch

from ...attention.mask_patterns import read_blocks
from ..generation.decoding import DeferredMask

SHARDED = contextvars.ContextVar("seqpar_hf_sharded", default=False)  # inside a sharded backbone forward


def _mask_interface(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None):
    """The arguments transformers passes a registered mask function (its names: `registry.sp_mask`)."""


_NAMES = inspect.signature(_mask_interface)


def prepared(value) -> bool:
    """A deferred mask, or a dict of them (one per kind of layer), as a front hands its text model."""
    if isinstance(value, dict):
        return bool(value) and all(isinstance(v, DeferredMask) for v in value.values())
    return isinstance(value, DeferredMask)


def build(value, implementation: str):
    """The masks the model's own attention implementation makes of them (a forward without SP)."""
    if isinstance(value, dict):
        return {k: v.build(implementation) for k, v in value.items()}
    return value.build(implementation)


def _arguments(mask: DeferredMask) -> dict:
    bound = _NAMES.bind_partial(*mask.args, **{k: v for k, v in mask.kwargs.items() if k in _NAMES.parameters})
    return {**{k: p.default for k, p in _NAMES.parameters.items()}, **bound.arguments}


def check_deferred(mask: DeferredMask, check) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the blocks [b, kv_length] a deferred mask's function adds to causal attention, the documents of its
    packed rows), None each where there are none; or refuse its pattern: `check(mask_function,
    attention_mask, batch_size)` for a plain one."""
    a = _arguments(mask)
    fn, batch = a["mask_function"], int(a["batch_size"])
    if fn is None:
        return None, None
    try:  # a plain pattern (checked once per kind of mask function: a decoding step's masks come here too)
        check(fn, a["attention_mask"], batch)
        return None, None
    except NotImplementedError:
        pass
    read = read_blocks(fn, batch, int(a["kv_length"]))
    if read is None:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise NotImplementedError(
            "seqpar_hf shards causal, bidirectional, sliding-window and chunked attention, and causal attention "
            f"in which blocks of tokens (images) see each other both ways; this model asked for another mask "
            f"pattern ({name!r}: prefix or custom masks, or chunks not counted from each row's first real token)"
        )
    return (read[1] if bool((read[1] >= 0).any()) else None), read[2]


def take(value, check) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(the padding mask [b, S] or None, blocks [b, S] int64 or None, documents [b, S] or None: packed rows) the
    prepared masks were made of.
    `check(mask_function, attention_mask, batch_size)` refuses a plain pattern the kernels do not have."""
    masks = list(value.values()) if isinstance(value, dict) else [value]
    found: list[tuple] = []
    for mask in masks:
        a = _arguments(mask)
        if int(a["q_offset"]) or int(a["kv_offset"]) or int(a["q_length"]) != int(a["kv_length"]):
            raise NotImplementedError(
                "seqpar_hf: the text model was handed a mask made for a cache (offsets or a longer key length); "
                "run such forwards without SP (`with seqpar_hf.sp_disabled(model):`)"
            )
        found.append((a["attention_mask"], *check_deferred(mask, check)))
    padding, blocks, docs = found[0]
    for other_padding, other_blocks, other_docs in found[1:]:
        same_padding = other_padding is padding or (
            other_padding is not None and padding is not None and torch.equal(other_padding, padding)
        )
        if not (same_padding and _same(other_blocks, blocks) and _same(other_docs, docs)):
            raise NotImplementedError(
                "seqpar_hf: the masks a text model was handed differ in their padding, documents or blocks of "
                "tokens that see each other both ways between kinds of layers; sequence parallelism applies one "
                "of each"
            )
    return padding, blocks, docs


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
