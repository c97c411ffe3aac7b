"""Which in-rank bodies (tests/runs/) share each process group.

Starting processes (each one imports torch and transformers) is the slow part of the suite, so the
bodies of one concern and world size run in ONE group, spawned once per session by the `spawned`
fixture (conftest.py) and asserted by the test modules named here:

| group             | ranks   | bodies (tests/runs/)                                         | asserted in                          |
|-------------------|---------|--------------------------------------------------------------|--------------------------------------|
| `misc`            | 2       | robustness (bad and odd inputs, diverging ranks), randomness | test_robustness_gloo, test_randomness_gloo |
|                   |         | the log lines                                                | test_announce                        |
| `parity`          | 2, 4    | parity cases, the fused Ulysses exchange, generation under   | test_parity_gloo, test_ulysses_gloo, |
|                   |         | SP (at 2 also its refusals and the Trainer's --sp_generate); | test_generation_gloo, test_ring_gloo |
|                   |         | vision-language models; at 4 also the ring kernel numerics   | test_vlm_gloo                        |
| `packing`         | 2, 4    | packed-row cases                                             | test_packing_gloo                    |
| `tensor_parallel` | 2, 4    | TP (+ SP, DP) cases; at 2 also the TP refusals               | test_tp_gloo                         |
| `trainer`         | 2, 4    | Trainer runs; at 2 resume and TP generation; at 4 data /     | test_trainer_gloo, test_fsdp_gloo    |
|                   |         | prediction checks, the FSDP2 plain loops, GRPO / RLOO at     | test_trl_rl_gloo                     |
|                   |         | sp=2 x dp=2                                                  |                                      |
| `trl`             | 2       | TRL SFT / DPO runs, PEFT checks, GRPO / RLOO runs (sp=2) and | test_trl_gloo, test_peft_gloo,       |
|                   |         | their refusals of ranks that would diverge                   | test_trl_rl_gloo                     |

One-process references (the plain Trainer, TRL trainer, a plain evaluation) are spawned by the test
modules themselves: they run without a process group, in a fresh process so that no state leaks.
The bad-input cases of `misc` run last: the final one destroys the process group.
"""

from __future__ import annotations

import os

import torch.distributed as dist

# SEQPAR_CASES=<name>[,<name>...]: the parity, packing and TP groups run only those cases, and none of their
# other bodies: one case alone in seconds (`python -m tests.one <name>` sets it and selects its test).
ONLY = "SEQPAR_CASES"


def _only(cases: list[dict]) -> list[dict]:
    names = os.environ.get(ONLY)
    return cases if not names else [c for c in cases if c["name"] in names.split(",")]


def misc() -> dict:
    from .runs import announce, randomness, robustness

    return {
        "odd": robustness.odd_inputs(),
        "randomness": randomness.all_checks(),
        "announce": announce.all_checks(),
        "bad": robustness.bad_inputs(),
    }


def parity() -> dict:
    from .runs import generation, ulysses
    from .runs import parity as cases

    out = {"cases": cases.run_cases(_only(cases.CASES[dist.get_world_size()]))}
    if os.environ.get(ONLY):
        return out
    from .runs import vlm

    out.update(
        ulysses=ulysses.all_checks(),
        generation=generation.all_checks(dist.get_world_size()),
        vlm=vlm.all_checks(dist.get_world_size()),
    )
    if dist.get_world_size() == 4:
        from .runs import ring

        out["ring"] = ring.all_checks()
    return out


def packing() -> list[dict]:
    from .runs import packing as cases

    return cases.run_cases(_only(cases.CASES[dist.get_world_size()]))


def tensor_parallel() -> dict:
    from .runs import tp

    out = {"cases": tp.run_cases(_only(tp.CASES[dist.get_world_size()]))}
    if dist.get_world_size() == 2 and not os.environ.get(ONLY):  # the refusals need a tp=2 layout
        out["refusals"] = tp.refusals()
        out["regather"] = tp.regather_check()
    return out


def trainer(resume_dir: str) -> dict:
    from .runs import trainer as runs

    world = dist.get_world_size()
    out = {name: runs.run(**config) for name, (w, config) in runs.SETUPS.items() if w == world}
    if world == 2:
        out["resume"] = {
            name: runs.resume_run(f"{resume_dir}/{name}", **config) for name, config in runs.RESUME.items()
        }
        out["resume_across"] = runs.resume_across(resume_dir)
        out["tp_generate"] = runs.tp_generation_check()
    if world == 4:
        from .runs import fsdp

        out["checks"] = {drop: runs.data_and_prediction_checks(drop) for drop in (False, True)}
        out["checks"]["fsdp"] = runs.data_and_prediction_checks(False, fsdp=True)
        out["loops"] = fsdp.run_loops(fsdp.LOOPS)
        if _has_trl():
            from .runs import rl_trainers as rl

            out["rl"] = rl.run_many([dict(sp=2, **rl.CASES_4[n][0]) for n in rl.CASES_4])
    return out


def _has_trl() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("trl", "peft"))


def trl() -> dict:
    from .runs import lora
    from .runs import rl_trainers as rl
    from .runs import trl_trainers as runs

    return {
        "peft": lora.all_checks(),
        "trl": runs.run_many([dict(sp=2, **runs.CASES[n][0]) for n in runs.CASES]),
        "rl": rl.run_many([dict(sp=2, **rl.CASES[n][0]) for n in rl.CASES]),
        "rl_generation": rl.run_many([dict(sp=2, **rl.GENERATION[n][0]) for n in rl.GENERATION]),
        "rl_divergences": rl.divergences(),
    }


GROUPS = {
    "misc": (misc, 240),
    "parity": (parity, 480),
    "packing": (packing, 480),
    "tensor_parallel": (tensor_parallel, 480),
    "trainer": (trainer, 720),
    "trl": (trl, 900),
}


def run(group: str, world: int, *args) -> list:
    """Every rank's result of `group` at `world` ranks (tests/helpers/spawn.py: never hangs)."""
    from .helpers.spawn import spawn

    fn, timeout = GROUPS[group]
    return spawn(fn, world, *args, timeout=timeout)
