import os

# Nothing may come from a hub at test time; models are built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


import pytest  # noqa: E402


def _misc_world2():
    """Robustness and randomness checks in one 2-process group (starting processes is the slow part).
    The bad-input cases run last: the final one destroys the process group."""
    from .test_randomness_gloo import _all as randomness
    from .test_robustness_gloo import _bad_inputs, _odd_inputs
    return {"odd": _odd_inputs(), "randomness": randomness(), "bad": _bad_inputs()}


@pytest.fixture(scope="session")
def misc_world2():
    from .spawn import spawn
    return spawn(_misc_world2, 2)


def _parity_world(cases):
    """The parity cases of one world size; at world 4 also the ring kernel checks (same process group)."""
    import torch.distributed as dist

    from .parity import run_cases
    out = {"cases": run_cases(cases)}
    if dist.get_world_size() == 4:
        from .test_ring_gloo import _all as ring
        out["ring"] = ring()
    return out


@pytest.fixture(scope="session")
def parity_world():
    from .spawn import spawn
    from .test_parity_gloo import CASES
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = spawn(_parity_world, world, CASES[world], timeout=480)
        return cache[world]
    return get


@pytest.fixture(scope="session")
def trl_world2():
    """TRL runs and PEFT checks in one 2-process group (tests/test_trl_gloo.py, tests/test_peft_gloo.py)."""
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    from .spawn import spawn
    from .test_trl_gloo import CASES, _world2
    return spawn(_world2, 2, [dict(sp=2, **CASES[n][0]) for n in CASES], timeout=600)


@pytest.fixture(scope="session")
def trainer_worlds(tmp_path_factory):
    """Trainer runs per world size in one process group each (tests/test_trainer_gloo.py; at world 4
    also the FSDP2 plain loops of tests/test_fsdp_gloo.py)."""
    from .spawn import spawn
    from .test_trainer_gloo import _world
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = spawn(_world, world, world, str(tmp_path_factory.mktemp("resume")), timeout=540)[0]
        return cache[world]
    return get
