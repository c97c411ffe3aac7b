"""Packed-row parity cases run inside spawned gloo processes (and at sp=1 in one process).

Decoder-only rows follow transformers' flattening convention; the reference is the unpatched model on
the same packed rows with `use_cache=False` (transformers only separates documents without a cache),
which equals each document run alone. Encoder-decoder rows follow seqpar_hf's convention
(`Seq2SeqPackingCollator`); the reference is each (source, target) pair run alone.
"""

from __future__ import annotations

import copy

import torch
from transformers import DataCollatorWithFlattening

import seqpar_hf
from seqpar_hf.training.packing import Seq2SeqPackingCollator

from ..helpers.models import SEQ2SEQ, VOCAB, build_model, relative_error
from .parity import grad_errors

DOC_LENGTHS = (5, 9, 3, 7, 1, 6)  # 31 tokens: documents cross shard boundaries and ring hops
PAIR_LENGTHS = ((4, 6), (7, 3), (2, 5), (6, 6), (1, 2), (5, 4))
# many short documents in long rows: attention takes the by-document path (kernels._by_document),
# every 10th one longer, so the documents fall into two length groups (up to 8 tokens and up to 16)
MANY_DOCS = tuple(13 + i % 4 if i % 10 == 9 else 3 + (7 * i) % 5 for i in range(40))  # 237 tokens
MANY_PAIRS = tuple((12, 10) if i % 10 == 9 else (2 + (3 * i) % 5, 2 + (7 * i) % 4) for i in range(30))


def _docs(seed: int, lengths=DOC_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def causal_packed_batch(seed: int, flash_kwargs: bool = True, rows: int = 1, lengths=DOC_LENGTHS) -> dict:
    """`rows` packed rows of the same documents (rows > 1: position_ids [rows, T], no flash kwargs)."""
    docs = _docs(seed, lengths)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
        [{"input_ids": d, "labels": d} for d in docs]
    )
    if rows > 1:
        rolled = [_docs(seed + r, DOC_LENGTHS[r:] + DOC_LENGTHS[:r]) for r in range(rows)]
        flat = [DataCollatorWithFlattening()([{"input_ids": d, "labels": d} for d in ds]) for ds in rolled]
        batch = {k: torch.cat([f[k] for f in flat]) for k in ("input_ids", "labels", "position_ids")}
    return batch


def seq2seq_pairs(seed: int, lengths=PAIR_LENGTHS) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(3, VOCAB, (a,), generator=g).tolist(), torch.randint(3, VOCAB, (b,), generator=g).tolist())
        for a, b in lengths
    ]


def seq2seq_packed_batch(seed: int, max_tokens: int = 12, lengths=PAIR_LENGTHS, start: int | None = 0) -> dict:
    return Seq2SeqPackingCollator(max_tokens, pad_token_id=0, decoder_start_token_id=start)(
        [{"input_ids": s, "labels": t} for s, t in seq2seq_pairs(seed, lengths)]
    )


def _model(case: dict):
    if case["family"] == "opt":  # its documents attend to each other (tests/test_probe.py)
        import warnings

        from conformance.tiny import build_tiny

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return build_tiny("opt", "OPTForCausalLM")[0]
    return build_model(case["family"], **case.get("model", {}))


def run_case(case: dict) -> dict:
    """`case`: name, family, sp, mode, ring_size, head_chunks, model, flash_kwargs, rows; `mask`: an
    attention_mask of ones (the positions are then only positions); `refused`: the forward must raise
    (returns the message)."""
    layout = seqpar_hf.ParallelLayout(
        sp_size=case["sp"],
        mode=case.get("mode", "ulysses"),
        ring_size=case.get("ring_size"),
        head_chunks=case.get("head_chunks", "auto"),
    )
    family = case["family"]
    model = _model(case)
    # training as the Trainer and TRL run it: transformers keeps packed documents apart only without a cache
    # (with it on, the patched model refuses packed rows: tests/test_probe.py)
    model.config.use_cache = False
    reference = copy.deepcopy(model)
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable()
        reference.gradient_checkpointing_enable()
    seqpar_hf.patch_model(model, layout, **case.get("patch", {}))
    many = case.get("many", False)
    if case.get("refused"):
        try:
            model(**causal_packed_batch(7, case.get("flash_kwargs", True)))
        except ValueError as exc:
            return {"name": case["name"], "error": str(exc)}
        return {"name": case["name"], "error": None}
    if family in SEQ2SEQ:
        lengths = MANY_PAIRS if many else PAIR_LENGTHS
        # start None: the collator leaves decoder inputs to the model, which builds each pair's (mBART: its last label)
        batch = seq2seq_packed_batch(
            7, 160 if many else 12, lengths, start=None if case.get("model_decoder_inputs") else 0
        )
        loss = model(**batch).loss
        pairs = seq2seq_pairs(7, lengths)
        tokens = sum(len(t) for _, t in pairs)
        ref_loss = (
            sum(reference(input_ids=torch.tensor([s]), labels=torch.tensor([t])).loss * len(t) for s, t in pairs)
            / tokens
        )
    else:
        batch = causal_packed_batch(
            7, case.get("flash_kwargs", True), case.get("rows", 1), MANY_DOCS if many else DOC_LENGTHS
        )
        if case.get("mask"):
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        loss = model(**batch).loss
        ref_loss = reference(**{k: v for k, v in batch.items()}, use_cache=False).loss
    loss.backward()
    ref_loss.backward()
    for p in model.parameters():  # what DDP does: average over the world (here one SP group)
        if p.grad is not None and layout.sp_group is not None:
            torch.distributed.all_reduce(p.grad, group=layout.sp_group)
            p.grad /= layout.sp_size
    grad_err, worst = grad_errors(model, reference)
    return {"name": case["name"], "loss_err": relative_error(loss, ref_loss), "grad_err": grad_err, "worst": worst}


def run_cases(cases: list[dict]) -> list[dict]:
    return [run_case(c) for c in cases]


# ---------------------------------------------------------------------------------------------
# the cases, per world size


def _cases(sp: int, modes) -> list[dict]:
    cases = []
    for mode, ring in modes:
        base = dict(sp=sp, mode=mode, ring_size=ring)
        tag = f"sp{sp}-{mode}"
        cases += [
            dict(base, name=f"{tag}-llama", family="llama"),
            dict(base, name=f"{tag}-llama-no-flash-kwargs", family="llama", flash_kwargs=False),
            dict(base, name=f"{tag}-llama-two-rows", family="llama", rows=2),
            dict(base, name=f"{tag}-mistral-window-3", family="mistral", model=dict(sliding_window=3)),
            dict(base, name=f"{tag}-marian", family="marian"),
            dict(base, name=f"{tag}-bart", family="bart"),
            dict(base, name=f"{tag}-m2m100", family="m2m100"),
            dict(base, name=f"{tag}-llama-many-documents", family="llama", many=True),
            dict(
                base,
                name=f"{tag}-mistral-window-3-many-documents",
                family="mistral",
                model=dict(sliding_window=3),
                many=True,
            ),
            dict(base, name=f"{tag}-marian-many-pairs", family="marian", many=True),
            # chunks of 4 counted from each document's start (position 0), cut by the documents
            dict(base, name=f"{tag}-llama4-chunks-many-documents", family="llama4", many=True),
            dict(base, name=f"{tag}-t5", family="t5"),  # relative position bias by distance within each pair
            dict(base, name=f"{tag}-mbart-decoder-inputs-from-labels", family="mbart", model_decoder_inputs=True),
            # OPT does not keep documents apart: with an attention_mask its rows run as it runs them
            # (restarting learned positions, sharded), without one they are refused
            dict(
                base,
                name=f"{tag}-opt-restarting-positions-with-attention-mask",
                family="opt",
                flash_kwargs=False,
                mask=True,
            ),
        ]
        if mode == "ulysses":  # refused before sharding, whatever the mode
            cases.append(dict(base, name=f"{tag}-opt-refused", family="opt", refused=True))
    return cases


def _cases_sp4() -> list[dict]:
    # four ranks share two cores here: the documents that cross the most boundaries, each mode
    keep = ("llama-many-documents", "marian")  # plain llama and m2m100: at sp=2
    return [
        c for c in _cases(4, [("ulysses", None), ("ring", None), ("hybrid", 2)]) if c["name"].split("-", 2)[2] in keep
    ]


CASES = {
    # one process: no shard boundary for many documents to cross (those cases run at sp=2 and 4)
    1: [c for c in _cases(1, [("ulysses", None)]) if not c.get("many")],
    2: _cases(2, [("ulysses", None), ("ring", None)])
    + [
        dict(sp=2, name="sp2-ulysses-head-chunks-2-llama-many-documents", family="llama", many=True, head_chunks=2),
        dict(sp=2, name="sp2-ulysses-head-chunks-2-marian", family="marian", head_chunks=2),
        # v's head width apart from q/k's (latent attention), attended document by document
        dict(sp=2, name="sp2-ulysses-deepseek_v3-many-documents", family="deepseek_v3", many=True),
        # layer inputs offloaded, the MLP over tiles of 2 tokens (seqpar_hf/memory/), under checkpointing
        dict(
            sp=2,
            mode="ring",
            name="sp2-ring-llama-many-documents-offload-tiled-mlp",
            family="llama",
            many=True,
            checkpointing=True,
            patch=dict(offload_activations=True, tiled_mlp=2),
        ),
    ],
    4: _cases_sp4(),
}
