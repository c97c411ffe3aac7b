"""Tier 1: what the sequence-parallel GRPO / RLOO trainers refuse, with the reason and the fix, checked on the
arguments alone (before any collective). Skipped without trl."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

from seqpar_hf.training.trl_rl import check_eval_rows, check_rl_args


def _args(**overrides):
    args = dict(
        tp_size=1,
        sp_size=2,
        use_vllm=False,
        vllm_mode="colocate",
        use_transformers_continuous_batching=False,
        fsdp="",
        fsdp_config=None,
        deepspeed=None,
        per_device_train_batch_size=4,
        steps_per_generation=1,
        eval_strategy="no",
        per_device_eval_batch_size=4,
        world_size=4,
        num_generations=2,
        num_generations_eval=None,
        accelerator_config=None,
    )
    args.update(overrides)
    return SimpleNamespace(**args)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            dict(use_vllm=True, vllm_mode="server"),
            ["use_vllm=True", "server", "server mode", "colocate mode", "use_vllm=False"],
        ),
        (dict(tp_size=2), ["tp_size=2", "full weights"]),
        (dict(use_transformers_continuous_batching=True), ["continuous_batching", "paged attention"]),
        (dict(deepspeed="ds.json"), ["DeepSpeed", "DDP"]),
        (dict(fsdp="full_shard"), ["FSDP", "full parameters"]),
        (dict(per_device_train_batch_size=3), ["3 x 1 = 3 rows", "sp_size=2", "equal slice"]),
        (dict(per_device_train_batch_size=1, steps_per_generation=3), ["1 x 3 = 3 rows"]),
        (dict(eval_strategy="steps", per_device_eval_batch_size=3), ["per_device_eval_batch_size=3", "sp_size=2"]),
    ],
)
def test_refused_with_the_reason(overrides, words):
    with pytest.raises(ValueError) as error:
        check_rl_args(_args(**overrides))
    for word in words:
        assert word in str(error.value), (word, str(error.value))


def test_accepted():
    check_rl_args(_args())
    check_rl_args(
        _args(
            per_device_train_batch_size=1, steps_per_generation=2, eval_strategy="steps", per_device_eval_batch_size=2
        )
    )


def test_eval_rows_fill_whole_global_batches():
    args = _args(eval_strategy="steps", per_device_eval_batch_size=4)  # 2 replicas: global eval batch 8
    check_eval_rows(args, list(range(4)))  # 4 prompts x 2 generations = 8 rows
    check_eval_rows(args, None)
    with pytest.raises(ValueError, match=r"makes 6 rows \(3 prompts x num_generations\).*4 x 2 = 8"):
        check_eval_rows(args, list(range(3)))
    with pytest.raises(ValueError, match="'hard'"):
        check_eval_rows(args, {"easy": list(range(4)), "hard": list(range(5))})


def test_the_trainers_need_their_own_config():
    from trl import GRPOConfig

    from seqpar_hf.training.trl import SequenceParallelGRPOTrainer

    args = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], per_device_train_batch_size=2, num_generations=2)
    with pytest.raises(TypeError, match="SequenceParallelGRPOConfig"):
        SequenceParallelGRPOTrainer(model=None, args=args)


def test_one_process_config_is_trls():
    """sp_size=1: the generation batch TRL derives is unchanged (a replica is a process)."""
    from trl import GRPOConfig

    from seqpar_hf.training.trl import SequenceParallelGRPOConfig

    common = dict(
        output_dir="unused",
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=2,
        gradient_accumulation_steps=3,
    )
    ours, plain = SequenceParallelGRPOConfig(**common), GRPOConfig(**common)
    assert (
        (ours.generation_batch_size, ours.steps_per_generation)
        == (plain.generation_batch_size, plain.steps_per_generation)
        == (12, 3)
    )
    assert ours.world_size == 1
