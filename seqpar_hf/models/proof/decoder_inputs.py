"""How an encoder-decoder LM builds its decoder inputs from labels, read off its own forward at patch time.

Given labels and no decoder inputs, the patched LM forward builds them on the full sequence
(`forward/labels.decoder_inputs`: the model's `prepare_decoder_input_ids_from_labels`, else the labels shifted
right with the config's start and pad ids) and the backbone shards them. A model may read those ids elsewhere
(Florence-2: its text config's start token 2, where the top-level config says 0): the patched loss would then
train on other inputs, silently. So the model's own forward runs once on labels alone, the decoder inputs it
hands its backbone are captured, and seqpar_hf's builder must give the same; else the start and pad ids are
read off what it built (and must then reproduce it), else batches with labels and no decoder inputs are refused.
"""

from __future__ import annotations

import inspect

import torch

from ... import _compat
from ..forward.labels import IGNORE_INDEX, decoder_inputs


def _captured(pretrained, backbone, batch: dict, labels: torch.Tensor, original: str | None) -> torch.Tensor | None:
    seen: dict = {}
    # what the model hands its backbone, or (a model that runs its stacks itself, as T5) its decoder stack
    target, key = (backbone, "decoder_input_ids")
    if backbone is pretrained:
        target, key = pretrained.get_decoder(), "input_ids"
    names = list(inspect.signature(target.forward).parameters)

    def hook(module, args, kwargs):
        named = {**dict(zip(names, args)), **kwargs}
        seen["ids"] = named.get(key)

    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    current = _compat.attn_implementation(pretrained.config)  # the dry run's stand-in: the model's own instead
    try:
        pretrained.set_attn_implementation(original or "sdpa")
        with torch.no_grad():
            pretrained(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
    except Exception:  # noqa: BLE001 - a forward that needs more than labels: nothing to compare
        return None
    finally:
        handle.remove()
        pretrained.set_attn_implementation(current)
    ids = seen.get("ids")
    return ids if isinstance(ids, torch.Tensor) and ids.shape == labels.shape else None


def read(pretrained, backbone, batch: dict, original: str | None) -> tuple | str | None:
    """None: `decoder_inputs` reproduces the model; (start, pad): it does with these ids; "refuse": neither."""
    labels = batch["decoder_input_ids"].clone()
    labels[-1, -2:] = IGNORE_INDEX  # padding in the labels: where the pad id shows
    want = _captured(pretrained, backbone, batch, labels, original)
    if want is None or torch.equal(decoder_inputs(pretrained, labels), want):
        return None
    start, shifted = want[:, 0], torch.cat([labels[:, :1], labels[:, :-1]], dim=1)
    pads = want[:, 1:][shifted[:, 1:] == IGNORE_INDEX]
    if not bool((start == start[0]).all()) or (pads.numel() and not bool((pads == pads[0]).all())):
        return "refuse"
    ids = (int(start[0]), int(pads[0]) if pads.numel() else 0)
    return ids if torch.equal(decoder_inputs(pretrained, labels, start_pad=ids), want) else "refuse"
