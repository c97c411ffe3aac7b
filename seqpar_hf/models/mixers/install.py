"""Which way each token mixer of a patched model runs (along the sequence, with a convolution halo and its scan's
state passed, where proven; else split by heads where proven; else whole), installed and logged once at
`patch_model`."""

from __future__ import annotations

from collections.abc import Callable

from ...parallel import announce
from . import gathered, halo, heads, scan, sequence


def install(state, family, layout) -> dict:
    """Wrap every mixer of `family`; {path: "sequence", "heads" or why it runs whole}. The handles go to
    state.hooks."""
    backbone, chosen, proofs = family.backbone, {}, {}
    for name, side in family.mixers.items():
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
                chosen[name] = "sequence"
                state.hooks += gathered.install(state, module, side, backbone, name, make)
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
            chosen[name] = "heads"
        else:
            make, chosen[name] = None, why
        state.hooks += gathered.install(state, module, side, backbone, name, make)
    announce.mixers(layout, backbone, chosen)
    return chosen
