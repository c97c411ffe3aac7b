"""Which way each token mixer of a patched model runs (along the sequence, with a convolution halo and its scan's
state passed, where proven; else split by heads where proven; else whole), decided and proven at `patch_model`
before anything is patched, installed and logged once."""

from __future__ import annotations

from collections.abc import Callable

from ...parallel import announce
from . import gathered, halo, heads, scan, sequence

SPLIT = ("sequence", "heads")


def decide(family, layout) -> dict[str, tuple[str, Callable | None]]:
    """{path: ("sequence", "heads" or why it runs whole, the wrapper's maker)}; raises for a model without
    attention whose mixers would all run whole (every rank the whole model: it divides nothing)."""
    backbone, decided, proofs = family.backbone, {}, {}
    for name in family.mixers:
        module = backbone.get_submodule(name)
        conv, scans = halo.depthwise_conv(module), scan.find(module)
        if conv is not None or scans:  # proven once per kind of module (its class and shapes: the same code path)
            key = (type(module), tuple((n, tuple(t.shape)) for n, t in module.named_parameters()))
            if key not in proofs:
                proofs[key] = sequence.prove(module, module.forward, conv, scans, layout.sp_size)
            if proofs[key] is None:
                make: Callable | None = lambda st, original, s, holder, m=module, c=conv, f=scans: (
                    sequence.SequenceMixer(st, m, original, s, holder, c, f)
                )
                decided[name] = ("sequence", make)
                continue
        split = heads.head_layout(module)
        if isinstance(split, heads.SsdLayout) and split.groups < layout.sp_size:  # heads of one group per rank
            split = heads.SsdLayout(split.groups, split.per_group, split.dim, split.state, by_heads=True)
        why = (
            "has no head layout known here"
            if split is None
            else heads.prove(module, module.forward, split, layout.sp_size)
        )
        if why is None:
            make = lambda st, original, s, holder, m=module, h=split: heads.HeadParallelMixer(
                st, m, original, s, holder, h
            )
            decided[name] = ("heads", make)
        else:
            decided[name] = (why, None)
    if family.mixers and not family.attention and not any(way in SPLIT for way, _ in decided.values()):
        name = sorted(family.mixers)[0]
        raise ValueError(
            f"seqpar_hf cannot shard {type(family.pretrained).__name__}: {name} "
            f"({type(backbone.get_submodule(name)).__name__}) mixes tokens without attention and "
            f"{decided[name][0]}; it would run on the whole sequence on every rank, which divides nothing. "
            "Train it without sequence parallelism"
        )
    return decided


def install(state, family, layout, decided: dict) -> dict:
    """Wrap every mixer of `family` as `decide` chose; {path: "sequence", "heads" or why it runs whole}. The
    handles go to state.hooks."""
    chosen = {}
    for name, side in family.mixers.items():
        chosen[name], make = decided[name]
        state.hooks += gathered.install(state, family.backbone.get_submodule(name), side, family.backbone, name, make)
    announce.mixers(layout, family.backbone, chosen)
    return chosen
