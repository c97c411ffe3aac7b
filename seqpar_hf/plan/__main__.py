"""`python -m seqpar_hf.plan`: exit code 0 with a recommendation, 1 when nothing fits, 2 for bad arguments."""

from .cli import main

raise SystemExit(0 if main() is not None else 1)
