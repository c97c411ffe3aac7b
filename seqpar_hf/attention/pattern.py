"""One attention pattern of one forward, and what is derived from it: built once, shared by every layer
with that pattern, by their backward, and by a layer that gradient checkpointing recomputes.

A forward has one `Pattern` per kind of attention layer (encoder self-attention, decoder self-attention,
cross-attention; a sliding-window layer and a full one are two kinds). Each derived artefact is a typed
field, `MISSING` until a kernel first needs it (None is a result: "does not apply here").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .masks import MaskSpec

MISSING = object()  # not built yet


@dataclass(eq=False)
class Pattern:
    spec: MaskSpec
    # Any: each holds MISSING until built, then what its comment says
    full: Any = MISSING  # (mask [b, 1, S_q, S_k] bool | None, is_causal): SDPA over whole sequences
    documents: Any = MISSING  # (per length group: (DocumentBatch, mask, query rows), all query rows) | None
    segments: Any = MISSING  # (cu_seqlens [n+1] int32, longest segment) for the varlen kernel | None
    ring: Any = MISSING  # this rank's RingPlan

    def full_mask(self, device):
        if self.full is MISSING:
            self.full = self.spec.full_mask(device)
        return self.full
