"""The attention modules of a patched model at call time, and what an attention call may pass.

Every module that calls the attention function along the sequence is an `AttentionSite`: its sides (which
sequence its queries and keys come from) and its pattern, proven at patch time (models/proof/
attention_calls.py), and the sharded attention it runs. Calls that do not run along the sequence (attention
over a token's own layer states) are a `LocalSite`: the original implementation, as it is. Keywords the
sharded attention does not honour are refused by name (`unsupported`), at patch time and again here.
"""

from __future__ import annotations

from ...attention import dispatch
from ...attention.scores import KEYWORDS as SCORE_KEYWORDS
from ...attention.scores import NONE, ScoreMods
from .context import CONTEXT_KWARG, ForwardContext
from .relative_bias import RelativeBias

_SITE = "_seqpar_site"  # on each patched attention module
HONOURED = ("dropout", "scaling", *SCORE_KEYWORDS)  # soft-capping and sinks: proven at patch time (score_mods.py)
SUPERSEDED = ("is_causal", "sliding_window")  # the pattern proven at patch time decides
CARRIED = (
    "position_ids",
    "cache_position",
    "output_attentions",
    "output_hidden_states",
    "output_router_logits",  # an MoE model's output flag, passed down with the layers' kwargs
    "use_cache",
    "return_dict",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "seq_idx",
    "layer_idx",
    "past_key_values",
    "past_key_value",
    "cache",
    "labels",
    "logits_to_keep",  # the head's; LLaVA-OneVision hands its kwargs down to the layers (no attention reads it)
    CONTEXT_KWARG,
)  # labels: only the dry run passes them this far
WHY = {
    "position_bias": "an additive bias over the whole query-key matrix",
    "indices": "a sparse selection of keys made over the whole sequence",
    "block_indices": "a sparse selection of key blocks made over the whole sequence",
}


def _neutral(value) -> bool:
    """None, False, 0: what an implementation reads as "off" (softcap=0.0, logits_to_keep=0)."""
    return value is None or (isinstance(value, (bool, int, float)) and not value)


def unsupported(kwargs: dict) -> list[str]:
    """Keywords an attention call passes with a value the sharded attention would drop."""
    return [k for k, v in kwargs.items() if k not in HONOURED + SUPERSEDED + CARRIED and not _neutral(v)]


def keyword_why(names: list[str]) -> str:
    what = "; ".join(f"{k}= ({WHY[k]})" if k in WHY else f"{k}=" for k in names)
    return f"passes {what} to the attention function, which the sequence-parallel attention does not honour"


def keyword_error(site_name: str, names: list[str]) -> str:
    return f"seqpar_hf: {site_name} {keyword_why(names)}"


def resolve(site, module, is_causal, sliding_window, kwargs: dict) -> tuple[bool, int | None]:
    """At run time: (causal, window) of this call; raises on keywords the sharded attention drops (the
    same on every rank: every rank makes the same call)."""
    bad = [k for k in unsupported(kwargs) if not (k == "position_bias" and getattr(site, "bias", None) is not None)]
    if bad:
        raise NotImplementedError(keyword_error(site.name, bad))
    pattern = getattr(site, "pattern", None)
    if pattern is not None:
        return pattern
    return bool(module.is_causal if is_causal is None else is_causal), sliding_window


class AttentionSite:
    """One attention module of a patched model: which sequences its queries and keys come from, and the
    pattern (causal, window) the unpatched model computes there (proven at patch time; None: from the
    call's keywords)."""

    local = False  # LocalSite: token-local calls that run as they are

    def __init__(
        self, state, name: str, q_side: str, kv_side: str, pattern: tuple | None = None, bias: tuple | None = None
    ):
        self.state, self.name, self.q_side, self.kv_side, self.pattern = state, name, q_side, kv_side, pattern
        self.bias = bias  # the position_bias= proven at patch time: ("zero",), ("relative", owner, side) or None

    def score_mods(self, ctx: ForwardContext, kwargs: dict) -> ScoreMods:
        """Soft-capping, sinks and a relative position bias of this call (a zero bias is no bias)."""
        mods = ScoreMods.of(kwargs)
        if self.bias is None or self.bias[0] == "zero":
            return mods
        marker = kwargs.get("position_bias")
        if not isinstance(marker, RelativeBias):
            raise RuntimeError(
                f"seqpar_hf: {self.name} was given a position_bias tensor, not the relative position bias of its owner "
                f"({type(self.bias[1]).__name__}) made for the whole sequence: something computed the bias outside "
                "the patched model's forward; call the patched model itself"
            )
        table, center = marker.table(ctx, self.q_side)
        return ScoreMods(mods.softcap, mods.sinks, table, center)

    def attend(self, ctx: ForwardContext, q, k, v, causal: bool, window, scale, dropout, mods: ScoreMods = NONE):
        """q [b, h, s_q/sp, d], k/v [b, h_kv, s_k/sp, d] -> [b, h, s_q/sp, d]."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        pattern = ctx.pattern(self.q_side, self.kv_side, causal, window, q.shape[0], q.device)
        return dispatch.attend(ctx.layout, pattern, q, k, v, scale, dropout, mods)


def original_function(implementation: str | None):
    """The attention function of the model's original implementation, for calls that are token-local
    (attention over something other than the sequence): eager's math is SDPA's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation in (None, "eager", "sdpa") or implementation not in ALL_ATTENTION_FUNCTIONS:
        return sdpa_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


class LocalSite:
    """A module whose attention calls do not run along the sequence (attention over a token's own layer
    states): token-local, so they run the original implementation, unchanged, on this rank's tokens."""

    local = True

    def __init__(self, name: str, original: str | None):
        self.name, self.function = name, original_function(original)

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k != CONTEXT_KWARG and v is not None}
        return self.function(module, query, key, value, attention_mask, **kwargs)


def site_of(module) -> AttentionSite | None:
    """The `AttentionSite` of a patched attention module (benchmarks swap its `attend`), or None."""
    return getattr(module, _SITE, None)


def set_site(module, site: AttentionSite | LocalSite | None) -> None:
    if site is not None:
        setattr(module, _SITE, site)
    elif hasattr(module, _SITE):
        delattr(module, _SITE)
