"""Tier 2: the fixed sample of the conformance sweep (conformance/sample.py: one class per distinct
structure x layout x variant, 115 rows: padded, packed and generate rows at sp=2 Ulysses / ring and tp=2 in
one 2-process gloo group, the sp=4 hybrid in one 4-process group; a fresh group after a crash or hang),
against the unpatched model. About 2 minutes on 2 busy cores. The whole sweep (every class of transformers'
causal-LM and seq2seq-LM auto mappings) is `python -m conformance.zoo` (conformance/results/zoo.md).

Every sampled row is EXACT (loss, every gradient and the eval logits within 1e-5 of the unpatched model;
generate: the same tokens, every step's scores within 1e-5; near misses re-checked in float64) or REFUSED
with the message the sample expects (naming the module and why). With the transformers version of
conformance/results/zoo.json, every row has the status and the tiny shape (windows, partial rotary,
KV-shared layers, head widths, position table) recorded there: a new transformers version that changes a
family, or its defaults' shapes, shows up as a changed row (regenerate the table with
`python -m conformance.zoo`). Rows that fail would be xfail(strict=True) with their root cause
(conformance/sample.py KNOWN_FAILURES), so a fix shows as XPASS."""

from __future__ import annotations

import json

import pytest
import transformers

from conformance.sample import KNOWN_FAILURES, UNCLEAR_REFUSALS, expected_refusal, sample_tasks
from conformance.zoo import RESULTS

TASKS = sample_tasks()
_TABLE = json.loads((RESULTS / "zoo.json").read_text())
RECORDED = (
    {(r["model_type"], r["class"], r["layout"], r.get("variant", "padded")): r for r in _TABLE["rows"]}
    if _TABLE["meta"]["transformers"] == transformers.__version__
    else {}
)


@pytest.fixture(scope="module")
def zoo_rows():
    from conformance.zoo import sweep

    return {(r["model_type"], r["class"], r["layout"], r["variant"]): r for r in sweep(TASKS, log=lambda line: None)}


def _param(model_type, class_name, layout, variant):
    reason = KNOWN_FAILURES.get((model_type, layout, variant)) or UNCLEAR_REFUSALS.get((model_type, layout, variant))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(
        model_type, class_name, layout, variant, marks=marks, id=f"{model_type}-{class_name}-{layout}-{variant}"
    )


@pytest.mark.parametrize("model_type,class_name,layout,variant", [_param(*t) for t in TASKS])
def test_zoo_row_exact_or_refused(zoo_rows, model_type, class_name, layout, variant):
    row = zoo_rows.get((model_type, class_name, layout, variant))
    assert row is not None, "no generate row: the padded row of the same class and layout is not EXACT"
    if row["status"] == "UNBUILDABLE" and "transformers has no attribute" in row.get("reason", ""):
        pytest.skip(f"{class_name} is not in transformers {transformers.__version__}")
    expected = expected_refusal(model_type, layout, variant)
    if expected is not None:  # a refusal the sample expects: it names the module and why
        assert row["status"] == "REFUSED" and row.get("refusal") == "clear" and expected in row["reason"], row
    else:
        assert row["status"] == "EXACT", row
    recorded = RECORDED.get((model_type, class_name, layout, variant))
    if recorded is not None and (model_type, layout, variant) not in KNOWN_FAILURES:  # a fix there: XPASS
        assert row["status"] == recorded["status"], (
            f"changed row: {recorded['status']} in conformance/results/zoo.json, {row['status']} now: "
            f"{row.get('reason')}"
        )
        assert row.get("shape") == recorded.get("shape"), (
            f"changed tiny shape: {recorded.get('shape')!r} in conformance/results/zoo.json, {row.get('shape')!r} now"
        )
