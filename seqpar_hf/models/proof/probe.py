"""Patch only what is proven: a dry run of the model at `patch_model`, on a tiny batch, locally and
identically on every rank (no process group), leaving the model, its RNG streams and caches as they were.

1. The full run: the language model's own forward on the whole batch, every attention call through
   transformers' AttentionInterface replaced by a token-local stand-in (models/proof/dryrun.py). It shows
   which module the forward runs as its backbone (the one module it calls that holds every attention
   call), what each attention call passes (its keywords, the mask pattern it is given, which sequence
   its queries and keys come from), and the model's own logits for the tiled-loss check.
2. The shard runs: the backbone on each shard of a 2-way split, its inputs sharded exactly as the patched
   forward shards them and the patch's position hooks installed, in eval and in training mode. With
   attention token-local, every other module must compute on a shard what it computes at the same
   tokens of the full sequence; the innermost module that does not (its inputs agree, its outputs do
   not) mixes tokens outside attention (a convolution, a scan, a recurrence, attention written by hand,
   positions made from the whole batch): the model is refused, naming it.
3. The packed runs (models/proof/packed_probe.py): whether the model keeps the documents of packed rows apart.
The sequence lengths fit the model's position tables (models/proof/probe_sizes.py).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ... import _compat
from ...parallel.sharding import ShardPlan
from ..forward import positions as positions_
from ..forward.context import CONTEXT_KWARG, carry
from ..forward.inputs import shard_causal, shard_seq2seq
from ..forward.sites import original_function
from ..forward.validate import SHARDED_INPUTS
from . import dryrun, mixers, probe_sizes
from .probe_checks import Refusal, culprits, describe_culprit, loss_convention, tolerance

BATCH, LEFT_PAD = 2, 3  # the lengths: models/proof/probe_sizes.py (25 and 21 tokens where the position tables allow)


@dataclass
class Observed:
    """What the dry run saw: the module the forward runs as its backbone and every attention call."""

    backbone: nn.Module
    backbone_name: str
    calls: list[dict]
    sizes: probe_sizes.Sizes = probe_sizes.Sizes(*probe_sizes.DEFAULT)
    default_positions: str = "arange"
    head_logits: tuple | None = None  # (output embeddings input, the model's logits) for the tiled-loss check
    loss_convention: str | None = None  # "shift" / "same" / "other": how the model's own loss reads its labels
    inplace: set = field(default_factory=set)  # nn.Linear modules whose outputs the model modifies in place
    full: tuple = ()  # (recorder, batch, lengths, what the backbone was called with) of the full run
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    # modules beside the backbone that a text forward never runs (a multimodal model's vision tower and
    # projector): they run before it, on the full batch, on every rank (their inputs are not refused)
    front: tuple[str, ...] = ()
    no_front: str = ""  # why a model with such modules does not get its text model as the backbone


class _Layout(SimpleNamespace):
    """The sizes a shard plan reads off a layout, for a simulated split (no process group)."""


def _sim_layout(rank: int, ring: bool) -> Any:  # Any: it stands in for a ParallelLayout (the fields read)
    return _Layout(sp_size=2, sp_rank=rank, sizes=SimpleNamespace(ring_size=2 if ring else 1, tp_size=1))


def token_ids(model, config, length: int, seed: int, rows: int = BATCH) -> torch.Tensor:
    """[rows, length] ordinary token ids: none of the config's special or modality ids."""
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None) or config.get_text_config().vocab_size
    special: set[int] = set()
    for c in probe_sizes.all_configs(config):
        for key, value in c.__dict__.items():
            if key.endswith(("_token_id", "_token_index", "_token_ids", "_id")):
                special.update(
                    v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, int)
                )
    allowed = torch.tensor([i for i in range(3, min(vocab, 1024)) if i not in special] or [vocab - 1])
    g = torch.Generator().manual_seed(seed)
    return allowed[torch.randint(len(allowed), (rows, length), generator=g)]


def _batch(model, config, kind: str, pad_id: int, device, sizes: probe_sizes.Sizes) -> dict:
    """Row 1 of the source (causal: of the sequence) left-padded by LEFT_PAD tokens."""
    ids = token_ids(model, config, sizes.causal, 0)
    mask = torch.ones_like(ids)
    mask[1, :LEFT_PAD] = 0
    ids[mask == 0] = pad_id
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    if kind == "seq2seq":
        batch["decoder_input_ids"] = token_ids(model, config, sizes.target, 1).to(device)
    return batch


def _named(forward, args: tuple, kwargs: dict) -> dict:
    params = [
        n
        for n, p in inspect.signature(forward).parameters.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return {**dict(zip(params, args)), **kwargs}


def run_forward(
    root: nn.Module,
    call,
    lengths: dict,
    names: dict,
    original,
    full: bool,
    training: bool,
    log_ops: bool,
    rows: int = BATCH,
    real=None,
):
    """One forward of `root` under the stand-in attention (`real`: softmax attention under the masks it
    makes, dryrun.Run): (recorder, run, output, error)."""
    root.train(training)
    recorder = dryrun.Recorder(root, lengths, rows)
    run = dryrun.Run(names, lengths, original, full, real)
    out, error = None, None
    try:
        with dryrun.running(run), dryrun.Determinism(recorder if log_ops else None):
            out = call()
    except Exception as exc:  # noqa: BLE001 - reported as a refusal naming where it failed
        error = (exc, [n for n in (recorder.innermost,) if n is not None])
    finally:
        recorder.remove()
    return recorder, run, out, error


def observe(pretrained: PreTrainedModel, kind: str, pad_id: int, original: str | None, guess: nn.Module) -> Observed:
    """The full run (eval): backbone, attention calls, the model's logits."""
    start = time.perf_counter()
    dryrun.register()
    device = next((p.device for p in pretrained.parameters() if p.device.type != "meta"), torch.device("cpu"))
    sizes = probe_sizes.choose(pretrained, kind)
    batch = _batch(pretrained, pretrained.config, kind, pad_id, device, sizes)
    lengths = {sizes.causal: "decoder"} if kind == "causal" else {sizes.causal: "encoder", sizes.target: "decoder"}
    names = {m: n for n, m in pretrained.named_modules(remove_duplicate=False)}
    head = pretrained.get_output_embeddings()  # None: the backbone itself was given
    captured: dict[str, torch.Tensor] = {}
    handle = (
        head.register_forward_hook(lambda m, a, o: captured.update(hidden=a[0], raw=o)) if head is not None else None
    )
    kwargs = dict(batch, return_dict=True)
    if "use_cache" in inspect.signature(pretrained.forward).parameters:
        kwargs["use_cache"] = False
    labels = None
    if head is not None:  # the model's own loss on the same forward, for the loss-convention check
        labels = (
            batch["decoder_input_ids"].clone()
            if kind == "seq2seq"
            else batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        )
    try:
        pretrained.set_attn_implementation(dryrun.STAND_IN)
        for given in (labels, None) if labels is not None else (None,):
            recorder, run, out, error = run_forward(
                pretrained,
                lambda: pretrained(**kwargs, **({"labels": given} if given is not None else {})),
                lengths,
                names,
                original_function(original),
                True,
                False,
                log_ops=False,
            )
            if error is None:
                labels = given
                break
    finally:
        if handle is not None:
            handle.remove()
    if error is not None:
        exc, stack = error
        raise Refusal(
            stack[-1] if stack else "",
            "fails in a plain forward on a tiny batch (the dry run): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
            "This model cannot be checked, so it is not patched",
        )
    sequence = [c for c in run.attention if c["q_side"] is not None]
    recorder.masks = run.masks
    backbone_name, backbone_call = _backbone(pretrained, guess, recorder, sequence, names)
    backbone = pretrained.get_submodule(backbone_name) if backbone_name else pretrained
    observed = Observed(backbone, backbone_name, run.attention, sizes)
    observed.front = _front(pretrained, recorder, backbone_name)
    observed.no_front = getattr(recorder, "no_front", "")
    # what the backbone was called with (the backbone itself: what the dry run passed it)
    called = _named(backbone.forward, *backbone_call[1:]) if backbone_call else dict(kwargs)
    front = (
        _front_masks(called["attention_mask"], run.masks) if isinstance(called.get("attention_mask"), dict) else None
    )
    if front is not None:  # the padding mask the front's masks were made of, as the sharded forward takes it
        called["attention_mask"] = front[0]
    observed.full = (recorder, batch, lengths, called)
    if head is not None and "hidden" in captured and getattr(out, "logits", None) is not None:
        observed.head_logits = (captured["hidden"], out.logits)
        observed.loss_convention = loss_convention(pretrained, labels, out)
    observed.inplace = {n for n, t, version in recorder.linear_outputs if _compat.tensor_version(t) != version}
    observed.seconds = time.perf_counter() - start
    return observed


def _backbone(pretrained, guess, recorder, sequence: list[dict], names: dict):
    """(name, (name, args, kwargs) of its call) of the module the forward runs as its backbone: the one
    module the language model calls itself that holds every attention call along the sequence."""
    if pretrained.get_output_embeddings() is None:
        return "", None  # the backbone itself was given
    attention = {c["module"] for c in sequence}
    top = [(n, a, k) for n, a, k in recorder.top]
    holding = [t for t in top if attention and all(a == t[0] or a.startswith(t[0] + ".") for a in attention)]
    if holding:
        return _inner_text_model(pretrained, recorder, attention, holding[0])
    with_attention = sorted({t[0] for t in top if any(a.startswith(t[0] + ".") for a in attention)})
    encoder, decoder = _stacks(pretrained)
    if sorted(with_attention) == sorted(n for n in (encoder, decoder) if n is not None):
        # an encoder-decoder LM that runs its two stacks itself (T5): the model's own forward is where the
        # sequences are sharded; its head runs on the decoder's shard (token-local), its loss is replaced
        return "", None
    if len(with_attention) > 1:
        listed = ", ".join(f"{n} ({type(pretrained.get_submodule(n)).__name__})" for n in with_attention)
        raise Refusal(
            "",
            f"runs attention in several modules it calls itself ({listed}), not inside one backbone",
            "seqpar_hf shards the sequence in one backbone forward: use a model whose forward "
            "runs one backbone (e.g. the decoder's own *ForCausalLM)",
        )
    # no attention through the interface: the module the forward calls that embeds the tokens (the shard
    # runs then name what mixes them)
    embeddings = pretrained.get_input_embeddings()
    for t in top:
        if t[0] and any(m is embeddings for m in pretrained.get_submodule(t[0]).modules()):
            return t[0], t
    raise Refusal(
        "",
        "calls no module that embeds its tokens and attends through transformers' AttentionInterface",
        "Use a model whose attention does",
    )


def _inner_text_model(pretrained, recorder, attention: set, holding: tuple):
    """The backbone inside `holding` (its call) where it also holds modules that a text forward never runs (a
    vision tower, a projector): the one module it calls that holds every attention call, when that call
    passes only what the backbone forward shards (a multimodal model merges its images into the text's
    embeddings before it; everything before that call runs on the full batch on every rank)."""
    name = holding[0]
    prefix = name + "." if name else ""
    if not (_idle(pretrained, recorder, name) or (name and _idle(pretrained, recorder, ""))):
        return name, holding  # (the idle modules beside it: Llama 4's vision model beside its language model)
    inner = [
        t
        for t in recorder.second
        if t[0].startswith(prefix) and all(a == t[0] or a.startswith(t[0] + ".") for a in attention)
    ]
    if len(inner) != 1:
        return name, holding
    call = _named(pretrained.get_submodule(inner[0][0]).forward, *inner[0][1:])
    made = getattr(recorder, "masks", {})  # the masks the dry run's mask function made (the front's)
    unsharded = sorted(
        k
        for k, v in call.items()
        if (isinstance(v, dict) and not (k == "attention_mask" and _front_masks(v, made) is not None))
        or (isinstance(v, torch.Tensor) and k not in SHARDED_INPUTS)
    )
    if unsharded:  # it is handed what it cannot shard (prepared masks): the images stay refused, saying why
        recorder.no_front = (
            f"its text model ({inner[0][0]}, {type(pretrained.get_submodule(inner[0][0])).__name__}) is handed "
            f"{', '.join(unsharded)} prepared on the full sequence (e.g. masks for its image blocks), which seqpar_hf "
            "does not shard"
        )
        return name, holding
    return inner[0][0], inner[0]


def _front_masks(masks: dict, made: dict):
    """(the padding mask a dict of masks was made of,) when every one is a mask the dry run's mask function made
    from the same padding mask (a front preparing its text model's masks: Gemma 3); else None. Under SP they
    come deferred, and the text model's forward reads them the same way (`forward/front_masks.py`)."""
    found = [made.get(id(m)) for m in masks.values()]
    if not found or any(r is None or r[0] is not m for r, m in zip(found, masks.values())):
        return None
    records: list[tuple] = [r for r in found if r is not None]
    padding = records[0][2]
    for r in records[1:]:
        if not (r[2] is padding or (r[2] is not None and padding is not None and torch.equal(r[2], padding))):
            return None
    return (padding,)


def _idle(pretrained, recorder, name: str) -> tuple[str, ...]:
    """The children of `name` holding parameters that the dry run's text forward never called (neither them nor
    anything inside them: a ModuleList of heads is never called itself)."""
    module = pretrained.get_submodule(name) if name else pretrained
    prefix = name + "." if name else ""
    called = set(recorder.calls)
    return tuple(
        f"{prefix}{n}"
        for n, child in module.named_children()
        if not any(c == f"{prefix}{n}" or c.startswith(f"{prefix}{n}.") for c in called)
        and any(True for _ in child.parameters())
    )


def _front(pretrained, recorder, backbone: str) -> tuple[str, ...]:
    """The idle modules beside a backbone the forward descended to (`_inner_text_model`); () elsewhere."""
    if "." not in backbone:
        return ()
    parent = backbone.rsplit(".", 1)[0]
    holding = [t for t in recorder.second if t[0] == backbone]
    beside = _idle(pretrained, recorder, "") if "." not in parent else ()  # beside the module holding it
    return tuple(dict.fromkeys(_idle(pretrained, recorder, parent) + beside)) if holding else ()


def _stacks(pretrained) -> tuple[str | None, str | None]:
    """The paths of the encoder and decoder stacks an encoder-decoder LM runs itself (None: not such a model)."""
    names = {m: n for n, m in pretrained.named_modules()}
    found = []
    for getter in ("get_encoder", "get_decoder"):
        fn = getattr(pretrained, getter, None)
        try:
            module = fn() if callable(fn) else None
        except Exception:  # noqa: BLE001 - a getter that does not apply: no stack
            module = None
        found.append(names.get(module) if module is not None and module is not pretrained else None)
    return found[0], found[1]


def shard_check(
    pretrained,
    observed: Observed,
    kind: str,
    family_positions: list,
    pad_id: int,
    ring: bool,
    original: str | None,
    attention: set | frozenset = frozenset(),
    tp: int = 1,
) -> dict:
    """Refuse (Refusal) unless every module of the backbone computes on a shard what it computes on the
    same tokens of the full sequence, in eval and in training mode, once the token mixers that can be run
    whole (models/proof/mixers.py) are: {backbone-relative path: side} of those."""
    whole: dict[str, str] = {}
    reasons: dict[str, str] = {}  # why each module run whole mixes tokens
    backbone, prefix = observed.backbone, observed.backbone_name
    while True:
        try:
            found = _shard_runs(pretrained, observed, kind, family_positions, pad_id, ring, original, whole)
        except mixers.NoContext as exc:
            name = sorted(whole)[0]
            raise Refusal(
                _path(prefix, name), f"{reasons[name]}; nor can it run on the whole sequence: {exc}", ""
            ) from None
        if found is None:
            return whole
        name, clean, shard_rec = found
        module = backbone.get_submodule(name) if name else backbone
        why = describe_culprit(module, clean, shard_rec.ops, name)
        side = mixers.side_of(shard_rec.calls.get(name, []), {})
        if name in whole or side is None or mixers.why_not(backbone, name, attention, shard_rec.ops, clean, tp):
            raise Refusal(_path(prefix, name), why, "")
        whole.update({n: side for n in mixers.same_class(backbone, name)})
        reasons.update({n: why for n in mixers.same_class(backbone, name)})


def _shard_runs(pretrained, observed, kind, family_positions, pad_id, ring, original, whole: dict):
    """The first (innermost culprit, modules proven to agree, shard recorder) of the shard runs, or None."""
    recorder, batch, lengths, backbone_kwargs = observed.full
    backbone, prefix = observed.backbone, observed.backbone_name
    names = {m: n for n, m in backbone.named_modules(remove_duplicate=False)}
    fn = original_function(original)
    shard = shard_seq2seq if kind == "seq2seq" else shard_causal
    params = inspect.signature(backbone.forward).parameters
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
    dtype = next((p.dtype for p in backbone.parameters() if p.is_floating_point()), torch.float32)
    for training in (False, True):
        captured = mixers.Capture({n: backbone.get_submodule(n) for n in whole})
        try:
            if training or whole:  # the full run again (training: capacity-limited routing, batch statistics, ...)
                recorder, _, _, error = run_forward(
                    backbone, lambda: backbone(**backbone_kwargs), lengths, names, fn, True, training, log_ops=False
                )
                full_calls = recorder.calls
                if error is not None:
                    raise Refusal(
                        _path(prefix, error[1][-1] if error[1] else ""),
                        f"fails in a {'training' if training else 'plain'}-mode forward on a "
                        "tiny batch: "
                        f"{type(error[0]).__name__}: {str(error[0]).splitlines()[0][:200]}",
                        "",
                    )
            else:
                full_calls = {_relative(prefix, n): v for n, v in recorder.calls.items()}  # names in the backbone
                full_calls.pop(None, None)
        finally:
            captured.remove()
        for rank in (0, 1):
            kw = dict(backbone_kwargs)
            ctx = shard(
                _sim_layout(rank, ring),
                kw,
                pad_id,
                local_outputs=True,
                keep_ids=True,
                default_positions=observed.default_positions,
            )
            carry(kw, ctx)
            if takes_kwargs:
                kw[CONTEXT_KWARG] = ctx
            else:  # a backbone without position_ids (refused for it): what it takes
                kw = {k: v for k, v in kw.items() if k in params}
            state = SimpleNamespace(active=ctx)
            hooks = positions_.install(state, SimpleNamespace(positions=family_positions), pad_id)
            hooks += mixers.install_replayed(backbone, whole, captured)
            local = {meta.plan.local_length: side for side, meta in ctx.seqs.items()}
            try:
                shard_rec, _, _, error = run_forward(
                    backbone, lambda: backbone(**kw), local, names, fn, False, training, log_ops=True
                )
            finally:
                for h in reversed(hooks):
                    h.remove()
            if isinstance(error[0] if error else None, mixers.NoContext):
                raise error[0]  # shard_check refuses, naming the mixer
            if error is not None:
                where = _path(prefix, error[1][-1] if error[1] else "")
                raise Refusal(
                    where,
                    f"fails on a shard of the sequence ({type(error[0]).__name__}: "
                    f"{str(error[0]).splitlines()[0][:160]}): it cannot run on part of the sequence",
                    "Train it without sequence parallelism",
                )
            keep = _keep(ctx, lengths, batch, kind)
            found = culprits(full_calls, shard_rec.calls, keep, tolerance(dtype))
            if found:
                return found[0][0], found[0][1], shard_rec
    return None


def _relative(prefix: str, name: str) -> str | None:
    """A module path relative to the backbone at `prefix` (None: outside it)."""
    if not prefix:
        return name
    return "" if name == prefix else (name[len(prefix) + 1 :] if name.startswith(prefix + ".") else None)


def _path(prefix: str, name: str) -> str:
    """A backbone-relative module path, relative to the language model."""
    return f"{prefix}.{name}".strip(".")


def _keep(ctx, lengths: dict, batch: dict, kind: str) -> dict:
    """side -> (full-run token indices, this shard's local indices) of the real tokens it holds."""
    out = {}
    mask = batch["attention_mask"].bool().all(0)  # tokens real in every row
    for side, meta in ctx.seqs.items():
        plan: ShardPlan = meta.plan
        index = plan.global_index(device=mask.device)
        local = torch.arange(index.numel(), device=mask.device)
        real = index < plan.length
        if side == ("encoder" if kind == "seq2seq" else "decoder"):
            real = real & mask[index.clamp(max=plan.length - 1)]
        out[side] = (index[real].cpu(), local[real].cpu())
    return out
