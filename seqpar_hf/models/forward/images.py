"""A multimodal model's vision tower under SP: each rank encodes 1/sp of the batch's images.

The vision tower runs before the text model (the backbone) on the full batch, so left alone every rank of the
SP group encodes every image. `ImageShards` wraps its forward: the images are cut into sp contiguous ranges of
about equal size (in patches), each rank runs the tower on its range, and every output whose rows are per image
(per patch, per merged token, per image) is all-gathered back into image order. Backward: the gradient of the
gathered rows is summed over the group (each rank's tokens read any image) and each rank keeps its own rows, so
the tower's weights get, summed over the ranks, what the replicated tower gets.

That cutting the images apart changes nothing is checked, not assumed: the first call that cuts runs the tower
on all images too and compares (every rank the same decision); a tower that mixes images (a batch norm over
them), or that draws random numbers (dropout, drop path: a cut would draw others than the whole batch; seen by
the generator's state moving), keeps running whole, with a warning. Two conventions are cut: Qwen's flattened
patches with `grid_thw` (an image's patches: the product of its row), and images along the first dim of
`pixel_values` (with every tensor argument of that first dim); anything else, fewer images than ranks, or TP
run whole.
"""

from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist

logger = logging.getLogger("seqpar_hf")

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}  # other dtypes: 2e-2 (bf16 / fp16 rounding)


def _split(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges of `sizes`' items, one per part, of about equal total size."""
    total, bounds, acc, item = sum(sizes), [0], 0, 0
    for p in range(1, parts):
        while item < len(sizes) and (acc + sizes[item] / 2) < total * p / parts:
            acc += sizes[item]
            item += 1
        bounds.append(max(item, bounds[-1]))
    bounds.append(len(sizes))
    return list(zip(bounds[:-1], bounds[1:]))


class _GatherRows(torch.autograd.Function):
    """Each rank's rows -> every rank's rows in rank order (rank r holds `counts[r]`); backward: the gradient
    summed over the group, this rank's rows of it."""

    @staticmethod
    def forward(ctx, x, counts, rank, group):
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        most = max(counts)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((len(counts) * most, *x.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([out[r * most : r * most + n] for r, n in enumerate(counts)])

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


MAX_DIMS = 6


def _shape(t: torch.Tensor) -> list[int]:
    """[ndim, sizes..., -1 padding]: comparable over ranks."""
    dims = list(t.shape)[:MAX_DIMS]
    return [t.dim(), *dims, *([-1] * (MAX_DIMS - len(dims)))]


def _per_image(i: int, every: list[torch.Tensor]) -> bool:
    """Output `i` has the same rank and trailing sizes on every rank (only its rows differ): rows per image."""
    first = every[0][i]
    return all(bool((g[i][0] == first[0]) and (g[i][2:] == first[2:]).all()) for g in every)


def _tensors(value, path=()):
    """(path, tensor) of every tensor in a (nested) output: ModelOutput, tuple, list."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):  # ModelOutput
        for k, v in value.items():
            yield from _tensors(v, (*path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, (*path, i))


def _put(value, path, new):
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        value[head] = _put(value[head], rest, new)
        return value
    items = list(value)
    items[head] = _put(items[head], rest, new)
    return type(value)(items) if isinstance(value, tuple) and not hasattr(value, "_fields") else items


class ImageShards:
    """The forward of a vision tower (`module`) whose first argument is `pixel_values`."""

    def __init__(self, state, module, original):
        self.state, self.module, self.original = state, module, original
        self.__wrapped__ = original
        params = inspect.signature(original).parameters
        self.names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.checked: bool | None = None  # None: not yet; False: it mixes images (run whole)
        self.cut_calls = 0  # calls that encoded this rank's images only

    def _plan(self, kwargs: dict):
        """(per-image sizes along pixel_values' first dim, how to cut each argument) or None: run whole."""
        pixels = kwargs.get(self.names[0])
        if not isinstance(pixels, torch.Tensor) or pixels.dim() < 2:
            return None
        grid = next((v for k, v in kwargs.items() if k.endswith("grid_thw") and isinstance(v, torch.Tensor)), None)
        if grid is not None:  # Qwen: patches of every image, flattened; an image's rows: the product of its grid
            sizes = grid.prod(-1).tolist()
            if sum(sizes) != pixels.shape[0]:
                return None
            return sizes, "grid"
        return [1] * pixels.shape[0], "batch"

    def __call__(self, *args, **kwargs):
        state = self.state
        kwargs = {**dict(zip(self.names, args)), **kwargs}
        layout = state.layout
        group = layout.sp_group
        plan = None if (state.detached or self.checked is False or layout.sp_size == 1) else self._plan(kwargs)
        if plan is None or layout.sizes.tp_size > 1 or len(plan[0]) < layout.sp_size or state.plain_depth:
            return self.original(**kwargs)
        sizes, kind = plan
        ranges = _split(sizes, layout.sp_size)
        if any(end == start for start, end in ranges):  # one image much larger than the rest: run whole
            return self.original(**kwargs)
        rank = layout.sp_rank
        first, last = ranges[rank]
        mine = self._cut(kwargs, sizes, kind, first, last)
        before = _rng_states(pixels_device(kwargs, self.names[0]))
        out = self.original(**mine)
        if any(not torch.equal(a, b) for a, b in zip(before, _rng_states(pixels_device(kwargs, self.names[0])))):
            # it draws random numbers (dropout, drop path in training): a cut draws other ones than the whole
            # batch does; the same draws as one process: the state restored, the tower whole (every rank alike)
            _set_rng_states(before, pixels_device(kwargs, self.names[0]))
            self.checked = False
            logger.warning(
                "%s draws random numbers (dropout) in training: it runs on all images on every rank",
                type(self.module).__name__,
            )
            return self.original(**kwargs)
        local = list(_tensors(out))
        shapes = torch.tensor([_shape(t) for _, t in local], dtype=torch.long).reshape(-1)
        every = [torch.zeros_like(shapes) for _ in range(layout.sp_size)]
        dist.all_gather(every, shapes, group=group)  # each output's shape on every rank
        every = [g.view(len(local), -1) for g in every]
        if any(not _per_image(i, every) for i in range(len(local))):  # an output not cut by image (Pixtral's
            # patches of all images in one sequence, [1, patches, d]): the tower runs whole, on every call
            self.checked = False
            logger.warning(
                "%s returns outputs that are not cut by image: it runs on all images on every rank",
                type(self.module).__name__,
            )
            return self.original(**kwargs)
        for i, (path, t) in enumerate(local):
            if t.dim() == 0:
                continue
            out = _put(out, path, _GatherRows.apply(t, [int(g[i, 1]) for g in every], rank, group))
        if self.checked is None:
            self._check(out, kwargs)
        self.cut_calls += 1
        return out

    def _cut(self, kwargs: dict, sizes: list[int], kind: str, first: int, last: int) -> dict:
        start, end = sum(sizes[:first]), sum(sizes[:last])
        n = len(sizes)
        mine = {}
        for k, v in kwargs.items():
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                mine[k] = v
            elif k == self.names[0]:
                mine[k] = v[start:end]
            elif v.shape[0] == n:  # per image: grid_thw rows, image_sizes, patch masks
                mine[k] = v[first:last]
            else:
                mine[k] = v
        return mine

    def _check(self, out, kwargs: dict) -> None:
        """The first cut call: the tower on all images must give what the ranks' cuts, gathered, give."""
        with torch.no_grad():
            whole = self.original(**kwargs)
        worst = 0.0
        want = dict(_tensors(whole))
        for path, t in _tensors(out):
            ref = want.get(path)
            if ref is None or ref.shape != t.shape:
                worst = float("inf")
                break
            scale = ref.detach().float().abs().max().clamp(min=1e-30)
            worst = max(worst, float((t.detach().float() - ref.float()).abs().max() / scale))
        verdict = torch.tensor([worst], dtype=torch.float64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self.state.layout.sp_group)
        dtype = next(iter(want.values())).dtype if want else torch.float32
        self.checked = float(verdict) <= TOLERANCE.get(dtype, 2e-2)
        if self.checked and self.state.layout.rank == 0:
            logger.info(
                "%s encodes 1/%d of the images on each rank (checked on the first batch: %.1e relative "
                "to all images on one rank)",
                type(self.module).__name__,
                self.state.layout.sp_size,
                float(verdict),
            )
        if not self.checked:
            logger.warning(
                "%s gives other numbers when its images are cut over the SP group (%.2e relative): "
                "it mixes images; it runs on all images on every rank",
                type(self.module).__name__,
                float(verdict),
            )
            raise _Recompute()


def pixels_device(kwargs: dict, name: str) -> torch.device:
    return kwargs[name].device


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    """The generator states a module's random draws advance: the CPU's, and the device's on CUDA."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _set_rng_states(states: list[torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)


class _Recompute(Exception):
    """The checked cut disagreed: the caller runs the tower whole for this call."""


def install(state, family, replace) -> list:
    """Wrap the forward of each front module whose first argument is its images (`pixel_values`, or Qwen's
    flattened patches as `hidden_states`); the `ImageShards` installed."""
    wrappers = []
    for name in family.front:
        module = family.pretrained.get_submodule(name)
        names = list(inspect.signature(module.forward).parameters)
        qwen = names[:1] == ["hidden_states"] and any(n.endswith("grid_thw") for n in names)  # its patches, grids
        if names[:1] != ["pixel_values"] and not qwen:
            continue
        shards = ImageShards(state, module, module.forward)
        replace(state, module, "forward", _Safe(shards))
        wrappers.append(shards)
    return wrappers


class _Safe:
    """Runs an `ImageShards`; where its check failed (it mixes images), the tower whole for that call."""

    def __init__(self, inner: ImageShards):
        self.inner = inner
        self.__wrapped__ = inner.original

    def __call__(self, *args, **kwargs):
        try:
            return self.inner(*args, **kwargs)
        except _Recompute:
            return self.inner.original(*args, **kwargs)
