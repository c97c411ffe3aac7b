"""`prove`: the model's family as the dry run shows it (probe.py), inside one context that leaves
the model as it was. Every decision here comes from what the model's code did on the dry-run batch:
which module is the backbone, which modules attend and how, which positions the backbone makes itself,
what the forward does after the LM head, whether it keeps the documents of packed rows apart, and (when
the layout splits the sequence) that nothing but attention mixes tokens."""

from __future__ import annotations

import inspect
import time
from typing import cast

import torch
from transformers import PreTrainedModel

from ..families import AttentionModule, ModelFamily
from ..forward.default_positions import RULES, compute
from ..forward.sites import original_function
from ..tp.tp_checks import layer_inputs
from . import decoder_inputs, dryrun, packed_probe, probe, relative_bias, score_mods
from .attention_calls import site_records
from .probe_checks import Refusal, post_processing, tolerance
from .signatures import error
from .structure import structure


def _valid(batch: dict, kind: str) -> dict:
    """side -> [b, s] real tokens of the dry run's batch."""
    if kind == "causal":
        return {"decoder": batch["attention_mask"].bool()}
    return {"encoder": batch["attention_mask"].bool(), "decoder": torch.ones_like(batch["decoder_input_ids"]).bool()}


def _sites(records: dict, observed, pretrained, biases: dict) -> tuple[list[AttentionModule], list[AttentionModule]]:
    prefix = observed.backbone_name
    sequence, local = [], []
    for path, record in records.items():
        inside = not prefix or path == prefix or path.startswith(prefix + ".")
        module = pretrained.get_submodule(path)
        name = path[len(prefix) + 1 :] if prefix and inside else path
        if record == "local":
            local.append(AttentionModule(name, module, None, None, 0, 0))
            continue
        if not inside:
            raise Refusal(
                path, f"attends outside the backbone the forward runs ({prefix}), where the sequence is not sharded"
            )
        q_side, kv_side, pattern, heads, kv_heads = record
        bias = biases.get(path)
        if bias is not None and bias[0] == "relative":  # the owner, as the module itself (paths move with prefixes)
            bias = ("relative", pretrained.get_submodule(bias[1]), bias[2])
        sequence.append(AttentionModule(name, module, q_side, kv_side, heads, kv_heads, pattern, bias))
    return sequence, local


def _check_loss(convention: str | None, kind: str) -> None:
    """The patched loss is the token-mean cross-entropy (+ the model's load-balancing term) with causal
    labels shifted and encoder-decoder labels as they are: the model's own loss must be that."""
    expected = "same" if kind == "seq2seq" else "shift"
    if convention in (None, expected):
        return
    if convention == "same":
        why = (
            "computes its loss against the label at the same position (no shift), where causal LMs (and the "
            "sequence-parallel loss) predict the next token"
        )
    elif convention == "shift":
        why = "shifts its encoder-decoder labels inside the loss, which the sequence-parallel loss does not"
    else:
        why = "computes a loss that is not the token-mean cross-entropy of its logits (checked on the dry run)"
    raise Refusal(
        "", why, "Train it without sequence parallelism, or with lm_loss=False and your own loss on gather_logits"
    )


def choose_default_positions(observed, pad_id: int, original: str | None) -> str:
    """The rule (models/forward/default_positions.py) the causal backbone follows when given no positions: the
    first whose explicit positions reproduce the full run's backbone output; Refusal if none does."""
    recorder, batch, lengths, kwargs = observed.full
    if (
        kwargs.get("position_ids") is not None
        or "position_ids" not in inspect.signature(observed.backbone.forward).parameters
    ):
        return "arange"
    backbone, names = observed.backbone, {m: n for n, m in observed.backbone.named_modules(remove_duplicate=False)}
    want = recorder.calls[observed.backbone_name][0]["out"]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    real = mask.bool().all(0).nonzero().flatten().cpu()  # compare the tokens real in every row
    dtype = next((p.dtype for p in backbone.parameters() if p.is_floating_point()), torch.float32)
    for rule in RULES:
        pos = compute(rule, ids, mask, probe.BATCH, observed.sizes.causal, pad_id, ids.device)
        pos = torch.arange(observed.sizes.causal, device=ids.device).unsqueeze(0) if pos is None else pos
        rec, _, _, err = probe.run_forward(
            backbone,
            lambda: backbone(**{**kwargs, "position_ids": pos}),
            lengths,
            names,
            original_function(original),
            True,
            False,
            log_ops=False,
        )
        if err is not None:
            continue
        got = rec.calls[""][0]["out"]
        errors = [error(want[p], real, got[p], real) for p in want if p in got]
        if errors and all(e is not None and e <= tolerance(dtype) for e in errors):
            return rule
    raise Refusal(
        observed.backbone_name,
        "makes its own positions when given none, from the whole batch, by none of "
        "the rules seqpar_hf reproduces (0..S-1, cumsum of the attention mask, padding-aware ids)",
        "Train it without sequence parallelism",
    )


def prove(pretrained, kind: str, pad_id: int, original: str | None, guess, split: bool, ring: bool) -> ModelFamily:
    start = time.perf_counter()
    with dryrun.Preserved(pretrained):
        observed = probe.observe(pretrained, kind, pad_id, original, guess)
        backbone = observed.backbone
        _, batch, _, _ = observed.full
        biases = relative_bias.classify(pretrained, observed.calls)
        records = site_records(observed.calls, original, _valid(batch, kind), biases)
        score_mods.check(pretrained, observed.calls, original)
        attention, local = _sites(records, observed, pretrained, biases)
        _check_loss(observed.loss_convention, kind)
        positions, stacks = structure(pretrained, kind, backbone)
        no_positions = kind == "causal" and "position_ids" not in inspect.signature(backbone.forward).parameters
        if kind == "causal" and (split or not attention) and not no_positions:
            observed.default_positions = choose_default_positions(observed, pad_id, original)
        mixers: dict = {}
        if split or not attention or no_positions:  # without attention (or positions), name what mixes tokens
            held = {a.name for a in attention + local}
            mixers = probe.shard_check(pretrained, observed, kind, positions, pad_id, ring, original, held)
        if no_positions and attention:  # without attention nothing reads positions but what the shard runs check
            raise Refusal(
                "",
                "runs a backbone that takes no position_ids, so shards cannot be given their global positions",
                "Use a model whose forward takes position_ids",
            )
        # without attention (Mamba, Mamba2) the mixers must divide: models/mixers/install.py refuses it otherwise
        if not attention and not mixers:
            raise Refusal(
                "",
                "calls no attention along the sequence through transformers' AttentionInterface "
                "(found no attention modules)",
                "Use a model whose attention does (most models in transformers 5)",
            )
        if not split:  # one rank (sp=1, no TP): nothing is sharded, every mixer runs as it is
            mixers = {}
        head_post = None
        if observed.head_logits is not None:
            head_post = post_processing(pretrained, *observed.head_logits)
        # the kinds of packed rows the unpatched model does not keep apart (seq2seq rows: seqpar_hf's convention)
        packed = packed_probe.check(pretrained, observed, records, original) if kind == "causal" else {}
        decoder_ids = (
            decoder_inputs.read(pretrained, backbone, batch, original)
            if kind == "seq2seq" and observed.head_logits is not None
            else None
        )
    family = ModelFamily(
        kind,
        pretrained,
        # the model itself or the base model it calls (what its base_model_prefix names): a PreTrainedModel
        cast(PreTrainedModel, backbone),
        # a head on top of the backbone, or inside it (an encoder-decoder LM that runs its two stacks itself)
        backbone is not pretrained or observed.head_logits is not None,
        attention,
        positions,
        stacks,
        local,
        observed.default_positions,
        head_post,
        packed_rows=packed,
        decoder_ids=decoder_ids,
        mixers=mixers,
        front=observed.front,
        no_front=observed.no_front,
    )
    prefix = observed.backbone_name
    family.layer_inputs = layer_inputs(family, observed.full[0].calls, prefix)
    family.inplace_outputs = {
        n[len(prefix) + 1 :] if prefix else n for n in observed.inplace if not prefix or n.startswith(prefix + ".")
    }
    family.dry_run_seconds = time.perf_counter() - start
    return family
