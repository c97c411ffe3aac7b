"""Which way each token mixer of a patched model runs (split by heads where proven, else whole), installed
and logged once at `patch_model`."""

from __future__ import annotations

from ...parallel import announce
from . import gathered, heads


def install(state, family, layout) -> dict:
    """Wrap every mixer of `family`; {path: "heads" or why it runs whole}. The handles go to state.hooks."""
    backbone, chosen = family.backbone, {}
    for name, side in family.mixers.items():
        module = backbone.get_submodule(name)
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
