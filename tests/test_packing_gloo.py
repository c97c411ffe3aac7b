"""Packed rows (several documents per row, no attention across them) under every SP mode: loss and
every gradient equal the unpatched model on the same packed rows (decoder-only) or each pair run alone
(encoder-decoder); bad packed input fails with an error naming the row. fp32. In-rank bodies and
cases: tests/runs/packing.py (sp=1 runs in this process)."""

from __future__ import annotations

import pytest
import torch

import seqpar_hf
from seqpar_hf.training.packing import Seq2SeqPackingCollator, pack_pairs

from .helpers.models import build_model
from .runs.packing import CASES, causal_packed_batch, run_cases

TOL = 1e-5  # fp32, relative (loss and every parameter gradient)


def _by_name(per_rank) -> dict:
    out = {}
    for rank_results in per_rank:
        for r in rank_results:
            out.setdefault(r["name"], []).append(r)
    return out


@pytest.fixture(scope="module")
def results(spawned):
    cache = {}

    def get(size):
        if size not in cache:
            cache[size] = _by_name(spawned("packing", size))
        return cache[size]

    return get


@pytest.fixture(scope="module")
def one_process():
    return _by_name([run_cases(CASES[1])])


@pytest.mark.parametrize(
    "size,name",
    [pytest.param(w, c["name"], id=c["name"]) for w in CASES if w > 1 for c in CASES[w] if not c.get("refused")],
)
def test_packed_rows_are_exact(results, size, name):
    for r in results(size)[name]:
        assert r["loss_err"] < TOL and r["grad_err"] < TOL, r


@pytest.mark.parametrize("name", [c["name"] for c in CASES[1] if not c.get("refused")])
def test_packed_rows_are_exact_at_sp1(one_process, name):
    for r in one_process[name]:
        assert r["loss_err"] < TOL and r["grad_err"] < TOL, r


REFUSED = (
    "OPTForCausalLM lets model.decoder.layers.0.self_attn (OPTAttention) attend across the documents of one "
    "packed row with flash-attention kwargs (seen at patch time); here row 0 starts a new document at token 5"
)


@pytest.mark.parametrize("size", [1, 2])
def test_packed_rows_the_model_does_not_keep_apart_are_refused_on_every_rank(results, one_process, size):
    """OPT's unpatched forward lets documents attend to each other (its mask function gets no positions):
    the same error on every rank, before sharding, naming the module and the way out."""
    (name,) = [c["name"] for c in CASES[size] if c.get("refused")]
    errors = [r["error"] for r in (one_process if size == 1 else results(size))[name]]
    assert len(set(errors)) == 1 and errors[0] is not None and errors[0].startswith(f"seqpar_hf: {REFUSED}"), errors
    assert "attention_mask=torch.ones_like(input_ids)" in errors[0]


@pytest.mark.parametrize("causal,window,d_v", [(True, None, 16), (False, None, 16), (True, 4, 16), (False, 4, 8)])
def test_by_document_attention_in_length_groups_equals_the_row_long_mask(monkeypatch, causal, window, d_v):
    """Documents of 2-70 tokens (5 length groups) and trailing padding: the grouped by-document path
    gives the dense mask's outputs and gradients (fp64); v of its own head width too (latent attention)."""
    from seqpar_hf.attention import kernels
    from seqpar_hf.attention.masks import MaskSpec, SeqMeta
    from seqpar_hf.attention.pattern import Pattern
    from seqpar_hf.parallel.sharding import ShardPlan

    lens = [3, 17, 5, 40, 9, 2, 70, 12, 6, 33]
    s = sum(lens) + 5
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[:, -5:] = False
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)] + [torch.full((5,), -1)])[None].repeat(2, 1)
    meta = SeqMeta(ShardPlan.build(s, 1, 0), valid, doc)
    spec = MaskSpec(meta, meta, causal, window)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, s, width, dtype=torch.float64, requires_grad=True) for width in (16, 16, d_v))
    results = []
    for ratio in (0, 1e9):  # always by document / never
        monkeypatch.setattr(kernels, "DOCUMENT_WORK_RATIO", ratio)
        pattern = Pattern(spec)
        out = kernels.attention(q, k, v, pattern, 0.25, 0.0, None)
        results.append([out, *torch.autograd.grad((out * out.detach().cos()).sum(), (q, k, v))])
        groups = [len(pattern.documents[0])] if pattern.documents else []
        assert groups == ([5] if ratio == 0 else [])
    for got, want in zip(*results):
        assert (got - want).abs().max() < 1e-12


# ---- bad packed input: a clear error naming the row (tier 1, no process group) -----------------------


def _patched(family):
    return seqpar_hf.patch_model(build_model(family), seqpar_hf.ParallelLayout(sp_size=1))


def test_positions_that_do_not_restart_at_zero():
    batch = causal_packed_batch(1, flash_kwargs=False, rows=2)
    batch["position_ids"][1, 9:14] += 2  # row 1: a document starting at position 2
    with pytest.raises(ValueError, match="packed row 1: a document starts at token 9 with position_ids 2"):
        _patched("llama")(**batch)


def test_cu_seq_lens_that_disagree_with_the_positions():
    batch = causal_packed_batch(1)
    batch["cu_seq_lens_q"] = torch.tensor([0, 4, 14, 17, 18, 24, 31], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q and position_ids describe different documents in packed row 0"):
        _patched("llama")(**batch)


def test_seq2seq_rows_with_unpaired_documents():
    batch = Seq2SeqPackingCollator(12, 0, 0)(
        [{"input_ids": [5, 6, 7], "labels": [8, 9]}, {"input_ids": [5, 6], "labels": [7, 8, 9]}]
    )
    batch["decoder_position_ids"][0] = torch.arange(5)  # row 0's targets now read as one document
    with pytest.raises(ValueError, match="packed row 0: 2 source documents but 1 target documents"):
        _patched("marian")(**batch)


def test_seq2seq_collator_leaves_decoder_inputs_to_the_model():
    features = [{"input_ids": [5, 6, 7], "labels": [8, 9]}, {"input_ids": [5, 6], "labels": [7, 8, 9]}]
    assert "decoder_input_ids" not in Seq2SeqPackingCollator(12, 0, None)(features)
    assert Seq2SeqPackingCollator(12, 0, 2)(features)["decoder_input_ids"].tolist() == [[2, 8, 2, 7, 8]]


def test_a_pair_longer_than_the_row():
    assert pack_pairs([(3, 4), (5, 2), (2, 2)], 8) == [[1], [0, 2]]  # 2 rows of 5 + 2 and 5 + 6 tokens
    with pytest.raises(ValueError, match="pair 1 has 9 source and 2 target tokens, longer than a packed row of 8"):
        pack_pairs([(3, 4), (9, 2)], 8)


def test_cu_seq_lens_that_the_positions_do_not_say():
    """Flash attention separates by cu_seq_lens, SDPA / eager by restarting positions without a mask:
    cu_seq_lens alone (or with an attention_mask) would mean different things to them."""
    batch = causal_packed_batch(1)
    cu = batch["cu_seq_lens_q"]
    with pytest.raises(
        ValueError,
        match=r"cu_seq_lens_q describes 6 documents in packed row 0, but comes with "
        r"position_ids that do not restart \(or none\)",
    ):
        _patched("llama")(input_ids=batch["input_ids"], labels=batch["labels"], cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match=r"6 documents in packed row 0, but comes with an attention_mask"):
        _patched("llama")(**batch, attention_mask=torch.ones_like(batch["input_ids"]))


def test_four_dimensional_masks_point_to_packing():
    batch = causal_packed_batch(1, flash_kwargs=False)
    batch["attention_mask"] = torch.ones(1, 1, 31, 31, dtype=torch.bool)
    with pytest.raises(ValueError, match="2D padding masks.*restarting position_ids"):
        _patched("llama")(**batch)


def test_seq2seq_collator_takes_the_decoder_inputs_a_pair_gives():
    """A pair's own decoder inputs (a document's later sentence starts at its marker, not behind a start token)."""
    features = [{"input_ids": [5, 6], "labels": [8, 9], "decoder_input_ids": [7, 8]}, {"input_ids": [5], "labels": [4]}]
    assert Seq2SeqPackingCollator(12, 0, 2)(features)["decoder_input_ids"].tolist() == [[7, 8, 2]]
    with pytest.raises(ValueError, match="pair 0 has 1 decoder_input_ids for 2 labels; give one per label"):
        Seq2SeqPackingCollator(12, 0, 2)([{"input_ids": [5], "labels": [8, 9], "decoder_input_ids": [7]}])
    with pytest.raises(ValueError, match="some pairs give decoder_input_ids and others none, with no decoder_start"):
        Seq2SeqPackingCollator(12, 0, None)(features)
