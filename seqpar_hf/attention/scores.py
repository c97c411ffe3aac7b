"""What a model does to its attention scores besides the mask: logit soft-capping (Gemma 2, VaultGemma,
T5Gemma: `softcap * tanh(s / softcap)` before the mask), learned sinks (gpt-oss and its kind: one
logit per head that joins every row's softmax denominator with no value, `s_aux=` / `sinks=`) and a
relative position bias (the T5 family: a learned value per head and query-key distance, added to the score).

Neither changes under a sequence split, given the right kernel: soft-capping is a function of one score,
computed in the block kernels' math (`kernels.math_forward`); a sink joins the denominator once, after the
blocks' log-sum-exp merge (`with_sinks`), and the backward of the blocks taken with that final
log-sum-exp is the sink-augmented softmax's own (its gradient: `sink_grad`). A relative bias is a function
of the two global positions: each block gathers its [rows, cols] from the by-distance table (no rank holds an
[S, S] bias), and the table's gradient is the blocks' score gradient summed by distance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KEYWORDS = ("softcap", "s_aux", "sinks")  # what an attention call passes for them


@dataclass(frozen=True)
class ScoreMods:
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [h]: one logit per query head of the call
    # a relative position bias by distance (T5): [h, 2L - 1], entry center + (key - query) for global indices
    relative: torch.Tensor | None = None
    center: int = 0

    @property
    def active(self) -> bool:
        return self.softcap is not None or self.sinks is not None or self.relative is not None

    @classmethod
    def of(cls, kwargs: dict) -> ScoreMods:
        """From an attention call's keywords (0 / None: off, as the implementations read them)."""
        cap = kwargs.get("softcap")
        sinks = kwargs.get("s_aux")
        sinks = kwargs.get("sinks") if sinks is None else sinks
        return cls(float(cap) if cap else None, sinks if isinstance(sinks, torch.Tensor) else None)

    def heads(self, lo: int, hi: int) -> ScoreMods:
        """The same for query heads [lo, hi) (a Ulysses rank's, or a chunk of them)."""
        per_head = self.sinks if self.sinks is not None else self.relative
        if per_head is None or (lo == 0 and hi == per_head.shape[0]):
            return self
        return ScoreMods(
            self.softcap,
            None if self.sinks is None else self.sinks[lo:hi],
            None if self.relative is None else self.relative[lo:hi],
            self.center,
        )


NONE = ScoreMods()


def distance_index(center: int, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
    """[rows, cols] entries of a by-distance table for queries / keys at global indices q_idx / k_idx."""
    return center + k_idx[None, :] - q_idx[:, None]


def relative_block(relative: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[h, 2L - 1] by-distance values, [rows, cols] index -> the block's additive bias [1, h, rows, cols]."""
    return relative.detach().index_select(1, index.reshape(-1)).view(1, relative.shape[0], *index.shape)


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out [b, h, s, d_v] and lse [b, h, s] over the keys (fp32; lse -inf: no key) -> the same with each
    head's sink in the denominator: out * sigmoid(lse - sink), logaddexp(lse, sink)."""
    sink = sinks.detach().to(lse.dtype)[None, :, None]  # [1, h, 1]
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total)[..., None], total


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d loss / d sinks [h] from the final out [b, h, s, d_v] and lse [b, h, s] (sinks included): the sink's
    column of the softmax backward, -p_sink * rowsum(dout * out), summed over batch and queries."""
    t = lse.dtype
    p_sink = torch.exp(sinks.detach().to(t)[None, :, None] - lse)  # [b, h, s]
    return -(p_sink * (dout.to(t) * out.to(t)).sum(-1)).sum((0, 2)).to(sinks.dtype)


def reference(q, k, v, allowed: torch.Tensor | None, scale: float, mods: ScoreMods) -> torch.Tensor:
    """Plain attention with the modifiers, differentiable: q [b, h, s_q, d], k/v [b, h, s_k, d / d_v] (heads
    already matched), allowed [b or 1, 1, s_q, s_k] bool or None -> [b, h, s_q, d_v] in fp32 or wider."""
    wide = torch.promote_types(q.dtype, torch.float32)
    scores = capped(torch.matmul(q.to(wide), k.to(wide).transpose(-1, -2)) * scale, mods.softcap)
    if mods.relative is not None:
        s_q, s_k = scores.shape[-2:]
        index = distance_index(mods.center, torch.arange(s_q, device=q.device), torch.arange(s_k, device=q.device))
        scores = scores + mods.relative.to(wide)[:, index][None]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if mods.sinks is not None:
        sink = mods.sinks.to(wide)[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.nan_to_num(0.0), v.to(wide))
