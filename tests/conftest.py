"""Markers, offline settings, and the `world` fixture: one process group per concern and world size,
spawned once per session (which bodies share a group: tests/worlds.py)."""

import os

# Nothing may come from a hub at test time; models are built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


import pytest

# Tier 2 (`multiprocess`): tests that start processes, through the `spawned` fixture (gloo groups) or
# themselves (torchrun, accelerate launch, one-process references). Tier 1 is the rest:
# `python -m pytest -m "not multiprocess"` (no process group, about 2-3 CPU-minutes).
SPAWNING_FIXTURES = ("spawned", "recipe_run", "reference", "plain_evals", "zoo_rows")
SPAWNING_TESTS = ("test_exception_on_one_rank_ends_both_processes_within_a_minute", "test_recipe_end_to_end")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if set(getattr(item, "fixturenames", ())) & set(SPAWNING_FIXTURES) or item.originalname in SPAWNING_TESTS:
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture(scope="session")
def spawned(tmp_path_factory):
    """`spawned(group, ranks)`: every rank's result of that group (tests/worlds.py), spawned once."""
    from . import worlds

    cache = {}

    def get(group: str, ranks: int):
        if (group, ranks) not in cache:
            args = (str(tmp_path_factory.mktemp("resume")),) if group == "trainer" else ()
            if group == "trl":
                pytest.importorskip("trl")
                pytest.importorskip("peft")
            cache[group, ranks] = worlds.run(group, ranks, *args)
        return cache[group, ranks]

    return get
