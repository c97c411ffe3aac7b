"""In-rank body of tests/test_announce.py: what a patched model logs (seqpar_hf/parallel/announce.py), per
rank: the layout line at patch_model (with the reason when mode="auto" chose it), the first forward's
lengths once however many forwards follow."""

from __future__ import annotations

import logging

import torch

import seqpar_hf

from ..helpers.models import build_model, make_batch


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        if record.name == "seqpar_hf":  # the lines of announce.py, not those of seqpar_hf's other modules
            self.lines.append(record.getMessage())


def all_checks() -> dict:
    logger, handler = logging.getLogger("seqpar_hf"), _Collect()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = seqpar_hf.patch_model(build_model("llama"), seqpar_hf.ParallelLayout(sp_size=2))
        after_patch = list(handler.lines)
        with torch.no_grad():
            for length in (11, 7):  # the second forward (another length) logs nothing
                model(**make_batch("llama", seed=0, length=length))
        after_forwards = list(handler.lines)
        seqpar_hf.patch_model(build_model("llama"), seqpar_hf.ParallelLayout(sp_size=2, mode="auto"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {"after_patch": after_patch, "after_forwards": after_forwards, "auto": handler.lines[len(after_forwards) :]}
