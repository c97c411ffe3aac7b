"""The tiled loss's view of the LM head: for one training forward, the head returns empty logits and
keeps its input; `TiledHead.logits(h)` is then the head and whatever the model's forward does after it,
applied chunk by chunk by `loss.tiled_token_loss_sum`."""

from __future__ import annotations

import torch

from .state import PatchState


class TiledHead:
    def __init__(self, model, module, chunk_elements: int):
        self.module, self.hidden, self.chunk_elements = module, None, chunk_elements
        self.vocab_size = int(module.weight.shape[0])
        self.forward = module.forward  # the head's own computation (LoRA included), without module hooks
        config = model.config
        self.bias = getattr(model, "final_logits_bias", None)  # Marian, BART, mBART, Pegasus
        self.softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3
        self.scale = getattr(model, "logit_scale", None)  # Cohere multiplies
        self.divide = getattr(config, "logits_scaling", None)  # Granite divides

    @classmethod
    def make(cls, state: PatchState, model, targets: torch.Tensor) -> "TiledHead | None":
        tiled = state.tiled
        if tiled.setting is False or state.layout.sizes.tp_size > 1:
            return None  # under TP the head is a DTensor module whose hooks the capture would bypass
        module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if module is None or getattr(module, "weight", None) is None:
            return None
        if tiled.setting == "auto":
            rows, length = targets.shape[0], targets.shape[-1]
            local = -(-length // state.layout.sp_size)
            if rows * local * module.weight.shape[0] < tiled.min_elements:
                return None
        return cls(model, module, tiled.chunk_elements)

    def __enter__(self):
        self.had = "forward" in self.module.__dict__
        self.module.forward = self._capture
        return self

    def __exit__(self, *exc):
        if self.had:
            self.module.forward = self.forward
        else:
            del self.module.forward

    def _capture(self, hidden):
        self.hidden = hidden
        return hidden.new_empty(*hidden.shape[:-2], 0, self.vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.forward(hidden)
        if self.bias is not None:
            logits = logits + self.bias.to(logits.device)[0]
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide is not None:
            logits = logits / self.divide
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
