"""Run ONE tier-2 case alone, in seconds, with the suite's own assertions:

    python -m tests.one ulysses-marian-padded-odd       # a case of tests/runs/parity.py, packing.py or tp.py
    python -m tests.one ulysses-marian-padded-odd -x -s # pytest options after the name
    python -m tests.one --list                           # every case, with its group and world size

The case's world size is the one it is listed under. This runs pytest on that case's test only, with
SEQPAR_CASES=<name>: tests/worlds.py then starts one process group that runs that case and none of the
group's other cases or bodies. By hand: `SEQPAR_CASES=<name> python -m pytest tests/test_parity_gloo.py -k <name>`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# group module in tests/runs -> the test that asserts one of its cases, at world size w
TESTS = {
    "parity": {"*": "tests/test_parity_gloo.py::test_parity[w{world}-{name}]"},
    "packing": {
        1: "tests/test_packing_gloo.py::test_packed_rows_are_exact_at_sp1[{name}]",
        "*": "tests/test_packing_gloo.py::test_packed_rows_are_exact[{name}]",
    },
    "tp": {"*": "tests/test_tp_gloo.py::test_tensor_parallel_parity[{name}]"},
}


def cases() -> list[tuple[str, str, int, str]]:
    """(name, group, world size, pytest node id) of every case that has a test of its own."""
    from .runs import packing, parity, tp

    out = []
    for group, module in (("parity", parity), ("packing", packing), ("tp", tp)):
        for world, listed in module.CASES.items():
            node = TESTS[group].get(world, TESTS[group]["*"])
            out += [
                (c["name"], group, world, node.format(world=world, name=c["name"]))
                for c in listed
                if not c.get("refused")
            ]  # refused cases are asserted by their group's refusal tests
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.one", description=__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?", help="the case's name (--list shows them)")
    parser.add_argument("--list", action="store_true", help="list every case and exit")
    args, pytest_args = parser.parse_known_args(argv)
    known = cases()
    if args.list or not args.name:
        print("\n".join(f"{group:8s} {world} ranks  {name}" for name, group, world, _ in known))
        return 0
    nodes = [node for name, _, _, node in known if name == args.name]
    if not nodes:
        parser.error(f"no case named {args.name!r}; `python -m tests.one --list` lists them")
    return subprocess.call(
        [sys.executable, "-m", "pytest", "-q", *nodes, *pytest_args], env={**os.environ, "SEQPAR_CASES": args.name}
    )


if __name__ == "__main__":
    raise SystemExit(main())
