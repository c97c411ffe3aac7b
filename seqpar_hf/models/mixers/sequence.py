"""A token mixer split along the sequence: each rank runs the module on its own tokens only, its short causal
convolution given the inputs before each of the rank's runs (`halo.py`), its scan started from the state the
tokens before each run leave (`scan.py`). Nothing of the mixer is whole on any rank: its activations are 1/sp, as
the attention layers'. LFM2's gated short convolutions (a convolution only), a gated DeltaNet (Qwen3.5, Qwen3-Next,
OLMo-hybrid: a convolution, then a gated delta rule), a Mamba2 mixer (a convolution, then an SSD chunk scan).

At `patch_model` the split is proven on a copy of the module in float64, on a padded random batch, for
contiguous and zigzag shards of every sp: the shards' outputs, run one by one in one process with the halos and
states their neighbours give, are the module's own output at their tokens. Where it is not, the mixer runs as
before (split by heads, or whole). A forward in which the convolution or the scan is not seen where the proof saw
it (a fused CUDA kernel, causal-conv1d or mamba_ssm, ran it) is thrown away and the mixer runs whole from then on,
with a warning (every rank takes the same path).

Generation's prompt forward splits alike where that is proven too (`prove_prefill`, with the model's own cache
layer): the scan's final state is the sequence's on every rank (`scan.StatePassing`'s `final_length`), and the
sequence-sharded cache keeps the whole prompt's last convolution inputs (`halo.ConvTail`), so every rank ends with
the states the unpatched cache holds and decodes as before. Where not proven, or a fused kernel hid the scan, the
prompt's forward runs the mixer whole (the cache layer put back first). A forward given a cache outside generation
under SP runs it whole.
"""

from __future__ import annotations

import copy
import inspect
import types
import warnings
from typing import cast

import torch
from torch import nn

from ...parallel.sharding import ShardPlan
from ..forward.context import CONTEXT_KWARG, ForwardContext, carried
from ..generation.sharded_cache import SequenceShardedCache
from . import halo, kernels, scan
from .gathered import GatheredMixer

CACHE_KWARGS = ("cache", "past_key_values", "cache_params")


def order(plan: ShardPlan) -> list[tuple[int, int, int]]:
    """(rank, index, global start) of every rank's runs, in sequence order."""
    return sorted(
        ((r, i, g) for r in range(plan.sp_size) for i, (_, _, g) in enumerate(halo.runs(plan, r))),
        key=lambda t: t[2],
    )


class _Modes:
    """The convolution halo and the state passing of one forward of one rank, entered together."""

    def __init__(
        self, module, conv, scans, plan: ShardPlan, rank: int, device, gather_columns, gather_states, final=False
    ):
        self.conv = (
            halo.ConvWithHalo(
                conv,
                halo.Halos(plan, rank, conv.kernel_size[0], device),
                gather_columns,
                scan.global_space(module),
                halo.conv_functions(module),
            )
            if conv is not None
            else None
        )
        self.scan = (
            scan.StatePassing(
                scan.global_space(module),
                scans,
                halo.runs(plan, rank),
                order(plan),
                rank,
                gather_states,
                plan.length if final else None,
            )
            if scans
            else None
        )

    def __enter__(self):
        if self.conv is not None:
            self.conv.__enter__()
        if self.scan is not None:
            self.scan.__enter__()
        return self

    def __exit__(self, *exc):
        if self.scan is not None:
            self.scan.__exit__(*exc)
        if self.conv is not None:
            self.conv.__exit__(*exc)

    def seen(self) -> str | None:
        """None when the convolution ran once and the scan at least once through what was intercepted; else what
        ran."""
        if self.conv is not None and self.conv.seen != 1:
            return f"its convolution ran {self.conv.seen} times through torch.nn.functional.conv1d or its dispatcher"
        if self.scan is not None and self.scan.seen == 0:  # each call (Zamba's: one per head group) splits itself
            return f"its scan ran {self.scan.seen} times through {', '.join(self.scan.scans)}"
        return None


class SequenceMixer(GatheredMixer):
    """`module.forward` of a mixer proven to split along the sequence (a halo for its convolution, its scan's
    state passed)."""

    def __init__(
        self, state, module: nn.Module, original, side: str, holder, conv, scans: dict, fallback=None, prefill=False
    ):
        super().__init__(state, original, side, holder)
        self.module, self.conv, self.scans = module, conv, scans
        self.prefill = prefill  # generation's prompt forward split too (proven: `prove_prefill`)
        self.prompts_split = 0  # prompt forwards that ran split (tests read it)
        self.fallback = fallback  # the head split, where proven: what a fused kernel's run takes instead of whole
        self._plans: dict = {}
        self.whole = self.fused = False  # set when a fused kernel is seen (fused) or a call cannot split: for good

    def __call__(self, *args, **kwargs):
        ctx = carried(kwargs) or self.holder.ctx
        if self.state.detached or not isinstance(ctx, ForwardContext) or self.side not in ctx.seqs:
            return self.step(ctx, args, {k: v for k, v in kwargs.items() if k != CONTEXT_KWARG})
        cache = next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)
        if self.state.decoding is not None or cache is not None:
            prompt = self.prefill and not self.whole and isinstance(cache, SequenceShardedCache)
            if prompt and cache.prefilling and cache.fresh(self.module.layer_idx):  # an int: `prove_prefill`
                return self._prompt(ctx, cache, args, kwargs)
            return super().__call__(*args, **kwargs)  # the cache takes the whole sequence's last inputs and state
        if self.whole:
            return self._whole("", args, kwargs)
        try:
            out, why = self._split(ctx, args, kwargs)
        except scan.Unsplit as exc:  # the same on every rank: the call's arguments are the group's
            return self._whole(str(exc), args, kwargs)
        if why is not None:  # a fused kernel (CUDA) ran it without the halo or the state: every rank alike
            return self._whole(why, args, kwargs, fused=True)
        return out

    def _split(self, ctx: ForwardContext, args, kwargs, cache=None):
        """The module's forward on this rank's tokens, its convolution given its halo and its scan the state
        before each run (with `cache`: generation's prompt forward, the whole prompt's states kept in it); (its
        output, None) or (None, what ran instead of what the proof saw)."""
        layout, plan = ctx.layout, ctx.plan(self.side)
        x = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        group, rank = layout.sp_group, layout.sp_rank
        gather = lambda e: halo._AllGatherColumns.apply(e, group, rank)
        modes = _Modes(self.module, self.conv, self.scans, plan, rank, x.device, gather, gather, cache is not None)
        if cache is not None and self.conv is not None:
            cache.conv_tail = halo.ConvTail(plan, rank, self.conv.kernel_size[0], gather)
        try:
            with modes:
                out = self.original(*args, **{k: v for k, v in kwargs.items() if k != CONTEXT_KWARG})
        finally:
            if cache is not None:
                cache.conv_tail = None
        why = modes.seen()
        return (None, why) if why is not None else (out, None)

    def _prompt(self, ctx: ForwardContext, cache, args, kwargs):
        """Generation's prompt forward split along the sequence; where it cannot split (a fused kernel), the cache
        layer is put back and the mixer runs whole for this and later prompts (a decoding step then reads the
        whole sequence's states, as it would after the mixer split), said once."""
        saved = _Saved(cache, getattr(self.module, "layer_idx", -1))
        try:
            out, why = self._split(ctx, args, kwargs, cache)
        except scan.Unsplit as exc:
            out, why = None, str(exc)
        if why is None:
            self.prompts_split += 1
            return out
        saved.restore()
        self.prefill = False
        warnings.warn(
            f"seqpar_hf: {type(self.module).__name__} {why} in generation's prompt forward, not as proven at "
            "patch_model: its prompt forwards run on the whole sequence on every rank instead of split along it",
            stacklevel=3,
        )
        return super().__call__(*args, **kwargs)

    def _whole(self, why: str, args, kwargs, fused: bool = False):
        """From now on the mixer runs by heads (a fused kernel hid the scan, and the head split is proven: the
        kernel runs on each rank's heads), else whole; said once."""
        by_heads = self.fallback is not None and (fused or self.fused)
        if not self.whole:
            self.whole, self.fused = True, fused
            instead = "split by heads" if by_heads else "on the whole sequence on every rank"
            warnings.warn(
                f"seqpar_hf: {type(self.module).__name__} {why} (a fused kernel?), not as proven at patch_model: "
                f"it runs {instead} instead of split along it",
                stacklevel=3,
            )
        return self.fallback(*args, **kwargs) if by_heads else super().__call__(*args, **kwargs)


class _Saved:
    """A cache layer's attributes before a prompt forward that may be redone whole (a fused kernel seen): its dicts
    and lists copied, its token count cloned (what the forward changes in place; its states are made new)."""

    def __init__(self, cache, index: int):
        self.layer = cache.layers[index] if 0 <= index < len(cache.layers) else None
        self.attrs = {
            k: copy.copy(v)
            if isinstance(v, (list, dict))
            else v.clone()
            if isinstance(v, torch.Tensor) and v.numel() <= 1
            else v
            for k, v in (vars(self.layer).items() if self.layer is not None else ())
        }

    def restore(self) -> None:
        if self.layer is not None:
            vars(self.layer).clear()
            vars(self.layer).update(self.attrs)


def cache_states(cache, index: int) -> list[torch.Tensor] | str:
    """The states layer `index` of `cache` holds (its convolutions' last inputs, its scans' final states, its
    token count), in a fixed order; or why none can be read."""
    layer = cache.layers[index] if index < len(cache.layers) else None
    names = ("conv_states", "recurrent_states")  # by state index (dicts in transformers 5.25)
    if layer is None or not all(isinstance(getattr(layer, n, None), (list, dict)) for n in names):
        return "keeps no convolution or recurrent states read here in its cache layer"
    held = [getattr(layer, n) for n in names]
    found = [t for h in held for t in (h.values() if isinstance(h, dict) else h) if isinstance(t, torch.Tensor)]
    count = getattr(layer, "cumulative_length_linear", None)
    return found + ([count] if isinstance(count, torch.Tensor) else [])


def prove(module: nn.Module, original, conv: nn.Conv1d | None, scans: dict, n: int) -> str | None:
    """None when, for contiguous and zigzag shards over `n` ranks, each shard's output (its halo from its
    neighbours' convolution inputs, its scan from the state of the tokens before it) is the module's own output
    at its tokens, on a random batch (two rows, the second left-padded); else why not."""
    return _prove(module, original, conv, scans, n)


def prove_prefill(module: nn.Module, original, conv: nn.Conv1d | None, scans: dict, n: int, make_cache) -> str | None:
    """None when generation's prompt forward splits along the sequence over `n` ranks: with `make_cache(n, rank)`
    (a sequence-sharded cache holding the module's own fresh cache layer), each shard's outputs are the module's
    own at its tokens and each rank's cache layer ends holding what the module's forward over the whole prompt
    leaves in it (`cache_states`); else why not."""
    name = next((k for k in CACHE_KWARGS if k in inspect.signature(original).parameters), None)
    index = getattr(module, "layer_idx", None)
    if name is None or not isinstance(index, int):
        return "takes no cache by its layer index"
    return _prove(module, original, conv, scans, n, (name, make_cache, index))


def _prove(module, original, conv, scans: dict, n: int, prefill=None) -> str | None:
    width = _width(module)
    if width is None:
        return "has no input width read here"
    # in float64 on a copy, the module's own casts to fp32 kept float64 (`KeepFloat64`): a scan's reach into the
    # previous shard can be small at initialisation, below an fp32 tolerance; in float64 only rounding is
    names = {id(m): name for name, m in module.named_modules()}
    module = copy.deepcopy(module).double()
    original = types.MethodType(getattr(original, "__func__", type(module).forward), module)
    conv = cast(nn.Conv1d, module.get_submodule(names[id(conv)])) if conv is not None else None
    p = next(module.parameters())
    g = torch.Generator().manual_seed(0)
    length = 4 * n + 3
    x = torch.randn(2, length, width, generator=g, dtype=torch.float64).to(p.device, p.dtype)
    mask = torch.ones(2, length, dtype=torch.long, device=p.device)
    mask[1, :3] = 0
    # the halos' columns first, then the states (from correct halos), then the outputs (and the final states,
    # gathered in the pass after)
    passes = (3 if scans else 2) + (1 if prefill and scans else 0)
    what = "halos and states" if scans else "halos"
    # a fused kernel behind a scan's name takes no float64: the proof runs its reference, then the kernel is
    # checked on the calls the split made (`kernels.py`)
    references = kernels.References(scan.global_space(module), {**scans, **halo.conv_functions(module)})
    try:
        with torch.no_grad(), KeepFloat64(), references:
            cached = None
            if prefill is not None:
                name, make_cache, index = prefill
                ref = make_cache(1, 0)
                want = original(x, attention_mask=mask, **{name: ref})
                cached = (name, make_cache, index, cache_states(ref, index))
                if isinstance(cached[3], str):
                    return cached[3]
            else:
                want = original(x, attention_mask=mask)
            for zigzag in (False, True):
                plans = [ShardPlan.build(length, n, r, ring_size=n, zigzag=zigzag) for r in range(n)]
                err = _split_error(module, original, conv, scans, plans, passes, x, mask, want, cached=cached)
                if isinstance(err, str):
                    return err
                if err > 1e-9:
                    return f"its shards with their {what} are not its output (relative error {err:.1e})"
    except Exception as exc:  # noqa: BLE001 - a split that does not apply: the mixer runs as before
        text = str(exc).splitlines()[0][:120] if str(exc) else ""
        return f"its shards split along the sequence fail ({type(exc).__name__}: {text})"
    return references.check(p.device)


def _split_error(module, original, conv, scans, plans, passes, x, mask, want, drop: bool = False, cached=None):
    """The largest relative error of the shards' outputs (and, `cached`, of the states each rank's cache ends
    with), the ranks run one by one; or why they cannot run."""
    n, length = len(plans), x.shape[1]
    columns: list = [[None] * n for _ in range(passes)]
    states: list = [[None] * n for _ in range(passes)]
    err = 0.0
    for step in range(passes):
        for r, plan in enumerate(plans):
            gather_columns = _Collect(columns, step, r)
            gather_states = _Collect(states, step, r, zero=drop)
            modes = _Modes(module, conv, scans, plan, r, x.device, gather_columns, gather_states, cached is not None)
            extra, cache = {}, None
            if cached is not None:
                cache = cached[1](n, r)
                cache.begin_prefill(plan.global_index(r), None, length)
                if conv is not None:
                    cache.conv_tail = halo.ConvTail(plan, r, conv.kernel_size[0], gather_columns)
                extra = {cached[0]: cache}
            with modes:
                got = original(plan.pad_and_shard(x, 0.0), attention_mask=plan.pad_and_shard(mask, 0), **extra)
            why = modes.seen()
            if why is not None:
                return why
            real = plan.global_index(r) < length
            if step == passes - 1 and real.any():  # at sp=8 the proof's 35 tokens leave a rank only padding
                ref = plan.pad_and_shard(want, 0.0)
                err = max(err, _relative(got[:, real], ref[:, real], want))
            if step == passes - 1 and cached is not None:
                why = _states_differ(cache_states(cache, cached[2]), cached[3])
                if why is not None:
                    return why
    return err


def _states_differ(mine, theirs: list) -> str | None:
    """None when a rank's cache layer holds the whole prompt's states (`theirs`), else how it does not."""
    if isinstance(mine, str) or len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
        return "its cache layer does not end with states of the kinds and shapes of the whole prompt's forward"
    err = max(_relative(a, b, b) for a, b in zip(mine, theirs))
    if err > 1e-9:
        return f"its cache layer does not end with the whole prompt's states (relative error {err:.1e})"
    return None


class KeepFloat64:
    """`.float()` and `.to(torch.float32)` keep a float64 tensor float64 while it is entered: scan functions
    compute in fp32 whatever their inputs (the gated delta rule, the SSD and selective scans), which would leave
    fp32 rounding in the proof (and in the conformance sweep's float64 re-run); the patched model runs them as
    they are. `every`: any tensor's cast to fp32 gives float64 (the sweep's re-run of a whole model, where a
    rotary's `position_ids.float()` would otherwise meet a float64 frequency table)."""

    def __init__(self, every: bool = False):
        self.every = every

    def __enter__(self):
        self.float, self.to = float_, to = torch.Tensor.float, torch.Tensor.to
        every = self.every

        def keep(t, *a, **k):
            if t.dtype == torch.float64 or every:
                a = tuple(torch.float64 if x is torch.float32 else x for x in a)
                k = {n: torch.float64 if x is torch.float32 else x for n, x in k.items()}
            return to(t, *a, **k)

        def as_float(t, *a, **k):
            if t.dtype == torch.float64:
                return t
            return to(t, torch.float64) if every else float_(t, *a, **k)

        torch.Tensor.float = as_float
        torch.Tensor.to = keep

    def __exit__(self, *exc):
        torch.Tensor.float, torch.Tensor.to = self.float, self.to


class _Collect:
    """The proof's stand-in for an all-gather: pass `step` records each shard's tensors (one per call, in call
    order) and hands every shard what all shards recorded at the same call in the pass before (zeros in the first
    pass; always, for `zero`)."""

    def __init__(self, store: list, step: int, rank: int, zero: bool = False):
        self.store, self.step, self.rank, self.zero, self.calls = store, step, rank, zero, 0
        store[step][rank] = []

    def __call__(self, e: torch.Tensor) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        self.store[self.step][self.rank].append(e)
        before = self.store[self.step - 1] if self.step else None
        if self.zero or before is None or any(b is None or len(b) <= call for b in before):
            return torch.zeros_like(e).repeat(1, 1, len(self.store[self.step]))
        return torch.cat([b[call] for b in before], -1)


def _width(module: nn.Module) -> int | None:
    out = dict(module.named_children()).get("out_proj") or dict(module.named_children()).get("o_proj")
    if isinstance(out, nn.Linear):
        return int(out.out_features)
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    return int(linears[0].in_features) if linears else None


def _relative(got: torch.Tensor, ref: torch.Tensor, whole: torch.Tensor) -> float:
    scale = whole.double().abs().max().clamp(min=1e-30)
    return float((got.double() - ref.double()).abs().max() / scale)
