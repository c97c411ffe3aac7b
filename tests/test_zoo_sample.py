"""Tier 2: a fixed sample of the conformance sweep (conformance/sample.py), one class per structural
kind and one row per fix, in one 2-process gloo group (a fresh one after a crash or hang): every row
EXACT (loss, every gradient and the eval logits within 1e-5 of the unpatched model; near misses
re-checked in float64) or REFUSED with the message the sample expects (the module, its class, why).
Rows that fail would be xfail(strict=True) with their root cause, so a fix shows up as XPASS.
The whole zoo: `python -m conformance.zoo` (about 3 minutes on 2 cores; conformance/results/zoo.md)."""

from __future__ import annotations

import pytest

from conformance.sample import EXPECT_REFUSED, KNOWN_FAILURES, UNCLEAR_REFUSALS, sample_tasks

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
    expected = EXPECT_REFUSED.get((model_type, layout))
    if expected is None:
        assert row["status"] == "EXACT", row
    else:  # a refusal names the structure and the fix
        assert row["status"] == "REFUSED" and row.get("refusal") == "clear" and expected in row["reason"], row
