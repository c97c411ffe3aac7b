"""A rank that raises ends the whole job, non-zero, in bounded time (never a hang)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_exception_on_one_rank_ends_both_processes_within_a_minute(tmp_path):
    stamp = tmp_path / "injected"
    env = {**os.environ, "FAULT_STAMP": str(stamp), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "tests" / "runs" / "fault_script.py"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    ended = time.time()
    assert proc.returncode != 0
    assert stamp.exists(), proc.stderr[-3000:]
    assert "injected failure" in proc.stderr
    assert ended - float(stamp.read_text()) < 60, "the job outlived the failure by more than a minute"
