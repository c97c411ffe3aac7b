"""The tiled loss's view of the LM head: for one training forward, the head returns empty logits and
keeps its input; `TiledHead.logits(h)` is then the head and whatever the model's forward does after it,
applied chunk by chunk by `loss.tiled_token_loss_sum`.

What the forward does after the head differs by model (a bias; a scale that Cohere multiplies by,
Granite divides by and HyperCLOVA X multiplies by under the same config name; soft-capping). It is not
guessed: at patch time the candidates are tried against the model's own logits in the dry run
(`proof/probe_checks.post_processing`), and a model none of them reproduces is not tiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .state import PatchState


@dataclass(frozen=True)
class Post:
    """What the forward applies to the head's output: + bias, * scale (model.logit_scale), * or / the
    config's logits_scaling, soft-capping."""

    bias: bool = True
    scale: bool = True
    scaling: str | None = None  # "divide", "multiply" or None
    softcap: bool = True


def _config_value(model, name: str):
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for c in (config, text):
        value = getattr(c, name, None)
        if value is not None:
            return value
    return None


class TiledHead:
    def __init__(self, model, module, chunk_elements: int, post: Post = Post(scaling="divide")):
        self.module, self.hidden, self.chunk_elements = module, None, chunk_elements
        self.vocab_size = int(module.weight.shape[0])
        self.forward = module.forward  # the head's own computation (LoRA included), without module hooks
        self.bias = getattr(model, "final_logits_bias", None) if post.bias else None  # Marian, BART, Pegasus
        self.softcap = _config_value(model, "final_logit_softcapping") if post.softcap else None  # Gemma 2/3
        self.scale = getattr(model, "logit_scale", None) if post.scale else None  # Cohere multiplies
        self.scaling = _config_value(model, "logits_scaling") if post.scaling else None
        self.multiply = post.scaling == "multiply"

    @classmethod
    def make(cls, state: PatchState, model, targets: torch.Tensor) -> TiledHead | None:
        tiled = state.tiled
        if tiled.setting is False or state.layout.sizes.tp_size > 1:
            return None  # under TP the head is a DTensor module whose hooks the capture would bypass
        post = getattr(state.family, "head_post", Post(scaling="divide"))
        if post is None:
            return None  # the dry run found no post-processing reproducing the model's logits
        module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if module is None or getattr(module, "weight", None) is None:
            return None
        if tiled.setting == "auto":
            rows, length = targets.shape[0], targets.shape[-1]
            local = -(-length // state.layout.sp_size)
            if rows * local * module.weight.shape[0] < tiled.min_elements:
                return None
        return cls(model, module, tiled.chunk_elements, post)

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
        if self.scaling is not None:
            logits = logits * self.scaling if self.multiply else logits / self.scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
