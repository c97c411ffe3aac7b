"""Memory planner: per-rank memory of a training step for each layout, and the one to use.

    python -m seqpar_hf.plan --model llama-3-8b --seq-len 131072 --gpus 8 --gpu-memory 80
    python -m seqpar_hf.plan --model path/to/config.json --seq-len 32768 --gpus 4 --gpu-memory 24 --dtype bf16
    python -m seqpar_hf.plan --model llama-3-8b --seq-len 65536 --gpus 8 --gpu-memory 80 --all
    python -m seqpar_hf.plan --validate benchmarks/results/longest_sequence.json

In the order a plan is made: `configs.py` (the model's sizes: a known name or a config.json of a
Llama-like decoder), `memory.py` (the model of bytes: per-rank peak of one training step for one
layout), `search.py` (the layouts to count, the recommendation, the longest sequence that fits),
`cli.py` (the command line), `howto.py` (the table's legend; the flags, launch and
`patch_model` call of the recommended layout), `measured.py` (the planner against benchmarks/longest_sequence.py's
measured peaks); `checks.py` holds the checks of every input, shared by the library and the command
line (ValueError in the library; exit code 2 on the command line; the same words).
"""

from .checks import GIB
from .cli import main
from .configs import KNOWN, from_config, load_model
from .measured import OPTIONS, validate
from .memory import Breakdown, Layout, Model, plan
from .search import layouts, longest, recommend

__all__ = [
    "GIB",
    "KNOWN",
    "OPTIONS",
    "Breakdown",
    "Layout",
    "Model",
    "from_config",
    "layouts",
    "load_model",
    "longest",
    "main",
    "plan",
    "recommend",
    "validate",
]
