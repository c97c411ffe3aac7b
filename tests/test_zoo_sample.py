"""Tier 2: the whole conformance sweep (conformance/zoo.py: every class of transformers' causal-LM and
seq2seq-LM auto mappings, tiny, x ulysses / ring / tp2) plus the sample's variant rows
(conformance/sample.py), in one 2-process gloo group (a fresh one after a crash or hang), against the
unpatched model. About 3 minutes on 2 cores.

Every row is EXACT (loss, every gradient and the eval logits within 1e-5 of the unpatched model; near
misses re-checked in float64), REFUSED with a message that says why (the sample's rows: the message it
expects, naming the module), or a class that is not a text LM here (NOT-A-TEXT-LM / UNBUILDABLE, with the
reason); never WRONG, CRASHED or HUNG. With the transformers version of conformance/results/zoo.json,
every row has the status recorded there: a new transformers version that changes a family shows up as
a changed row (regenerate the table with `python -m conformance.zoo`). Rows that fail would be
xfail(strict=True) with their root cause (conformance/sample.py KNOWN_FAILURES), so a fix shows as XPASS."""

from __future__ import annotations

import json

import pytest
import transformers

from conformance.sample import EXPECT_REFUSED, KNOWN_FAILURES, SAMPLE, UNCLEAR_REFUSALS, sample_tasks
from conformance.zoo import RESULTS, zoo_tasks

_SWEEP = zoo_tasks()
TASKS = _SWEEP + [t for t in sample_tasks() if t not in set(_SWEEP)]  # + the variants only the sample has
_SAMPLED = {(mt, cls, layout) for mt, cls, layouts in SAMPLE for layout in layouts}
_TABLE = json.loads((RESULTS / "zoo.json").read_text())
RECORDED = {(r["model_type"], r["class"], r["layout"]): r["status"] for r in _TABLE["rows"]} \
    if _TABLE["meta"]["transformers"] == transformers.__version__ else {}


@pytest.fixture(scope="module")
def zoo_rows():
    from conformance.zoo import sweep
    return {(r["model_type"], r["class"], r["layout"]): r for r in sweep(TASKS, log=lambda line: None)}


def _param(model_type, class_name, layout):
    reason = KNOWN_FAILURES.get((model_type, layout)) or UNCLEAR_REFUSALS.get((model_type, layout))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(model_type, class_name, layout, marks=marks, id=f"{model_type}-{class_name}-{layout}")


@pytest.mark.parametrize("model_type,class_name,layout", [_param(*t) for t in TASKS])
def test_zoo_row_exact_or_refused(zoo_rows, model_type, class_name, layout):
    row = zoo_rows[(model_type, class_name, layout)]
    if row["status"] == "UNBUILDABLE" and "transformers has no attribute" in row.get("reason", ""):
        pytest.skip(f"{class_name} is not in transformers {transformers.__version__}")
    sampled = (model_type, class_name, layout) in _SAMPLED
    expected = EXPECT_REFUSED.get((model_type, layout)) if sampled else None
    if expected is not None:  # a refusal the sample expects: it names the module and why
        assert row["status"] == "REFUSED" and row.get("refusal") == "clear" and expected in row["reason"], row
    elif sampled:
        assert row["status"] == "EXACT", row
    else:
        assert row["status"] in ("EXACT", "REFUSED", "NOT-A-TEXT-LM", "UNBUILDABLE"), row
        assert row["status"] != "REFUSED" or row.get("refusal") == "clear", row
    recorded = RECORDED.get((model_type, class_name, layout))
    assert recorded is None or row["status"] == recorded, \
        f"changed row: {recorded} in conformance/results/zoo.json, {row['status']} now: {row.get('reason', '')}"
