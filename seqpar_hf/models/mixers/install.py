"""Which way each token mixer of a patched model runs (along the sequence, with a convolution halo and its scan's
state passed, where proven; else split by heads where proven; else whole), decided and proven at `patch_model`
before anything is patched, installed and logged once."""

from __future__ import annotations

import copy
from collections.abc import Callable

from ...parallel import announce
from ..generation import sharded_cache
from . import gathered, halo, heads, scan, sequence

SPLIT = ("sequence", "heads")


def decide(family, layout) -> dict[str, tuple[str, Callable | None]]:
    """{path: ("sequence", "heads" or why it runs whole, the wrapper's maker)}; raises for a model without
    attention whose mixers would all run whole (every rank the whole model: it divides nothing).

    Both splits are proven for every mixer (once per kind of module: its class and shapes, the same code path).
    `layout.mixer_split` "auto" takes the split along the sequence (1/sp of the activations, a few states sent),
    with the head split as what a fused kernel's run takes instead; "heads" the head split (one all-to-all of the
    layer's inputs; the faster on a GPU for Mamba2's few large kernels: benchmarks/README.md)."""
    backbone, decided, proofs = family.backbone, {}, {}
    prefer_heads = getattr(layout, "mixer_split", "auto") == "heads"
    for name in family.mixers:
        module = backbone.get_submodule(name)
        # this module's own convolution (its weight), scan functions and head layout; the proofs once per kind of
        # module (its class and shapes: the same code path)
        conv, scans, split = halo.depthwise_conv(module), scan.find(module), _head_layout(module, layout.sp_size)
        key = (type(module), tuple((n, tuple(t.shape)) for n, t in module.named_parameters()))
        if key not in proofs:
            along = _sequence(module, conv, scans, layout.sp_size)
            prefill = along is None and _prefill(family, module, conv, scans, layout.sp_size)
            proofs[key] = (along, _heads(module, split, layout.sp_size), prefill)
        along_why, split_why, prefill = proofs[key]
        by_heads = None
        if split_why is None:
            by_heads = lambda st, original, s, holder, m=module, h=split: heads.HeadParallelMixer(
                st, m, original, s, holder, h
            )
        if along_why is None and not (prefer_heads and by_heads is not None):
            make: Callable | None = lambda st, original, s, holder, m=module, c=conv, f=scans, b=by_heads, p=prefill: (
                sequence.SequenceMixer(st, m, original, s, holder, c, f, b(st, original, s, holder) if b else None, p)
            )
            decided[name] = ("sequence", make)
        elif by_heads is not None:
            decided[name] = ("heads", by_heads)
        else:
            decided[name] = (split_why or along_why or "", None)  # the head split's reason first, as before
    if family.mixers and not family.attention and not any(way in SPLIT for way, _ in decided.values()):
        name = sorted(family.mixers)[0]
        raise ValueError(
            f"seqpar_hf cannot shard {type(family.pretrained).__name__}: {name} "
            f"({type(backbone.get_submodule(name)).__name__}) mixes tokens without attention and "
            f"{decided[name][0]}; it would run on the whole sequence on every rank, which divides nothing. "
            "Train it without sequence parallelism"
        )
    return decided


def _sequence(module, conv, scans: dict, n: int) -> str | None:
    """None where the split along the sequence (`conv`'s halo, `scans`' states) is proven for `n` ranks, else
    why not."""
    if conv is None and not scans:
        return "has no convolution or scan found here"
    return sequence.prove(module, module.forward, conv, scans, n)


def _prefill(family, module, conv, scans: dict, n: int) -> bool:
    """Whether generation's prompt forward splits along the sequence too, proven with a fresh copy of the cache
    layer the model's own cache gives this mixer (else that forward runs it whole, as before)."""
    index = getattr(module, "layer_idx", None)
    if family.kind != "causal" or not isinstance(index, int):
        return False
    try:
        states = sharded_cache.unpatched_states(family.pretrained)[0]
    except Exception:  # noqa: BLE001 - a config transformers' cache cannot be built from: generate refuses it anyway
        return False
    if index not in states:
        return False
    make = lambda n, r: sharded_cache.SequenceShardedCache(n, r, None, {index: copy.deepcopy(states[index])})
    return sequence.prove_prefill(module, module.forward, conv, scans, n, make) is None


def _head_layout(module, n: int):
    """The module's head layout for `n` ranks, or None."""
    split = heads.head_layout(module)
    if isinstance(split, heads.SsdLayout) and split.groups < n:  # heads of one group per rank
        split = heads.SsdLayout(split.groups, split.per_group, split.dim, split.state, by_heads=True)
    return split


def _heads(module, split, n: int) -> str | None:
    """None where the head split `split` is proven for `n` ranks, else why not."""
    return "has no head layout known here" if split is None else heads.prove(module, module.forward, split, n)


def install(state, family, layout, decided: dict) -> dict:
    """Wrap every mixer of `family` as `decide` chose; {path: "sequence", "heads" or why it runs whole}. The
    handles go to state.hooks."""
    chosen = {}
    for name, side in family.mixers.items():
        chosen[name], make = decided[name]
        state.hooks += gathered.install(state, family.backbone.get_submodule(name), side, family.backbone, name, make)
    announce.mixers(layout, family.backbone, chosen)
    return chosen
