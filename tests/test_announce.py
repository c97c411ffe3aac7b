"""What a run says when SP is on (seqpar_hf/parallel/announce.py), and the warnings it no longer prints.

Tier 1: a layout built in a one-process gloo group warns nothing (torch's DeviceMesh deprecation of slicing a
flattened dim); the Trainer runs show the lines on the main process only. Tier 2 (the `misc` group, 2 ranks):
patch_model logs the layout once on rank 0 (with the reason when mode="auto" chose it), the first forward
its lengths once, later forwards nothing, rank 1 nothing."""

from __future__ import annotations

import logging
import warnings

import torch.distributed as dist

import seqpar_hf
from seqpar_hf.parallel import announce


def test_building_a_layout_warns_nothing(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            layout = seqpar_hf.ParallelLayout(sp_size=1)
        assert [str(w.message) for w in seen] == []
        assert layout.sp_ranks == (0,) and layout.submesh("dp_sp").mesh.tolist() == [0]
    finally:
        dist.destroy_process_group()


def _bare_logger(monkeypatch):
    """The "seqpar_hf" logger as in a script that configured no logging (pytest's handlers, which it adds to
    the root logger when the test starts, set aside)."""
    logger = logging.getLogger("seqpar_hf")
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    return logger


def test_trainer_runs_show_the_lines_on_the_main_process(monkeypatch):
    bare_logger = _bare_logger(monkeypatch)
    announce.show_in_runs(main_process=True)
    announce.show_in_runs(main_process=True)  # a second trainer adds no second handler
    assert bare_logger.level == logging.INFO and len(bare_logger.handlers) == 1


def test_other_processes_and_a_level_set_by_the_application_are_kept(monkeypatch):
    bare_logger = _bare_logger(monkeypatch)
    announce.show_in_runs(main_process=False)
    assert bare_logger.level == logging.WARNING
    bare_logger.setLevel(logging.ERROR)  # the application's choice stands
    announce.show_in_runs(main_process=True)
    assert bare_logger.level == logging.ERROR


def test_patch_and_first_forward_are_logged_once_on_rank_0(spawned):
    rank0, rank1 = (r["announce"] for r in spawned("misc", 2))
    assert rank0["after_patch"] == [
        "LlamaForCausalLM is sequence-parallel: sp=2 (ulysses 2 x ring 1), tp=1, dp=1, over 2 ranks; mode ulysses"
    ]
    assert rank0["after_forwards"][1:] == [
        "first forward: decoder 11 tokens padded to 12, 6 per rank (sp=2; logged once, later batches differ)"
    ]
    [auto] = rank0["auto"]
    assert auto.startswith(
        "LlamaForCausalLM is sequence-parallel: sp=2 (ulysses 2 x ring 1), tp=1, dp=1, over 2 "
        "ranks; mode ulysses, chosen by mode='auto' (sp=2, "
    ), auto
    assert rank1 == {"after_patch": [], "after_forwards": [], "auto": []}
