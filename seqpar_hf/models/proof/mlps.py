"""Which modules a tiled MLP may compute over sequence tiles (memory/tiled_mlp.py), decided by what they do.

A layer's MLP is a child module of a layer (of a stack the proof found) that, given hidden states
[b, s, h], returns [b, s, h] through a weight wider than h (the [tokens, ffn] intermediate tiling saves).
It is tiled only if, run in the mode the model is in on a random batch, it is
- deterministic (no dropout or other draws: a tile would draw other numbers than the whole sequence),
- token-local (its output on each tile of the sequence equals, within fp32 rounding, its output at the same
  tokens of the whole sequence: expert capacity or any other count over the tokens fails this), and
- unobserved (no module inside it has outputs collected by the model's output recorders, e.g. a router's
  logits for the load-balancing loss: a tiled forward would record one per tile).
tiled_mlp=True refuses a layer without such an MLP, naming the module and the reason; "auto" leaves it whole.
"""

from __future__ import annotations

import torch
from torch import nn

from ..families import ModelFamily
from . import dryrun
from .probe_checks import tolerance

_ROWS, _LENGTH, _TILE = 2, 8, 3  # the check's batch: 8 positions in tiles of 3, 3 and 2


def hidden_size(family: ModelFamily) -> int | None:
    config = family.pretrained.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    value = getattr(text, "hidden_size", None) or getattr(text, "d_model", None)
    return value if isinstance(value, int) else None


def _recorded(pretrained: nn.Module) -> list[tuple[type, str | None]]:
    """(module class, layer name) of every output recorder of the model (transformers' `_can_record_outputs`)."""
    out = []
    for cls in {type(pretrained), *(type(m) for m in pretrained.modules() if hasattr(m, "_can_record_outputs"))}:
        for spec in (getattr(cls, "_can_record_outputs", None) or {}).values():
            for one in spec if isinstance(spec, (list, tuple)) else [spec]:
                target = getattr(one, "target_class", one)
                if isinstance(target, type):
                    out.append((target, getattr(one, "layer_name", None)))
    return out


def _why_not(module: nn.Module, hidden: int, recorded, attention: set) -> str | None:
    """None if `module` is a tileable MLP; else why not ("" if it is not an MLP at all)."""
    params = list(module.parameters())
    if not params or any(id(m) in attention for m in module.modules()):
        return ""
    if not any(hidden < size for p in params for size in p.shape):
        return ""
    for name, sub in module.named_modules():
        for cls, layer_name in recorded:
            if isinstance(sub, cls) and (layer_name is None or layer_name in name):
                return (
                    f"its {type(sub).__name__} outputs are collected by the model's output recorders (e.g. router "
                    "logits for the load-balancing loss), which a tiled forward would record once per tile"
                )
    p = params[0]
    x = torch.randn(_ROWS, _LENGTH, hidden, generator=torch.Generator().manual_seed(0)).to(p.device, p.dtype)
    with dryrun.Preserved(module):
        try:
            whole = module(x)
        except Exception:  # noqa: BLE001 - not a module of the hidden states (another input or width): no MLP
            return ""
        if not isinstance(whole, torch.Tensor) or whole.shape != x.shape:
            return ""
        if not torch.equal(module(x), whole):
            return "it draws random numbers in this mode (dropout): a tile would draw other numbers than the sequence"
        tiles = torch.cat([module(x[:, s : s + _TILE]) for s in range(0, _LENGTH, _TILE)], dim=1)
    scale = whole.abs().max().clamp_min(1e-30)
    if ((tiles - whole).abs().max() / scale).item() > tolerance(whole.dtype):
        return (
            "it is not token-local: its output on a tile of the sequence differs from the same tokens' on the whole "
            "sequence (e.g. expert capacity counted over the tokens)"
        )
    return None


def find_mlps(family: ModelFamily, required: bool) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """([(path, module)] to tile, [why each layer's MLP stays whole]); `required` (tiled_mlp=True): raise
    ValueError for the first layer whose MLP cannot be tiled."""
    hidden = hidden_size(family)
    names = {m: n for n, m in family.pretrained.named_modules()}
    attention = {id(site.module) for site in family.attention + family.local_attention}
    recorded = _recorded(family.pretrained)
    found, skipped = [], []
    for stack in family.layer_stacks:
        for layer in getattr(stack, "layers", ()):
            reasons, mlps = {}, []
            for child_name, child in layer.named_children():
                why = _why_not(child, hidden, recorded, attention) if hidden else ""
                if why is None:
                    mlps.append((f"{names[layer]}.{child_name}", child))
                elif why:
                    reasons[f"{names[layer]}.{child_name} ({type(child).__name__})"] = why
            if mlps and not reasons:
                found.extend(mlps)
                continue
            where, why = next(iter(reasons.items())) if reasons else (f"{names[layer]} ({type(layer).__name__})", "")
            why = why or (
                f"it has no MLP child to tile: no child maps the hidden states [b, s, {hidden}] to the same shape "
                f"through a weight wider than {hidden}"
            )
            if required:
                raise ValueError(
                    f"tiled_mlp=True: {where} cannot be computed over sequence tiles: {why}. Use tiled_mlp='auto' "
                    "(leaves such MLPs whole) or tiled_mlp=False"
                )
            skipped.append(f"{where}: {why}")
    return found, skipped
