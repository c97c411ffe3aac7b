"""A token-local MLP computed over tiles of the sequence (ALST's TiledMLP, Bekman et al. 2025, arXiv 2506.13996,
section 3.2): the forward runs the MLP one tile at a time without keeping anything but its input; the backward
recomputes each tile with gradients and frees it before the next. The [tokens, ffn] intermediates then never
exist for more than one tile's tokens, where the whole sequence's would be the largest tensor of a layer at
long lengths (Llama-3-8B: ffn 14336 = 3.5 x hidden, two or three of them alive in the MLP's backward).

Exact: each token's output and input gradient are computed from that token alone, the same operations on
fewer rows. The weight gradients are sums over tokens; summed per tile, then over tiles (in fp32), they
differ from the one-matmul sum by rounding only. They are returned to autograd as the gradients of the
parameters passed in, so hooks (DDP, FSDP2) see one gradient per parameter per backward, as without tiling.
Which modules may be tiled is proven at patch time (`models/proof/mlps.py`).
"""

from __future__ import annotations

import torch

TILED_MLP_MIN_ELEMENTS = 2**26  # "auto": tile where one [tokens, ffn] intermediate would have this many (256 MiB fp32)


def _spans(length: int, tile: int):
    return [(start, min(start + tile, length)) for start in range(0, length, tile)]


def _tile_input(x: torch.Tensor, dim: int, start: int, end: int, tp: int) -> torch.Tensor:
    """Tile [start, end) of the output positions: under TP (`tp` > 1) the MLP's input is the TP group's slices
    gathered in rank order (the sequence-parallel regions) and its row-parallel output is reduce-scattered
    back to this rank's slice, so the tile takes the same positions of every rank's slice, in rank order."""
    if tp == 1:
        return x.narrow(dim, start, end - start)
    local = x.shape[dim] // tp
    return torch.cat([x.narrow(dim, r * local + start, end - start) for r in range(tp)], dim=dim)


def _tiles(forward, x: torch.Tensor, dim: int, tile: int, tp: int = 1) -> torch.Tensor:
    """forward(x) computed over tiles of `tile` output positions along `dim`, into one output tensor."""
    out = None
    for start, end in _spans(x.shape[dim] // tp, tile):
        part = forward(_tile_input(x, dim, start, end, tp))  # [b, tile, h]
        if part.shape[dim] != end - start:  # under TP: an MLP whose input the TP plan does not gather
            raise RuntimeError(
                f"tiled MLP: a tile of {end - start} positions gave {part.shape[dim]} (tp_size={tp}); "
                "use tiled_mlp=False"
            )
        if out is None:
            out = part.new_empty((*x.shape[:dim], x.shape[dim] // tp, part.shape[-1]))  # [b, s, h_out]
        out.narrow(dim, start, end - start).copy_(part)
    assert out is not None
    return out


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, forward, dim: int, tile: int, tp: int, x: torch.Tensor, *params: torch.Tensor):
        ctx.forward, ctx.dim, ctx.tile, ctx.tp, ctx.params = forward, dim, tile, tp, params
        ctx.save_for_backward(x)  # only the input: through any saved-tensors hooks (checkpoint, offload, TP)
        with torch.no_grad():
            return _tiles(forward, x, dim, tile, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        dim, tile, tp, params = ctx.dim, ctx.tile, ctx.tp, ctx.params
        wants_x = ctx.needs_input_grad[4]
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[5 + i]]
        grad_x = torch.empty_like(x) if wants_x else None
        sums: list = [None] * len(params)
        local = x.shape[dim] // tp
        for start, end in _spans(local, tile):
            part = _tile_input(x, dim, start, end, tp).detach().requires_grad_(wants_x)  # [b, tp * tile, h]
            with torch.enable_grad():
                out = ctx.forward(part)
            inputs = ([part] if wants_x else []) + [params[i] for i in wanted]
            got = torch.autograd.grad(out, inputs, grad.narrow(dim, start, end - start), allow_unused=True)
            if wants_x:
                assert grad_x is not None
                n = end - start
                for r in range(tp):  # back to each rank's slice (tp 1: the tile itself)
                    grad_x.narrow(dim, r * local + start, n).copy_(got[0].narrow(dim, r * n, n))
                got = got[1:]
            for i, g in zip(wanted, got):
                if g is not None:
                    g = g.float() if g.is_floating_point() and g.element_size() < 4 else g
                    sums[i] = g if sums[i] is None else sums[i] + g
        grads = [s.to(p.dtype) if s is not None else None for s, p in zip(sums, params)]
        return (None, None, None, None, grad_x, *grads)


class TiledForward:
    """An MLP module's forward (an instance attribute set by patch_model), computed over sequence tiles of
    its hidden states [b, s, h] when `tile_tokens(...)` says so; any other call runs the original."""

    def __init__(self, module: torch.nn.Module, original, tile: int | None, auto: bool, width: int, tp: int = 1):
        self.module, self.original = module, original
        self.tile, self.auto, self.width = tile, auto, width  # tile: tokens per tile (None: the hidden size)
        self.tp = tp  # > 1: its input is the TP group's sequence slices gathered, its output this rank's slice

    def tile_length(self, x: torch.Tensor) -> int | None:
        """Positions per tile along the sequence dim (None: run whole)."""
        rows = x.numel() // max(1, x.shape[-2] * x.shape[-1])  # rows tiled together: the batch
        tokens = x.numel() // x.shape[-1]
        if self.auto and tokens * self.width < TILED_MLP_MIN_ELEMENTS:
            return None
        tile = self.tile if self.tile is not None else x.shape[-1]  # ALST: about hidden-size tokens per tile
        length = max(1, tile // rows)
        return length if length < x.shape[-2] // self.tp else None

    def __call__(self, *args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs else None
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return self.original(*args, **kwargs)
        length = self.tile_length(x)
        if length is None:
            return self.original(x)
        dim = x.dim() - 2  # the sequence: [b, s, h]
        params = list(self.module.parameters())
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _TiledMLP.apply(self.original, dim, length, self.tp, x, *params)
        return _tiles(self.original, x, dim, length, self.tp)


class TiledMLPs:
    """The handle patch_model keeps: `remove()` gives the tiled modules their forwards back."""

    def __init__(self) -> None:
        self.modules: list[tuple[torch.nn.Module, bool, object]] = []  # (module, had an instance forward, it)

    def install(self, module: torch.nn.Module, tile: int | None, auto: bool, width: int, tp: int = 1) -> None:
        self.modules.append((module, "forward" in module.__dict__, module.__dict__.get("forward")))
        module.forward = TiledForward(module, module.forward, tile, auto, width, tp)

    def remove(self) -> None:
        for module, had, previous in self.modules:
            if isinstance(module.__dict__.get("forward"), TiledForward):
                if had:
                    module.__dict__["forward"] = previous
                else:
                    del module.__dict__["forward"]
