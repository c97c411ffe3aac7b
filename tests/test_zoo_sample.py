"""Tier 2: a fixed sample of the conformance sweep (conformance/sample.py), one class per structural
kind, in one 2-process gloo group (a fresh one after a crash or hang): every row EXACT (loss, every
gradient and the eval logits within 1e-5 of the unpatched model) or REFUSED with a clear message.
Rows that fail today are xfail(strict=True) with their root cause, so a fix shows up as XPASS.
The whole zoo: `python -m conformance.zoo` (see conformance/results/zoo.md)."""

from __future__ import annotations

import pytest

from conformance.sample import KNOWN_FAILURES, UNCLEAR_REFUSALS, sample_tasks

TASKS = sample_tasks()


@pytest.fixture(scope="module")
def zoo_rows():
    from conformance.zoo import sweep
    return {(r["model_type"], r["layout"]): r for r in sweep(TASKS, log=lambda line: None)}


def _param(model_type, class_name, layout):
    reason = KNOWN_FAILURES.get((model_type, layout)) or UNCLEAR_REFUSALS.get((model_type, layout))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(model_type, layout, marks=marks, id=f"{class_name}-{layout}")


@pytest.mark.parametrize("model_type,layout", [_param(*t) for t in TASKS])
def test_zoo_row_exact_or_refused(zoo_rows, model_type, layout):
    row = zoo_rows[(model_type, layout)]
    assert row["status"] in ("EXACT", "REFUSED"), row
    if row["status"] == "REFUSED":  # a refusal names the structure and the fix
        assert row.get("refusal") == "clear", row
