"""The machinery of patch-time dry runs (used by models/proof/probe.py): run a model on a tiny batch with every
attention call through transformers' AttentionInterface replaced by a token-local stand-in, record what
every module takes and returns (per-token fingerprints) and what each attention call passes, and
leave the model exactly as it was: training modes, buffers, module attributes (some modules cache
state in forward), configs, and the RNG streams. Everything runs locally, identically on every rank.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface
from transformers.configuration_utils import PreTrainedConfig
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ... import _compat
from ...attention.mask_patterns import chunks_follow_padding, read_function
from ...attention.masks import Chunks
from ...attention.scores import NONE, ScoreMods, reference
from ..forward.context import CONTEXT_KWARG
from . import temperature
from .signatures import collect

STAND_IN = "seqpar_hf_dry_run"  # the attention implementation a dry run selects
_RUN: contextvars.ContextVar = contextvars.ContextVar("seqpar_hf_dry_run", default=None)
_DROPOUT = {
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
    F.alpha_dropout,
    F.feature_alpha_dropout,
    torch.dropout,
    torch.alpha_dropout,
    torch.feature_dropout,
    torch.feature_alpha_dropout,
}
# operations that mix along a dim, logged (for refusal messages) when that dim is a sequence of the run
_ALONG = {
    F.softmax: "softmax",
    torch.softmax: "softmax",
    torch.Tensor.softmax: "softmax",
    torch.cumsum: "scan",
    torch.Tensor.cumsum: "scan",
    torch.cumprod: "scan",
    torch.Tensor.cumprod: "scan",
    torch.topk: "selection",
    torch.Tensor.topk: "selection",
    torch.argsort: "selection",
    torch.Tensor.argsort: "selection",
    torch.sort: "selection",
    torch.Tensor.sort: "selection",
}
_ALWAYS = {F.scaled_dot_product_attention: "softmax", F.conv1d: "convolution"}


class Preserved(contextlib.ExitStack):
    """Inside it, anything a forward may change on the model is restored on exit."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def __enter__(self):
        super().__enter__()
        modules = list(self.model.modules())
        self.modes = [(m, m.training) for m in modules]
        self.dicts = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in modules]
        buffers = {id(b): b for m in modules for b in m._buffers.values() if isinstance(b, torch.Tensor)}
        self.values = [(b, b.detach().clone()) for b in buffers.values() if b.device.type != "meta"]
        configs = {}
        for m in modules:
            _configs(getattr(m, "config", None), configs)
        self.configs = [(c, dict(c.__dict__)) for c in configs.values()]
        devices = sorted({p.device.index or 0 for p in self.model.parameters() if p.device.type == "cuda"})
        self.enter_context(torch.random.fork_rng(devices=devices))
        self.enter_context(torch.no_grad())
        return self

    def __exit__(self, *exc):
        try:
            for m, saved, params, buffers, children in self.dicts:
                for key in [k for k in m.__dict__ if k not in saved]:
                    del m.__dict__[key]
                for key, value in saved.items():
                    if m.__dict__.get(key) is not value:
                        m.__dict__[key] = value
                for current, old in ((m._parameters, params), (m._buffers, buffers), (m._modules, children)):
                    # by identity: `!=` on dicts compares tensors by value (and raises). A forward that
                    # re-registers a buffer (dynamic RoPE's inv_freq) gets its own tensor back
                    if current.keys() != old.keys() or any(current[k] is not v for k, v in old.items()):
                        current.clear()
                        current.update(old)
            with torch.no_grad():
                for b, value in self.values:
                    if b.shape == value.shape:
                        b.copy_(value)
            for c, saved in self.configs:
                c.__dict__.clear()
                c.__dict__.update(saved)
            for m, mode in self.modes:
                m.training = mode
        finally:
            super().__exit__(*exc)  # a failure to restore propagates: never a silently altered model
        return False


def _configs(config, found: dict) -> None:
    if isinstance(config, PreTrainedConfig) and id(config) not in found:
        found[id(config)] = config
        for value in list(config.__dict__.values()):
            _configs(value, found)


class Determinism(TorchFunctionMode):
    """Dropout is the identity and random draws are their distribution's centre, so that a training-mode
    run on the full sequence and on a shard compute the same thing wherever the model is token-local
    (the draws of a shorter sequence differ). Optionally logs which mixing operations (softmax,
    convolutions, scans) each module calls, for the refusal messages."""

    def __init__(self, recorder=None):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUT:
            return args[0] if args else kwargs["input"]
        if self.recorder is not None and self.recorder.stack and (func in _ALONG or func in _ALWAYS):
            what = _ALWAYS.get(func) or self._along(func, args, kwargs)
            if what:
                self.recorder.ops.setdefault(self.recorder.stack[-1], set()).add(what)
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in ("rand", "rand_like", "uniform_") and isinstance(out, torch.Tensor):
            low, high = (args[1:3] + (0.0, 1.0)[len(args[1:3]) :]) if name == "uniform_" else (0.0, 1.0)
            out.fill_((kwargs.get("from", low) + kwargs.get("to", high)) / 2)
        elif name in ("randn", "randn_like", "normal_") and isinstance(out, torch.Tensor) and out.is_floating_point():
            out.fill_(kwargs.get("mean", args[1] if name == "normal_" and len(args) > 1 else 0.0))
        elif name in ("bernoulli", "bernoulli_") and isinstance(out, torch.Tensor):
            out.fill_(1)
        return out

    def _along(self, func, args, kwargs) -> str | None:
        """ "softmax" / "scan" / "selection" when `func` runs along a sequence dim (or flattened tokens)."""
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or not x.dim():
            return None
        position = 2 if func in (torch.topk, torch.Tensor.topk) else 1  # topk(x, k, dim); the others (x, dim)
        dim = kwargs.get("dim", args[position] if len(args) > position else -1)
        if not isinstance(dim, int):
            return None
        n = x.shape[dim]
        lengths, batch = self.recorder.lengths, self.recorder.batch
        if n in lengths:
            return _ALONG[func]
        if n % batch == 0 and n // batch in lengths:
            return _ALONG[func] + "-tokens"
        return None


class Recorder:
    """Forward hooks on every module: fingerprints of inputs (before the module runs: some write into
    them) and outputs, per call; the stack of running modules; the calls the root makes directly."""

    def __init__(self, root: nn.Module, lengths: dict, batch: int):
        self.lengths, self.batch = lengths, batch
        self.names = {m: n for n, m in root.named_modules(remove_duplicate=False)}
        self.calls: dict[str, list] = {}
        self.stack: list[str] = []
        self.top: list[tuple[str, tuple, dict]] = []  # (name, args, kwargs) of the root's direct calls
        self.second: list[tuple[str, tuple, dict]] = []  # the calls those modules make directly
        self.no_front = ""  # proof/probe.py `_inner_text_model`: why the backbone stays above a text model
        self.ops: dict[str, set] = {}
        self.innermost: str | None = None  # the innermost module that returned None (where a forward raised)
        self.linear_outputs: list[tuple[str, torch.Tensor, int]] = []  # to see what is modified in place later
        self.handles = []
        for module in dict.fromkeys(root.modules()):
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True, always_call=True))

    def _pre(self, module, args, kwargs):
        name = self.names.get(module, "?")
        if len(self.stack) == 1:
            self.top.append((name, args, dict(kwargs)))
        elif len(self.stack) == 2:
            self.second.append((name, args, dict(kwargs)))
        self.stack.append(name)
        self.calls.setdefault(name, []).append({"in": collect((args, kwargs), self.lengths, self.batch)})

    def _post(self, module, args, kwargs, output):
        name = self.names.get(module, "?")
        if output is None and self.innermost is None:  # also called when forward raised: the innermost first
            self.innermost = name
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
            self.calls[name][-1]["out"] = collect(output, self.lengths, self.batch)
        if isinstance(module, nn.Linear) and isinstance(output, torch.Tensor):
            self.linear_outputs.append((name, output, _compat.tensor_version(output)))

    def remove(self):
        for h in self.handles:
            h.remove()


class Run:
    """One forward of a dry run: what the stand-in attention and mask functions record and return."""

    def __init__(self, names: dict, lengths: dict, original, full: bool, real=None):
        self.names, self.lengths, self.original, self.full = names, lengths, original, full
        # real(call, query, key) -> [b or 1, 1, s_q, s_k] mask (bool, or additive): softmax attention under
        # it instead of the token-local stand-in (models/proof/packed_probe.py); None: the stand-in
        self.real = real
        self.attention: list[dict] = []  # one record per attention call
        self.masks: dict[int, tuple] = {}  # id of a mask tensor we returned -> (tensor, pattern, its padding mask)

    def mask(
        self,
        batch_size,
        q_length,
        kv_length,
        q_offset=0,
        kv_offset=0,
        mask_function=None,
        attention_mask=None,
        **kwargs,
    ):
        """The shard runs get no mask, as the patched model; the full run a real one, remembered with the
        pattern read off its mask function (so each attention call knows which pattern it was given)."""
        if not self.full or mask_function is None:
            return None
        pattern = read_function(mask_function)
        if pattern is not None and isinstance(pattern[1], Chunks):
            if not chunks_follow_padding(mask_function, pattern[1].size, attention_mask, batch_size):
                pattern = None  # chunks counted from somewhere the sharded kernels do not count them from
        kwargs = {
            k: v
            for k, v in kwargs.items()
            if k not in ("allow_is_causal_skip", "allow_is_bidirectional_skip", "allow_torch_fix")
        }
        try:
            mask = sdpa_mask(
                batch_size=batch_size,
                q_length=q_length,
                kv_length=kv_length,
                q_offset=q_offset,
                kv_offset=kv_offset,
                mask_function=mask_function,
                attention_mask=attention_mask,
                allow_is_causal_skip=False,
                allow_is_bidirectional_skip=False,
                **kwargs,
            )
        except Exception:  # noqa: BLE001 - a mask function that cannot be materialised: the pattern says why
            mask = None
        if mask is None:
            mask = torch.ones(batch_size, 1, q_length, kv_length, dtype=torch.bool)
        self.masks[id(mask)] = (mask, pattern, attention_mask)
        return mask

    def attend(self, module, query, key, value, attention_mask, **kwargs):
        """Token-local stand-in: query i reads value i (plus q_i . k_i, so that mixing inside q or k shows);
        cross-attention (other lengths) reads its query only. q [b, h, s_q, d], k/v [b, h_kv, s_k, d_v]."""
        q_side, kv_side = self.lengths.get(query.shape[2]), self.lengths.get(key.shape[2])
        known = attention_mask is not None and id(attention_mask) in self.masks
        given = self.masks[id(attention_mask)][1] if known else None
        self.attention.append(
            {
                "module": self.names.get(module, type(module).__name__),
                "cls": type(module).__name__,
                "q": tuple(query.shape),
                "k": tuple(key.shape),
                "v": tuple(value.shape),
                "q_side": q_side,
                "kv_side": kv_side,
                "mask": attention_mask,
                "given": known,
                "pattern": given,
                "kwargs": {k: v for k, v in kwargs.items()},
                "is_causal_attr": getattr(module, "is_causal", None),
            }
        )
        if q_side is None:  # not along the sequence (e.g. over a token's layers): token-local, run it as is
            return self.original(module, query, key, value, attention_mask, **kwargs)
        ctx = kwargs.get(CONTEXT_KWARG)
        if not self.full and ctx is not None:  # a shard run: queries scaled by their index, as sp_attention does
            query = temperature.on_shard(module, query, ctx.plan(q_side))
        if self.real is not None:
            return softmax_attention(
                query,
                key,
                value,
                self.real(self.attention[-1], query, key),
                kwargs.get("scaling"),
                ScoreMods.of(kwargs),
            )
        h, d_v = query.shape[1], value.shape[-1]
        if kv_side == q_side and key.shape[2] == query.shape[2]:
            index = torch.arange(h, device=query.device) * key.shape[1] // h  # GQA: each query head's kv head
            k, v = key.index_select(1, index), value.index_select(1, index)
            out = v.to(query.dtype) + 1e-2 * (query * k[..., : query.shape[-1]]).sum(-1, keepdim=True)
        else:
            out = 1e-2 * query.sum(-1, keepdim=True).expand(*query.shape[:3], d_v)
        return out.transpose(1, 2).contiguous(), None  # [b, s_q, h, d_v]


def softmax_attention(query, key, value, mask, scaling=None, mods: ScoreMods = NONE):
    """Plain attention: q [b, h, s_q, d], k/v [b, h_kv, s_k, d_v], mask [b or 1, 1, s_q, s_k] (bool:
    True attends; else added) -> [b, s_q, h, d_v]; with soft-capping and sinks where the call has them."""
    h = query.shape[1]
    index = torch.arange(h, device=query.device) * key.shape[1] // h  # GQA: each query head's kv head
    k, v = key.index_select(1, index), value.index_select(1, index)
    if mods.active and (mask is None or mask.dtype == torch.bool):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return reference(query, k, v, mask, scale, mods).to(v.dtype).transpose(1, 2).contiguous(), None
    wide = torch.promote_types(query.dtype, torch.float32)
    scores = (query @ k.transpose(-1, -2)).to(wide) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(wide)
    out = torch.softmax(scores, dim=-1).to(v.dtype) @ v  # [b, h, s_q, d_v]
    return out.transpose(1, 2).contiguous(), None


def _stand_in_attention(module, query, key, value, attention_mask, **kwargs):
    return _RUN.get().attend(module, query, key, value, attention_mask, **kwargs)


def _stand_in_mask(*args, **kwargs):
    return _RUN.get().mask(*args, **kwargs)


@functools.cache
def register() -> None:
    AttentionInterface.register(STAND_IN, _stand_in_attention)
    AttentionMaskInterface.register(STAND_IN, _stand_in_mask)


@contextlib.contextmanager
def running(run: Run):
    token = _RUN.set(run)
    try:
        yield run
    finally:
        _RUN.reset(token)
