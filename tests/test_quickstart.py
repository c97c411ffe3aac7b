"""The README's quickstart: its first Python block is examples/quickstart.py verbatim (tier 1), and that
file runs as its own CPU launch line says, on 2 gloo processes (the `recipe_run` fixture starts them, which
marks the run's tests `multiprocess`: conftest.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"


def _cpu_launch_line() -> str:
    """The docstring's 2-process launch line, without its comment."""
    lines = [line.split("#")[0].strip() for line in QUICKSTART.read_text().splitlines()]
    return next(line for line in lines if line.startswith("torchrun") and "--nproc_per_node 2" in line)


def test_readme_quickstart_is_the_example_file():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "the README has no ```python block"
    assert blocks[0] == QUICKSTART.read_text(), (
        "the README's first ```python block must be examples/quickstart.py verbatim: copy the file into it"
    )


def test_readme_gives_the_launch_line_within_its_first_120_lines():
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:120])
    assert f"{_cpu_launch_line()}   #" in head


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """The launch line as written (`torchrun` is `python -m torch.distributed.run`), from a scratch folder so
    that the run's output_dir lands there."""
    argv = shlex.split(_cpu_launch_line())
    assert argv[0] == "torchrun" and argv[-1] == "examples/quickstart.py", argv
    cmd = [sys.executable, "-m", "torch.distributed.run", *argv[1:-1], str(ROOT / argv[-1])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # 2 processes share the cores
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path_factory.mktemp("quickstart")
    )
    return proc


def test_quickstart_trains_on_two_cpu_processes(recipe_run):
    log = recipe_run.stdout + recipe_run.stderr
    assert recipe_run.returncode == 0, log[-4000:]
    losses = [float(x) for x in re.findall(r"\{'loss': '([0-9.]+)'", log)]
    assert len(losses) == 4, log[-3000:]  # max_steps 8, logging_steps 2, logged once (rank 0)
    # from about ln(128) = 4.85 (uniform over the vocabulary) down: the sequences count up, so it learns
    assert losses[0] < 5.0 and losses[-1] < losses[0] - 0.5, losses
    assert "'train_runtime'" in log
