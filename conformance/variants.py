"""The three variants of a sweep row: what batch, what the unpatched model computes on it (the
reference), and the patched model's errors against it.

  padded    3 rows, padding on both sides (left on one row, right on another; right only under eager
            attention), loss, every gradient, eval logits at real tokens; seq2seq: right-padded sources,
            source length != target length
  packed    decoder-only: one row of 5 documents as DataCollatorWithFlattening gives it (position_ids
            restarting, no attention mask), use_cache=False on both sides, the reference the unpatched
            model on the same row; seq2seq: seqpar_hf's Seq2SeqPackingCollator, the reference each
            (source, target) pair alone (loss weighted by its tokens); loss, every gradient, eval logits
  generate  greedy, 8 new tokens, every rank the same full batch: the tokens and every step's scores
            (encoder-decoders made lively first, so that their tokens depend on the source)

Each variant: `prepare(model)` -> the model it runs (before the unpatched copy is taken);
`inputs(model, info)` -> batch; `reference(model, batch)` -> (numbers, batch);
`patched(model, numbers, batch, layout)` -> {error name: value}.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .batches import (
    PAIR_ROW,
    causal_batch,
    causal_packed_batch,
    decoder_inputs,
    generate_inputs,
    pad_id,
    seq2seq_batch,
    seq2seq_pairs,
)
from .numerics import average_gradients, compare, finite_error, full, gradients, relative_error
from .tiny import is_seq2seq

TRAIN_ERRORS = ("loss_err", "grad_err", "logits_err")
GENERATE_ERRORS = ("tokens_err", "scores_err")
NEW_TOKENS = 8
LIVELY = 0.2  # std of the noise added to a seq2seq model's matrices for generate (see _lively)


@dataclass(frozen=True)
class Variant:
    name: str
    inputs: Callable
    reference: Callable
    patched: Callable
    errors: tuple
    prepare: Callable = lambda model: model


# ---------------------------------------------------------------------------------------------
# padded


def padded_inputs(model, info: dict) -> dict:
    """Seq2seq (source 13, target 9) or causal (length 13, row 1 left-padded, row 2 right-padded). Under
    eager attention row 1 is right-padded too: the first real token of a left-padded row is predicted from
    a padded query that sees no key, which eager attention makes the mean of every value and SDPA zero
    (transformers' own implementations disagree there; seqpar_hf computes SDPA's, docs/supported-models.md)."""
    pad = pad_id(model)
    if is_seq2seq(model):
        return seq2seq_batch(pad)
    batch = causal_batch(pad, left_pad=info["attn"] == "sdpa")
    if info.get("labels") == "codebooks":  # audio-code LMs: labels [batch, length, codebooks]
        batch["labels"] = batch["labels"].unsqueeze(-1)
    return batch


def eval_inputs(model, batch: dict) -> dict:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if is_seq2seq(model) and "decoder_input_ids" not in inputs:
        inputs["decoder_input_ids"] = decoder_inputs(model, batch["labels"])
    return inputs


def reference_run(model, batch: dict) -> dict:
    """Loss, gradients (name -> tensor) and eval logits of the unpatched model; raises if it cannot run."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = gradients(model)
    model.eval()
    with torch.no_grad():
        logits = model(**eval_inputs(model, batch)).logits
        last = _last_logits(model, batch)
    return {"loss": loss.detach(), "grads": grads, "logits": logits, "last": last}


def _last_logits(model, batch: dict) -> torch.Tensor | None:
    """Eval logits with `logits_to_keep=1` at the rows whose last position is real (a model may slice its
    own positions by it: Gemma 4 before its KV-shared layers); None where the forward does not take it."""
    if is_seq2seq(model) or "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return None
    return _last_rows(model, batch)


def _last_rows(model, batch: dict) -> torch.Tensor:
    mask = batch.get("attention_mask")
    rows = slice(None) if mask is None else mask[:, -1].bool()
    return model(**eval_inputs(model, batch), logits_to_keep=1).logits[rows]


def padded_reference(model, batch: dict) -> tuple[dict, dict]:
    """The reference numbers and the batch they were computed on. A seq2seq model that does not build
    its decoder inputs from labels (FSMT) gets them in the batch."""
    try:
        return reference_run(model, batch), batch
    except Exception:
        if not is_seq2seq(model):
            raise
        batch = {**batch, "decoder_input_ids": decoder_inputs(model, batch["labels"])}
        return reference_run(model, batch), batch


def padded_patched(model, ref: dict, batch: dict, layout) -> dict:
    """Train (loss, every gradient) and eval (gathered logits at real tokens) errors of the patched model."""
    import seqpar_hf

    model.train()
    out = model(**batch)
    out.loss.backward()
    average_gradients(model, layout)
    errors = compare(model, out.loss, ref)
    model.eval()
    with torch.no_grad():
        out = model(**eval_inputs(model, batch))
    logits = full(seqpar_hf.gather_logits(model, full(out.logits)))
    errors["logits_err"] = relative_error(*_real_positions(model, batch, logits, ref["logits"]))
    if ref.get("last") is not None:  # the last position alone (logits_to_keep=1): the worse of the two
        with torch.no_grad():
            last = _last_rows(model, batch)  # the reference decided that the forward takes it
        errors["logits_err"] = max(errors["logits_err"], relative_error(full(last), ref["last"]))
    return errors


def _real_positions(model, batch: dict, *logits: torch.Tensor) -> tuple:
    """Logits at real tokens only: at a padded query whose keys are all masked (left padding, or right
    padding under a window) kernels legitimately disagree (SDPA: 0, eager: the mean of the values);
    no loss or generated token reads them."""
    mask = batch.get("attention_mask")
    if is_seq2seq(model) or mask is None or logits[0].shape[:2] != mask.shape:
        return logits
    keep = mask.bool()
    return tuple(t[keep] for t in logits)


# ---------------------------------------------------------------------------------------------
# packed


def packed_inputs(model, info: dict) -> dict:
    if is_seq2seq(model):
        return {"pairs": seq2seq_pairs(), "pad": pad_id(model), "start": None}
    batch = causal_packed_batch()
    if info.get("labels") == "codebooks":
        batch["labels"] = batch["labels"].unsqueeze(-1)
    return {**batch, "use_cache": False}  # transformers keeps documents apart only without a cache


def packed_reference(model, batch: dict) -> tuple[dict, dict]:
    if not is_seq2seq(model):
        return reference_run(model, batch), batch
    try:
        return _pairs_reference(model, batch["pairs"], None), batch
    except Exception:  # noqa: BLE001 - a model that does not build its decoder inputs from labels: the collator's
        start = _start_id(model)
        return _pairs_reference(model, batch["pairs"], start), {**batch, "start": start}


def _pair_inputs(model, source: list, target: list, start) -> dict:
    kw = {"input_ids": torch.tensor([source]), "labels": torch.tensor([target])}
    if start is not None:
        kw["decoder_input_ids"] = torch.tensor([[start] + target[:-1]])
    return kw


def _pairs_reference(model, pairs: list, start) -> dict:
    """Each pair alone: the loss as the packed batch's token mean (each pair's mean weighted by its
    tokens), its gradients, and each pair's eval logits (decoder inputs from its labels)."""
    model.train()
    model.zero_grad(set_to_none=True)
    tokens = sum(len(t) for _, t in pairs)
    loss = sum(model(**_pair_inputs(model, s, t, start)).loss * len(t) for s, t in pairs) / tokens
    loss.backward()
    grads = gradients(model)
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(**_pair_inputs(model, s, t, start)).logits[0] for s, t in pairs])
    return {"loss": loss.detach(), "grads": grads, "logits": logits}


def _start_id(model) -> int:
    config = model.config
    text = config.get_text_config(decoder=True)
    return next(
        (c.decoder_start_token_id for c in (config, text) if getattr(c, "decoder_start_token_id", None) is not None),
        pad_id(model),
    )


def packed_patched(model, ref: dict, batch: dict, layout) -> dict:
    if not is_seq2seq(model):
        return padded_patched(model, ref, batch, layout)
    import seqpar_hf
    from seqpar_hf.training.packing import Seq2SeqPackingCollator, pack_pairs

    pairs = batch["pairs"]
    packed = Seq2SeqPackingCollator(PAIR_ROW, pad_token_id=batch["pad"], decoder_start_token_id=batch["start"])(
        [{"input_ids": s, "labels": t} for s, t in pairs]
    )
    model.train()
    out = model(**packed)
    out.loss.backward()
    average_gradients(model, layout)
    errors = compare(model, out.loss, ref)
    model.eval()
    with torch.no_grad():  # labels in: the patched model builds each pair's decoder inputs from them
        logits = full(seqpar_hf.gather_logits(model, full(model(**packed).logits)))
    # [rows, T, vocab] -> each pair's target positions, in the order of `pairs`
    where = {}
    for r, row in enumerate(pack_pairs([(len(s), len(t)) for s, t in pairs], PAIR_ROW)):
        offset = 0
        for i in row:
            where[i] = (r, offset)
            offset += len(pairs[i][1])
    got = torch.cat([logits[where[i][0], where[i][1] : where[i][1] + len(t)] for i, (_, t) in enumerate(pairs)])
    errors["logits_err"] = relative_error(got, ref["logits"])
    return errors


# ---------------------------------------------------------------------------------------------
# generate


def generate_kwargs(model) -> dict:
    return {
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "num_beams": 1,
        "return_dict_in_generate": True,
        "output_scores": True,
        "pad_token_id": pad_id(model),
    }


def generate_reference(model, batch: dict) -> tuple[dict, dict]:
    model.eval()
    out = model.generate(**batch, **generate_kwargs(model))
    return {"tokens": out.sequences, "scores": out.scores}, batch


def generate_patched(model, ref: dict, batch: dict, layout) -> dict:
    """tokens_err: the fraction of new tokens that differ (0 or at least 1/24); scores_err: every step's."""
    model.eval()
    out = model.generate(**batch, **generate_kwargs(model))
    want = ref["tokens"]
    if out.sequences.shape != want.shape:
        return {"tokens_err": 1.0, "scores_err": float("inf")}
    new = slice(want.shape[1] - NEW_TOKENS, None)
    tokens_err = (out.sequences[:, new] != want[:, new]).double().mean().item()
    return {"tokens_err": tokens_err, "scores_err": finite_error(out.scores, ref["scores"])}


def _lively(model):
    """A tiny encoder-decoder at its init scale decodes the same tokens whatever the source: its matrices get
    seeded noise (the same on every rank) so that the tokens depend on the source and cross-attention shows."""
    if is_seq2seq(model):
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point() and p.dim() >= 2:
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * LIVELY)
    return model


def _generate_inputs(model, info: dict) -> dict:
    return generate_inputs(pad_id(model), is_seq2seq(model))


VARIANTS = {
    "padded": Variant("padded", padded_inputs, padded_reference, padded_patched, TRAIN_ERRORS),
    "packed": Variant("packed", packed_inputs, packed_reference, packed_patched, TRAIN_ERRORS),
    "generate": Variant("generate", _generate_inputs, generate_reference, generate_patched, GENERATE_ERRORS, _lively),
}
