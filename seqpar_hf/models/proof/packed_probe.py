"""Packed rows decided by behaviour: does the unpatched model keep the documents of a packed row apart?

The patched model splits a decoder-only row into documents wherever its position_ids restart and no
attention_mask is given (transformers' convention, models/forward/inputs.py). Whether the unpatched model does
is up to its code: Llama hands the positions to its mask function, which then separates documents; OPT,
BioGPT and the BERT-family LM heads do not, so their documents attend to each other; under flash
attention transformers separates them from the positions or cu_seq_lens the call gets, in a one-row
batch only. So the dry run runs the backbone on packed batches of each kind twice, with softmax
attention in place of the token-local stand-in: under the mask each call is given (what the unpatched
model computes), and under the call's proven pattern within each document (what the patched model
computes). Where the two differ, that kind of packed batch is refused at the forward, on every rank
before sharding (models/forward/inputs.py), naming the module where documents meet. Never a third behaviour.
"""

from __future__ import annotations

import inspect

import torch

from ...attention.masks import MaskSpec, SeqMeta
from ...parallel.sharding import ShardPlan
from ..forward.inputs import WITH_CACHE, documents_from_positions, packed_kind
from ..forward.sites import original_function
from . import dryrun, probe
from .attention_calls import call_pattern
from .probe_checks import culprits, tolerance

# kind of packed batch -> (rows, with flash-attention kwargs, use_cache): what DataCollatorWithFlattening gives
# (one row, with or without cu_seq_lens / max_length), several packed rows, and one row with the model's cache
# on (transformers' mask functions look for packed rows only without a cache: a plain loop on a model whose
# config.use_cache is True; the Trainer and TRL turn it off)
CASES = {packed_kind(rows, flash): (rows, flash, False) for rows, flash in ((1, False), (1, True), (2, False))}
CASES[WITH_CACHE] = (1, False, True)
FLASH_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _lengths(length: int, row: int) -> list[int]:
    """Three documents of a row of `length` tokens, in another order on each row."""
    third = length // 3
    docs = [third, third + 1, length - 2 * third - 1]
    return docs[row % 3 :] + docs[: row % 3]


def _batch(pretrained, length: int, rows: int, flash: bool, device) -> dict:
    ids = probe.token_ids(pretrained, pretrained.config, length, 2, rows)
    docs = [_lengths(length, r) for r in range(rows)]
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])  # [rows, length]
    batch: dict[str, torch.Tensor | int] = {"input_ids": ids.to(device), "position_ids": positions.to(device)}
    if flash:  # one row: cumulative lengths [documents + 1] int32, as DataCollatorWithFlattening gives them
        cu = torch.tensor([0] + docs[0], dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(docs[0]), max_length_k=max(docs[0]))
    return batch


def _mask(doc, pattern, s: int, device):
    """[b or 1, 1, s, s] bool (None: every pair) of `pattern` (causal, window) within documents `doc`."""
    meta = SeqMeta(ShardPlan.build(s, 1, 0), None, doc)
    index = torch.arange(s, device=device)
    batch = 1 if doc is None else doc.shape[0]
    return MaskSpec.of(meta, meta, pattern[0], pattern[1], batch, device).block_mask(index, index)


def _flash_documents(kwargs: dict, rows: int) -> torch.Tensor | None:
    """[1, s] documents transformers' flash attention separates (modeling_flash_attention_utils
    `_flash_attention_forward`): from all four varlen kwargs, else from packed position_ids in a
    one-row batch (a new document where the positions fall back to their smallest value)."""
    if all(kwargs.get(k) is not None for k in FLASH_VARLEN):
        cu = kwargs["cu_seq_lens_q"].long()
        starts = torch.zeros(1, int(cu[-1]), dtype=torch.long, device=cu.device)
        starts[0, cu[1:-1]] = 1
        return starts.cumsum(-1)
    pos = kwargs.get("position_ids")
    if pos is None or rows != 1 or pos.shape[-1] == 1:
        return None
    pos = pos.reshape(1, -1)
    return (pos == pos.min()).long().cumsum(-1) - 1


def _unpatched(original: str | None, rows: int):
    """The mask each attention call computes with in the unpatched model."""

    def make(call, query, key):
        if "flash" in (original or ""):
            return _mask(
                _flash_documents(call["kwargs"], rows), call_pattern(call, original, {}), key.shape[2], key.device
            )
        if isinstance(call["mask"], torch.Tensor) and call["mask"].dim() == 4:
            return call["mask"]  # made by the model's mask function (or the model itself)
        return _mask(None, call_pattern(call, original, {}), key.shape[2], key.device)  # the kernel's own rule

    return make


def _patched(records: dict, doc: torch.Tensor):
    """The mask each attention call computes with in the patched model: its pattern, within documents."""

    def make(call, query, key):
        return _mask(doc, records[call["module"]][2], key.shape[2], key.device)

    return make


def _forward(backbone, kw: dict, names: dict, length: int, original, make, record: bool, rows: int):
    """The backbone's output (or, `record`: its per-module records) under softmax attention with `make`'s
    masks; an exception is returned, not raised."""
    if record:
        recorder, _, _, err = probe.run_forward(
            backbone,
            lambda: backbone(**kw),
            {length: "decoder"},
            names,
            original_function(original),
            True,
            False,
            log_ops=False,
            rows=rows,
            real=make,
        )
        return recorder.calls if err is None else err[0]
    backbone.eval()
    run = dryrun.Run(names, {length: "decoder"}, original_function(original), True, make)
    try:
        with dryrun.running(run), dryrun.Determinism():
            return backbone(**kw)[0]  # [rows, length, hidden]
    except Exception as exc:  # noqa: BLE001 - the unpatched model fails on such rows: refused, saying so
        return exc


def check(pretrained, observed, records: dict, original: str | None) -> dict[str, str]:
    """{kind of packed batch: why it is refused} for the kinds the unpatched model does not keep apart."""
    backbone, prefix = observed.backbone, observed.backbone_name
    names = {m: n for n, m in pretrained.named_modules(remove_duplicate=False)}
    params = inspect.signature(backbone.forward).parameters
    takes = lambda key: key in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    length = observed.sizes.causal
    device = next((p.device for p in backbone.parameters() if p.device.type != "meta"), torch.device("cpu"))
    tol = tolerance(next((p.dtype for p in backbone.parameters() if p.is_floating_point()), torch.float32))
    refused, patched = {}, {}
    for case, (rows, flash, cache) in CASES.items():
        if cache and "use_cache" not in params:
            continue  # no cache to turn on
        kw = {k: v for k, v in _batch(pretrained, length, rows, flash, device).items() if takes(k)}
        if "use_cache" in params:
            kw["use_cache"] = cache  # the patched model keeps documents apart either way
        doc = documents_from_positions(kw["position_ids"], always=True)
        assert doc is not None  # always=True
        makes = (_unpatched(original, rows), _patched(records, doc))
        unpatched = _forward(backbone, kw, names, length, original, makes[0], False, rows)
        if rows not in patched:  # the patched model ignores flash-attention kwargs: one run per row count
            patched[rows] = _forward(backbone, kw, names, length, original, makes[1], False, rows)
        outs = (unpatched, patched[rows])
        failed = next((o for o in outs if isinstance(o, Exception)), None)
        if failed is not None:
            refused[case] = (
                f"{type(pretrained).__name__} fails on {case} at patch time "
                f"({type(failed).__name__}: {str(failed).splitlines()[0][:160] if str(failed) else ''})"
            )
            continue
        if (outs[0] - outs[1]).abs().max() <= tol * outs[0].abs().max():
            continue
        # name where the documents meet: the innermost module whose inputs agree and outputs do not
        runs = [_forward(backbone, kw, names, length, original, make, True, rows) for make in makes]
        every = torch.arange(length)
        found = (
            culprits(runs[0], runs[1], {"decoder": (every, every)}, tol)
            if all(isinstance(r, dict) for r in runs)
            else []
        )
        where = f"{prefix}.{found[0][0]}".strip(".") if found else prefix
        module = pretrained.get_submodule(where) if where else pretrained
        refused[case] = (
            f"{type(pretrained).__name__} lets {where or 'its forward'} ({type(module).__name__}) "
            f"attend across the documents of {case} (seen at patch time)"
        )
    return refused
