"""The model of bytes: per-rank memory at the peak of one training step, for one model and one layout.

For a decoder-only transformer (Llama-like: RMSNorm, rotary, SwiGLU MLP, grouped-query attention,
an LM head over the vocabulary), `batch` sequences of `seq_len` tokens per SP group, AdamW with fp32
states, it counts per rank:

- states: parameters, gradients and the two AdamW moments (16 bytes per parameter in fp32, or bf16
  weights with fp32 master copy, gradients and moments: 16 as well), divided by the ranks that hold
  the same weights (FSDP2 over dp x sp) and by tp; plus what FSDP gathers while it runs (the root's
  embeddings, head and final norm stay whole through forward and backward; one layer in flight);
- activations: what autograd saves for backward per local token per layer (counted tensor by tensor
  for the Llama layer in transformers: norms, projections, rotary q/k, SDPA output and log-sum-exp,
  the SwiGLU MLP; Ulysses keeps the attention output in both layouts and gives each rank at least one
  kv head; checkpointing keeps one layer input per layer and recomputes one layer at a time);
- logits: cross-entropy's log-softmax and the logits' gradient ([tokens, vocab] fp32, twice), or with
  the tiled loss a fixed chunk (seqpar_hf.models.forward.loss.TILED_LOSS_CHUNK_ELEMENTS) and a copy of the
  head's input;
- communication buffers: Ulysses all-to-all (q, k, v in and out), ring k/v blocks in flight, TP
  all-gathered [s, h] inputs.

The peak is the largest of three moments of the step: the start of backward (all activations, the
loss's gradients), the end of backward (all gradients), the optimizer step. Validated against the
exact per-rank counts of benchmarks/longest_sequence.py (tests/test_plan.py: within 10%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from ..models.forward.loss import TILED_LOSS_CHUNK_ELEMENTS
from . import checks

MODES = ("ulysses", "ring")  # what the planner counts; hybrid is a ring of Ulysses groups, not modelled


@dataclass(frozen=True)
class Model:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False

    def __post_init__(self):
        checks.model_sizes({f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h = self.hidden
        return h * (2 * self.q_dim + 2 * self.kv_dim) + 3 * h * self.ffn + 2 * h

    @property
    def root_params(self) -> int:
        """Embeddings, head and final norm: FSDP's root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


@dataclass(frozen=True)
class Layout:
    sp: int = 1
    tp: int = 1
    mode: str = "ulysses"
    checkpointing: bool = False
    tiled: bool = False
    fsdp: bool = True  # over dp x sp when more than one rank holds the weights
    offload: bool = False  # checkpointed layer inputs in host memory (seqpar_hf/memory/offload.py)
    tiled_mlp: bool = False  # the MLP over tiles of hidden-size tokens (seqpar_hf/memory/tiled_mlp.py)

    def __post_init__(self):
        checks.positive_int("sp", self.sp)
        checks.positive_int("tp", self.tp)
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: the planner counts one of {', '.join(map(repr, MODES))}")
        if self.offload and not self.checkpointing:
            raise ValueError("offload: the offloaded tensors are the checkpointed layer inputs; needs checkpointing")

    def describe(self) -> str:
        parts = [f"sp={self.sp}" + (f" {self.mode}" if self.sp > 1 else ""), f"tp={self.tp}"]
        parts += ["checkpointing"] if self.checkpointing else []
        parts += ["tiled loss"] if self.tiled else []
        parts += ["offload"] if self.offload else []
        parts += ["tiled MLP"] if self.tiled_mlp else []
        return ", ".join(parts)


@dataclass
class Breakdown:
    layout: Layout
    parts: dict = field(default_factory=dict)  # at the peak moment
    moment: str = ""
    peak: float = 0.0


def check_step(model: Model, layout: Layout, seq_len: int, gpus: int, act_bytes: int = 4, batch: int = 1) -> None:
    """What `plan` needs: positive sizes, a layout that tiles `gpus` and splits the heads as the code does."""
    checks.positive_int("seq_len", seq_len)
    checks.positive_int("batch", batch)
    checks.positive_int("gpus", gpus)
    if act_bytes not in (2, 4):
        raise ValueError(f"act_bytes {act_bytes!r}: must be 2 (bf16) or 4 (fp32)")
    sp, tp = layout.sp, layout.tp
    if gpus % (sp * tp):
        raise ValueError(f"gpus {gpus}: must be a multiple of sp x tp = {sp} x {tp} (dp = gpus / (sp x tp))")
    if model.heads % tp or model.kv_heads % tp:
        raise ValueError(
            f"tp {tp}: must divide heads {model.heads} and kv_heads {model.kv_heads} "
            "(tensor parallelism shards whole heads)"
        )
    if sp > 1 and layout.mode == "ulysses" and model.heads // tp < sp:
        raise ValueError(
            f"sp {sp} with mode 'ulysses': Ulysses splits the {model.heads // tp} heads per tp rank over "
            f"the sp ranks, so sp must be <= {model.heads // tp}; use mode 'ring'"
        )


def plan(model: Model, layout: Layout, seq_len: int, gpus: int, act_bytes: int = 4, batch: int = 1) -> Breakdown:
    """Per-rank bytes at the peak of one training step (forward, backward, AdamW step)."""
    check_step(model, layout, seq_len, gpus, act_bytes, batch)
    m, sp, tp = model, layout.sp, layout.tp
    dp = gpus // (sp * tp)
    shards = dp * sp if layout.fsdp else 1
    h, e = m.hidden, act_bytes
    local = batch * math.ceil(seq_len / sp)  # tokens per rank

    # -- states: weights (fp32 or bf16 + fp32 master), gradients, AdamW moments -----------------------
    P = m.params / tp
    weights = P * 4 / shards + (P * 2 / shards if e == 2 else 0)
    moments = P * 8 / shards
    grads = P * 4 / shards
    gathered = 0.0  # FSDP all-gathers into new buffers: the root's stay through forward and backward; a layer's
    if shards > 1:
        gathered = (m.root_params + m.layer_params) / tp * 4
    root_grads = (m.root_params / tp) * 4 if shards > 1 else 0.0  # whole until backward's end

    # -- activations saved per local token ----------------------------------------------------------
    q_loc, kv_loc = m.heads / tp, m.kv_heads / tp
    if sp > 1 and layout.mode == "ulysses":
        kv_eff = max(kv_loc, min(sp, q_loc)) * m.head_dim  # each rank needs at least one kv head
        lse, extra = q_loc, q_loc * m.head_dim  # attention output kept head- and sequence-sharded
    else:
        kv_eff, lse, extra = kv_loc * m.head_dim, q_loc, 0.0
    q_dim, ffn = q_loc * m.head_dim, m.ffn / tp
    # Llama layer, elements per token: 2 RMSNorms (input, normed x rsqrt: 2h + 1 each), q/k/v
    # projections' shared input (h), rotary q and k, v, SDPA output and log-sum-exp, o_proj input,
    # gate/up outputs, SiLU output and product (4 ffn)
    # the tiled MLP keeps only its input (counted with the norms); one tile's intermediates live while it runs:
    # gate/up outputs, SiLU output and product, and in backward two gradients of them (6 ffn per tile token)
    mlp = 0.0 if layout.tiled_mlp else 4 * ffn
    per_layer = 2 * (2 * h + 1) + h + (q_dim + 2 * kv_eff) + q_dim + lse + extra + mlp
    if tp > 1:  # TP+SP: norms sharded by tp, the all-gathered inputs of q and gate kept whole
        per_layer = (2 * (2 * h + 1)) / tp + 2 * h + (q_dim + 2 * kv_eff) + q_dim + lse + extra + mlp
    # a tile: hidden-size positions of this rank's slice (under TP, of each TP rank's slice: tp times the tokens)
    tile = min(local, h * tp) * 6 * ffn * e if layout.tiled_mlp else 0.0
    final = 2 * h + 1  # final norm
    # checkpointed inputs on the device: every layer's, or with offload the one being copied and the one prefetched
    kept = min(2, m.layers) * h if layout.offload else m.layers * h
    saved = (kept if layout.checkpointing else m.layers * per_layer) + final
    tiled = layout.tiled and tp == 1
    if tiled:
        chunk = min(local, max(1, TILED_LOSS_CHUNK_ELEMENTS // m.vocab)) * m.vocab
        # one chunk: logits, log-softmax, their gradients; a copy of the head's input (labelled tokens),
        # its gradient, the kept tokens' indices and targets (int64)
        logits_bytes = 4 * chunk * 4 + 2 * local * h * e + 2 * local * 8
    else:  # cross-entropy's log-softmax saved (fp32), then in backward its gradient and the logits'
        logits_bytes = 3 * local * m.vocab * 4
    activations = local * saved * e + tile

    # -- communication buffers --------------------------------------------------------------------
    if sp > 1 and layout.mode == "ulysses":
        comm = local * (q_dim + 2 * kv_eff + q_dim) * e  # all-to-all of q, k, v and the output
    elif sp > 1:
        comm = 4 * local * kv_eff * e  # k, v of the block in hand and the one arriving
    else:
        comm = 0.0
    if tp > 1:
        comm += local * h * e  # the all-gathered [s, h] input in flight

    # start of backward: every saved activation and the loss's [tokens, vocab] tensors
    early = dict(
        states=weights + moments,
        fsdp_gathered=gathered,
        activations=activations,
        logits=logits_bytes,
        communication=comm,
    )
    # with checkpointing, the backward of the last layer: its recomputed activations and the gradients
    # of its SwiGLU intermediates and hidden state; the head's gradient
    head_grad = m.vocab * h / tp * 4
    recompute = dict(
        states=weights + moments + head_grad,
        fsdp_gathered=gathered,
        activations=local * (kept + per_layer + (0 if layout.tiled_mlp else 2 * ffn) + h) * e + tile,
        logits=0.0,
        communication=0.0,
    )  # the recomputed forward's all-to-all buffers are freed by then
    # end of backward: every gradient (FSDP: sharded, but the root's whole until reduce-scattered)
    end = dict(
        states=weights + moments + (grads + root_grads if shards > 1 else P * 4),
        fsdp_gathered=gathered,
        activations=0.0,
        logits=0.0,
        communication=0.0,
    )
    largest_param = max(m.vocab * h, h * m.ffn) / tp / shards * 4
    optimizer = dict(
        states=weights + moments + grads,
        fsdp_gathered=0.0,
        activations=0.0,
        logits=0.0,
        communication=0.0,
        optimizer_temporaries=2 * largest_param,
    )
    moments_ = {"start of backward": early, "end of backward": end, "optimizer step": optimizer}
    if layout.checkpointing:
        moments_["recompute in backward"] = recompute
    name, parts = max(moments_.items(), key=lambda kv: sum(kv[1].values()))
    return Breakdown(layout, parts, name, sum(parts.values()))
