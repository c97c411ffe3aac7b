"""Checks of the recipes' own flags, run right after parsing and before any process group or data work.

They read only the parsed arguments (and try the output folder), so every rank of a launch raises the
same error: "--<flag> <value>: <what is allowed>". The recipes turn it into argparse's error (exit code 2).
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def at_least(flag: str, value, minimum, meaning: str) -> None:
    """`value` >= `minimum` (a NaN is refused too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ValueError(f"--{flag} {value!r}: must be >= {minimum} ({meaning})")


def optional_positive(flag: str, value, meaning: str) -> None:
    """None (the flag left out) or a positive integer: the recipes would read 0 as 'no limit' and a negative
    as 'none at all'."""
    if value is not None:
        at_least(flag, value, 1, meaning)


def fraction(flag: str, value, meaning: str) -> None:
    """A probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"--{flag} {value!r}: must be in [0, 1) ({meaning})")


def folder(flag: str, path: str, writable: bool) -> None:
    """`path` is (or can be made) a folder, and with `writable` a file can be created in it: a failure here costs
    a second, not a finished run that cannot be saved."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        if writable:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
                pass
    except OSError as e:
        what = "a folder to write to" if writable else "a folder"
        raise ValueError(f"--{flag} {path!r}: must be {what} ({e.strerror or e})") from None


def parse_checked(groups: tuple, check, argv=None) -> tuple:
    """The argument groups parsed by transformers' HfArgumentParser, then `check(*groups)`: a ValueError
    becomes argparse's error (exit code 2) without its usage, which here runs to hundreds of lines."""
    from transformers import HfArgumentParser  # the checks above stay importable without transformers

    parser = HfArgumentParser(groups)
    parsed = parser.parse_args_into_dataclasses(args=argv)
    try:
        check(*parsed)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    return parsed
