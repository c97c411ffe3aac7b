"""Short TRL GRPO / RLOO runs used by tests/test_trl_rl_gloo.py, inside spawned gloo processes.

A tiny Llama, the word-level tokenizer of trl_trainers.py, prompts made of its words and programmatic
rewards. Completions are fixed by construction so that the sequence-parallel run and the one-process
plain TRL reference train on the SAME completions: the model's `generate` is replaced by one that
returns, for the row at global index g of the generation batch (prompt p), tokens drawn from a generator
seeded by (p, g). The rank of an SP group generating rows [start, stop) of its replica's batch passes
g = dp_rank x rows per replica + start + i (the trainer's documented slicing); one process passes g = i.
TRL's micro-batch shuffle (`shuffle_sequence_dict`, a random permutation of the generation batch
before it is split over gradient-accumulation steps) is the identity in both runs, so that the
per-micro-batch metrics compare; `run_generation` keeps TRL's shuffle and the real `generate`.
"""

from __future__ import annotations

import copy
import os
import tempfile
import zlib

import torch
from datasets import Dataset
from transformers import TrainerCallback

from ..helpers.models import VOCAB, build_model
from .trl_trainers import tokenizer

MAX_COMPLETION = 6
SKIPPED = ("time", "runtime", "per_second", "flos", "learning_rate", "epoch")  # wall clock or not a result


def prompts(n: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(4, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        rows.append({"prompt": " ".join(f"t{i}" for i in ids), "target": int(torch.randint(1, 6, (1,), generator=g))})
    return Dataset.from_list(rows)


def even_tokens(completions, **kwargs):
    """Fraction of the completion's words that are even token ids."""
    return [sum(int(w[1:]) % 2 == 0 for w in c.split()) / max(len(c.split()), 1) for c in completions]


def near_target(completions, target, **kwargs):
    """Uses a dataset column (sliced per rank with the rows)."""
    return [-abs(len(c.split()) - t) / 4 for c, t in zip(completions, target)]


class Recorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        kept = {
            k: v for k, v in (logs or {}).items() if isinstance(v, (int, float)) and not any(s in k for s in SKIPPED)
        }
        self.logs.append({"step": state.global_step, **kept})


def fixed_generate(trainer, offset, counts: list):
    """Replace the policy's `generate`: completions that depend only on (prompt, global row index)."""
    pad, eos = trainer._tokenizer.pad_token_id, trainer._tokenizer.eos_token_id

    def generate(input_ids, attention_mask, **kwargs):
        counts.append(input_ids.shape[0])
        rows = []
        for i, (ids, mask) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
            prompt = [t for t, m in zip(ids, mask) if m]
            g = torch.Generator().manual_seed(zlib.crc32(repr((prompt, offset(trainer) + i)).encode()))
            length = int(torch.randint(1, MAX_COMPLETION + 1, (1,), generator=g))
            tokens = torch.randint(4, VOCAB, (length,), generator=g).tolist()
            if length < MAX_COMPLETION and int(torch.randint(0, 3, (1,), generator=g)):
                tokens.append(eos)  # some end with EOS, the others are truncated
            rows.append(tokens + [pad] * (MAX_COMPLETION - len(tokens)))
        return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], dim=1)

    trainer.model.generate = generate  # what TRL's unwrap_model_for_generation hands back


def counted_generate(trainer, counts: list):
    """Keep the policy's own `generate`, counting the rows of each call."""
    generate = trainer.model.generate

    def counted(input_ids, **kwargs):
        counts.append(input_ids.shape[0])
        return generate(input_ids=input_ids, **kwargs)

    trainer.model.generate = counted


def replica_offset(trainer) -> int:
    args, layout = trainer.args, trainer.layout
    rows = (
        args.per_device_train_batch_size * args.steps_per_generation
        if trainer.model.training
        else args.per_device_eval_batch_size
    )
    return layout.dp_rank * rows + layout.sp_rank * (rows // layout.sp_size)


def _saved(model) -> str:
    """A checkpoint of the model (the same on every rank), written by rank 0 (transformers saves only there)."""
    import torch.distributed as dist

    path = [tempfile.mkdtemp()]
    if dist.is_initialized():
        dist.broadcast_object_list(path, src=0)
    model.save_pretrained(path[0])
    if dist.is_initialized():
        dist.barrier()
    return path[0]


def _identity_shuffle():
    import trl.trainer.grpo_trainer as grpo
    import trl.trainer.rloo_trainer as rloo

    grpo.shuffle_sequence_dict = rloo.shuffle_sequence_dict = lambda batch: batch


def _config(trainer, sp, dp, batch, accumulation, steps, checkpointing, evaluate, extra, mode):
    common = dict(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch * (dp if sp == 0 else 1),
        per_device_eval_batch_size=batch * (dp if sp == 0 else 1),
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        lr_scheduler_type="constant",
        bf16=False,
        gradient_checkpointing=checkpointing,
        num_generations=2,
        max_completion_length=MAX_COMPLETION,
        epsilon=0.05,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=steps,
    )
    if checkpointing:
        common["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    common.update(extra or {})
    import trl

    from seqpar_hf.training import trl as sp_trl

    if sp == 0:
        return (trl.GRPOConfig if trainer == "grpo" else trl.RLOOConfig)(**common)
    config = sp_trl.SequenceParallelGRPOConfig if trainer == "grpo" else sp_trl.SequenceParallelRLOOConfig
    return config(sp_size=sp, sp_mode=mode, **common)


def _model(family: str):
    model = build_model(family, layers=2)
    if family == "granitemoehybrid":  # TRL 1.16 reads num_experts for an MoE model's load-balancing loss
        model.config.num_experts = model.config.num_local_experts
    return model


def run_rl(
    trainer: str = "grpo",
    sp: int = 0,
    dp: int = 1,
    batch: int = 4,
    accumulation: int = 1,
    steps: int = 3,
    mode: str = "ulysses",
    peft: bool = False,
    checkpointing: bool = False,
    ref: str = "copy",
    evaluate: bool = False,
    extra: dict | None = None,
    generate: str = "fixed",
    prompt_seed: int = 1,
    family: str = "llama",
) -> dict:
    """sp=0: plain TRL in one process with the global batch of `dp` replicas of `batch` rows (the
    reference). ref: "copy" (a deep copy of the patched policy), "separate" (an unpatched model),
    "path" (TRL loads it from the policy's saved checkpoint); the reference always loads it from there.
    generate: "fixed" (completions fixed by construction, the shuffle the identity) or "model" (the policy's
    own `generate`, TRL's shuffle). prompt_seed: the training prompts' seed."""
    import trl

    from seqpar_hf.training import trl as sp_trl

    # an FSDP run earlier in this process (the `trainer` group) leaves ACCELERATE_USE_FSDP=true behind
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    if generate == "fixed":
        _identity_shuffle()
    model = _model(family)
    model.config._name_or_path = _saved(model)  # where TRL loads its own reference model from
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    recorder = Recorder()
    data = dict(
        reward_funcs=[even_tokens, near_target],
        train_dataset=prompts(16, prompt_seed),
        eval_dataset=prompts(4, 2),
        processing_class=tokenizer(),
        callbacks=[recorder],
        peft_config=peft_config,
    )
    args = _config(trainer, sp, dp, batch, accumulation, steps, checkpointing, evaluate, extra, mode)
    if sp == 0:
        plain = trl.GRPOTrainer if trainer == "grpo" else trl.RLOOTrainer
        t = plain(model=model, args=args, **data)
        offset = lambda _: 0
    else:
        import seqpar_hf

        layout = seqpar_hf.ParallelLayout(sp_size=sp, mode=mode)
        separate = _model(family)
        seqpar_hf.patch_model(model, layout)
        ref_model = {"copy": copy.deepcopy(model), "separate": separate, "path": None}[ref]
        cls = sp_trl.SequenceParallelGRPOTrainer if trainer == "grpo" else sp_trl.SequenceParallelRLOOTrainer
        t = cls(model=model, args=args, ref_model=ref_model, layout=layout, **data)
        offset = replica_offset
    counts = []
    fixed_generate(t, offset, counts) if generate == "fixed" else counted_generate(t, counts)
    t.train()
    batches = [{k: v.tolist() for k, v in b.items() if hasattr(v, "tolist")} for b in t._buffered_inputs]
    return {
        "logs": recorder.logs,
        "advantages": list(t._logs["advantages"]),
        "completions": list(t._logs["completion"]),
        "generated_rows": counts,
        "last_batches": batches,
        "generation_batch_size": t.args.generation_batch_size,
    }


def run_many(configs: list[dict]) -> list[dict]:
    return [run_rl(**c) for c in configs]


def divergences() -> dict:
    """Ranks of an SP group given different group settings or different prompts: the same error on every rank,
    at the trainer's construction or at the first generation batch, instead of training on a mix."""
    import torch.distributed as dist

    from .robustness import attempt

    rank = dist.get_rank()
    return {
        "num-generations-differ": attempt(lambda: run_rl(sp=2, steps=1, extra=dict(num_generations=2 + 2 * rank))),
        "datasets-differ": attempt(lambda: run_rl(sp=2, steps=1, prompt_seed=1 + rank)),
    }


# name -> (sequence-parallel run at sp=2 (and dp=2 in the 4-rank cases), the one-process reference).
GRPO = dict(extra=dict(beta=0.04))
CASES = {
    "grpo-kl-reference-a-patched-copy": (dict(**GRPO, evaluate=True), dict(**GRPO, evaluate=True)),
    "grpo-separate-reference": (dict(**GRPO, ref="separate"), dict(**GRPO)),
    "grpo-reference-loaded-by-trl": (dict(**GRPO, ref="path"), dict(**GRPO)),
    "grpo-ring": (dict(**GRPO, mode="ring"), dict(**GRPO)),
    # Granite 4: Mamba2 mixers split along the sequence, MoE with TRL's load-balancing loss (output_router_logits=,
    # the router logits gathered over the group). Not at dp=2: a load-balancing loss per replica is not one process's
    "grpo-granite4-moe": (dict(**GRPO, family="granitemoehybrid"), dict(**GRPO, family="granitemoehybrid")),
    # Qwen3.5: gated DeltaNet layers split along the sequence (zigzag shards), generation's cache of their states
    "grpo-qwen3_5-deltanet-ring": (dict(**GRPO, family="qwen3_5", mode="ring"), dict(**GRPO, family="qwen3_5")),
    "grpo-peft-checkpointing": (
        dict(**GRPO, peft=True, checkpointing=True),
        dict(**GRPO, peft=True, checkpointing=True),
    ),
    "grpo-accumulation": (dict(**GRPO, batch=2, accumulation=2), dict(**GRPO, batch=2, accumulation=2)),
    **{
        f"grpo-{loss}-two-iterations": (
            dict(extra=dict(beta=0.04, loss_type=loss, num_iterations=2, **kw)),
            dict(extra=dict(beta=0.04, loss_type=loss, num_iterations=2, **kw)),
        )
        for loss, kw in (
            ("grpo", {}),
            ("bnpo", {}),
            ("dr_grpo", {}),
            ("dapo", {}),
            ("cispo", {"epsilon_high": 1.02}),
            ("sapo", {}),
            ("luspo", {"importance_sampling_level": "sequence"}),
            ("vespo", {}),
        )
    },
    "rloo": (dict(trainer="rloo", evaluate=True), dict(trainer="rloo", evaluate=True)),
    "rloo-separate-reference-ring": (dict(trainer="rloo", ref="separate", mode="ring"), dict(trainer="rloo")),
    "rloo-peft-accumulation": (
        dict(trainer="rloo", peft=True, batch=2, accumulation=2),
        dict(trainer="rloo", peft=True, batch=2, accumulation=2),
    ),
}
# The policy's own generate: greedy (deterministic, so comparable with one process), and sampled with
# TRL's shuffle and gradient accumulation (every rank of a group must then hold the same micro-batches).
GREEDY = dict(generate="model", extra=dict(beta=0.04, generation_kwargs={"do_sample": False}))
GENERATION = {
    "greedy": (GREEDY, GREEDY),
    "sampled-accumulation": (dict(**GRPO, generate="model", batch=2, accumulation=2, steps=2), None),
}
# sp=2 x dp=2 against one process with the global batch (per_device x 2)
CASES_4 = {
    "grpo-dp2": (dict(**GRPO, dp=2, evaluate=True), dict(**GRPO, dp=2, evaluate=True)),
    "grpo-dp2-ring-peft": (dict(**GRPO, dp=2, mode="ring", peft=True), dict(**GRPO, dp=2, peft=True)),
    "rloo-dp2": (dict(trainer="rloo", dp=2), dict(trainer="rloo", dp=2)),
}
