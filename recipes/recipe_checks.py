"""Checks of the recipes' own flags, run right after parsing and before any process group or data work.

They read only the parsed arguments (and try the output folder), so every rank of a launch raises the
same error: "--<flag> <value>: <what is allowed>". The recipes turn it into argparse's error (exit code 2).
The parser itself (`parse_checked`) lists the flags by section in --help: sequence parallelism first.
"""

from __future__ import annotations

import dataclasses
import tempfile
import typing
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


def checkpointing_field() -> str:
    """The training arguments' name for activation checkpointing: `activation_checkpointing` from transformers
    5.2x on (where `gradient_checkpointing` is a deprecated alias that warns when set), else the old one."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def parse_checked(groups: tuple, check, argv=None) -> tuple:
    """The argument groups parsed by transformers' HfArgumentParser, then `check(*groups)`: a ValueError
    becomes argparse's error (exit code 2) without its usage, which here runs to hundreds of lines."""
    parser = grouped_parser(groups)
    parsed = parser.parse_args_into_dataclasses(args=argv)
    try:
        check(*parsed)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    return parsed


def grouped_parser(groups: tuple):
    """transformers' HfArgumentParser over the recipe's dataclasses, its --help in the order a reader needs:
    the sequence-parallel flags (what seqpar_hf adds to the training arguments), the recipe's own, then the
    long list of the training arguments (transformers' or TRL's). Parsing is HfArgumentParser's: each
    dataclass takes its fields by name, whichever section lists them."""
    from transformers import HfArgumentParser  # the checks above stay importable without transformers

    class GroupedParser(HfArgumentParser):
        def __init__(self):
            # the sections below, in --help's order (argparse lists groups as created); a usage of one line,
            # not argparse's list of every flag (~150 lines, also printed before each parsing error)
            super().__init__([], usage="%(prog)s [-h] [--flag value ...] (every flag below, by section)")
            self.dataclass_types = list(groups)
            for view in _sections(groups):
                self._add_dataclass_arguments(view)  # a dataclass with `_argument_group_name`: one titled group

    return GroupedParser()


def _sections(groups: tuple) -> list:
    """One dataclass per --help section, each holding its fields (with their types resolved)."""
    sp, recipe, training = [], [], []
    training_title = "training arguments"
    for cls in groups:
        hints = typing.get_type_hints(cls)
        fields = [
            (
                f.name,
                hints[f.name],
                dataclasses.field(default=f.default, default_factory=f.default_factory, metadata=f.metadata),
            )
            for f in dataclasses.fields(cls)
            if f.init
        ]
        added = _seqpar_fields(cls)
        if not added:  # the recipe's own dataclass
            name = cls.__name__.removesuffix("Arguments").lower()
            recipe.append((f"{name} (this recipe)" if name not in ("", "recipe") else "this recipe", fields))
            continue
        sp += [f for f in fields if f[0] in added]
        training += [f for f in fields if f[0] not in added]
        base = next(
            c for c in cls.__mro__ if dataclasses.is_dataclass(c) and not _ours(c) and c.__module__ != cls.__module__
        )
        training_title = (
            f"training arguments ({base.__module__.split('.')[0]} {base.__name__}, with this recipe's defaults)"
        )
    sections = [("sequence parallelism (seqpar_hf)", sp), *recipe, (training_title, training)]
    views = []
    for title, fields in sections:
        if fields:
            view = dataclasses.make_dataclass("Section", fields, kw_only=True)
            view._argument_group_name = title
            views.append(view)
    return views


def _ours(cls) -> bool:
    return cls.__module__.split(".")[0] == "seqpar_hf"


def _seqpar_fields(cls) -> set:
    """The fields seqpar_hf's classes add to a training-arguments class (not those it only re-defaults)."""

    def declared(classes):
        return {name for c in classes if dataclasses.is_dataclass(c) for name in c.__dict__.get("__annotations__", {})}

    mro = cls.__mro__
    return declared(c for c in mro if _ours(c)) - declared(c for c in mro if not _ours(c))
