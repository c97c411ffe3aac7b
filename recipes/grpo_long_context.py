"""Reinforcement learning (GRPO) of a small decoder-only model on long prompts, with sequence parallelism
through TRL's GRPOTrainer (which TRL itself runs only without SP).

Launch (from the repository root):

    # 2 CPU processes, one SP group of 2: every prompt + completion is split over both ranks in the
    # forwards, and each rank generates half of the group's completions (18.5 minutes;
    # mean reward of the first tenth of the GRPO steps 0.094, of the last tenth 0.171)
    accelerate launch --config_file recipes/accelerate_cpu_2proc.yaml recipes/grpo_long_context.py --sp_size 2

    # 8 GPUs: 2 SP groups of 4, prompts of ~12K tokens, a bigger model
    accelerate launch --config_file recipes/accelerate_8gpu.yaml recipes/grpo_long_context.py --sp_size 4 \
        --sentences_per_prompt 1024 --hidden_size 1024 --num_layers 8 --max_completion_length 32 \
        --bf16 --gradient_checkpointing --sft_minutes 20 --max_train_minutes 60

    # the reward curve of a run (its log.jsonl) as a PNG
    python recipes/plot_rewards.py runs/grpo_long_context

The task, built from the project's Tatoeba sentences (data/, English side, the translation recipe's BPE):
a prompt is `--sentences_per_prompt` consecutive sentences, each ending with </s>, then </s>; the model
should repeat the FIRST sentence, the one farthest back (on the first rank of the SP group's shards).
Two programmatic rewards, each in [0, 1]: `first_sentence`, the F1 of the completion's tokens against
that sentence's (bags of tokens), and `first_words`, how many of its first 4 tokens the completion starts
with, in order. A model from scratch first learns the frequent words (the F1 rises with them); copying
needs attention across the whole prompt and more training. As usual for RL, a short supervised warm-up
on the task (`--sft_minutes`, sequence-parallel too) comes first. Every logged GRPO step goes to
`<output_dir>/log.jsonl`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, set_seed

from seqpar_hf import TimeBudgetCallback
from seqpar_hf.training.trl import (
    SequenceParallelGRPOConfig,
    SequenceParallelGRPOTrainer,
    SequenceParallelSFTConfig,
    SequenceParallelSFTTrainer,
)

if __package__:  # imported as recipes.grpo_long_context (tests)
    from . import recipe_checks, translation_data
else:  # launched as a script: its folder (with the translation recipe's data module) is on sys.path
    import recipe_checks
    import translation_data

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("grpo_long_context")
FIRST_WORDS = 4  # the prefix the `first_words` reward scores
CHECKPOINTING = recipe_checks.checkpointing_field()


@dataclass
class RecipeArguments:
    hidden_size: int = field(default=256, metadata={"help": "Model width."})
    num_layers: int = field(default=4, metadata={"help": "Decoder layers."})
    num_heads: int = field(default=8, metadata={"help": "Attention heads."})
    num_kv_heads: int = field(default=2, metadata={"help": "Key/value heads (grouped-query attention)."})
    sentences_per_prompt: int = field(default=32, metadata={"help": "Sentences per prompt (~12 tokens each)."})
    max_prompts: int = field(default=4000, metadata={"help": "Training prompts (each of consecutive sentences)."})
    eval_prompts: int = field(default=8, metadata={"help": "Held-out prompts (test sentences) for the eval reward."})
    max_pairs: int | None = field(
        default=None,
        metadata={"help": "Read only the first N sentence pairs of the data file (its shortest; for quick checks)."},
    )
    vocab_size: int = field(
        default=8000,
        metadata={"help": "BPE vocabulary (the translation recipe's cache entry with the same settings is shared)."},
    )
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "Start from this saved model (same tokenizer: e.g. runs/sft_long_context) instead of scratch."
        },
    )
    sft_minutes: float = field(
        default=5.0,
        metadata={
            "help": "Supervised warm-up on the task (prompt -> first "
            "sentence) before GRPO, in minutes; 0: GRPO from scratch."
        },
    )
    max_train_minutes: float = field(default=13.0, metadata={"help": "Stop GRPO after this many minutes."})
    num_threads: int = field(default=0, metadata={"help": "Torch threads per process on CPU; 0: cores / processes."})
    data_cache_dir: str = field(default=str(ROOT / "cache"), metadata={"help": "Where preprocessed data is cached."})


@dataclass
class GRPOArguments(SequenceParallelGRPOConfig):
    """The recipe's defaults (a 2-core CPU, ~18 minutes; override any)."""

    output_dir: str = field(default=str(ROOT / "runs" / "grpo_long_context"), metadata={"help": "Where to save."})
    per_device_train_batch_size: int = 8  # rows per SP group and step: 1 prompt x 8 completions
    per_device_eval_batch_size: int = 8
    num_generations: int = 8  # completions per prompt (the group whose rewards are compared)
    max_completion_length: int = 16  # the first sentences are ~10 tokens
    learning_rate: float = 1e-4  # 1e-3 collapses the policy within 50 steps (entropy -> 0.06)
    lr_scheduler_type: str = "constant"
    max_steps: int = 2000  # upper bound: --max_train_minutes usually ends training first
    logging_steps: float = 1
    eval_strategy: str = "steps"  # the eval reward on held-out prompts; also once when the time budget ends
    eval_steps: float = 100
    save_strategy: str = "no"
    report_to: None | str | list[str] = "none"
    seed: int = 0
    dataloader_num_workers: int = 0
    bf16: bool = False  # TRL turns bf16 on by default, which on a CPU without bf16 units is several times slower
    # every parameter takes part in every step: DDP need not search the graph for unused ones (transformers'
    # default, True, costs a graph traversal per step and makes DDP warn about it)
    ddp_find_unused_parameters: bool | None = False
    # TRL checkpoints by default; a small model's activations fit (turn it on for long prompts on a GPU). Where the
    # field is activation_checkpointing (False unless set), the old name stays unset: setting it warns
    gradient_checkpointing: bool | None = None if CHECKPOINTING == "activation_checkpointing" else False


def parse_args(argv=None):
    """The recipe's and the trainer's arguments, checked (argparse's error, exit code 2, on every rank alike)."""
    return recipe_checks.parse_checked((RecipeArguments, GRPOArguments), check_args, argv)


def check_args(recipe: RecipeArguments, args: GRPOArguments) -> None:
    """The recipe's flags, before any data or process-group work: ValueError "--flag value: what is allowed"."""
    check = recipe_checks
    for flag, meaning in (
        ("hidden_size", "model width"),
        ("num_layers", "decoder layers"),
        ("num_heads", "attention heads"),
        ("num_kv_heads", "key/value heads"),
        ("sentences_per_prompt", "sentences per prompt"),
        ("max_prompts", "training prompts"),
        ("eval_prompts", "held-out prompts"),
    ):
        check.at_least(flag, getattr(recipe, flag), 1, meaning)
    if recipe.num_kv_heads > recipe.num_heads or recipe.num_heads % recipe.num_kv_heads:
        raise ValueError(f"--num_kv_heads {recipe.num_kv_heads}: must divide --num_heads {recipe.num_heads}")
    if recipe.hidden_size % recipe.num_heads or (recipe.hidden_size // recipe.num_heads) % 2:
        raise ValueError(
            f"--hidden_size {recipe.hidden_size}: must be --num_heads {recipe.num_heads} x an even head "
            "size (rotary positions turn pairs of channels)"
        )
    check.at_least("max_train_minutes", recipe.max_train_minutes, 0, "minutes of training; 0: no limit")
    check.at_least("sft_minutes", recipe.sft_minutes, 0, "minutes of supervised warm-up; 0: none")
    check.at_least("num_threads", recipe.num_threads, 0, "torch threads per process; 0: cores / local processes")
    check.optional_positive("max_pairs", recipe.max_pairs, "pairs read from the data file; leave it out for all")
    check.at_least("vocab_size", recipe.vocab_size, 4, "BPE vocabulary size")
    check.folder("data_cache_dir", recipe.data_cache_dir, writable=False)
    check.folder("output_dir", args.output_dir, writable=True)


# ---- the task -----------------------------------------------------------------------------------------------


def prompts(sentences: list[list[int]], per_prompt: int, limit: int, tokenizer) -> Dataset:
    """Consecutive sentences (ids ending with </s>) as one prompt; the first one is the reference."""
    rows = []
    for start in range(0, len(sentences) - per_prompt + 1, per_prompt):
        chunk = sentences[start : start + per_prompt]
        ids = [t for s in chunk for t in s]
        rows.append({"prompt": tokenizer.decode(ids), "reference": chunk[0][:-1]})
        if len(rows) == limit:
            break
    return Dataset.from_list(rows)


def _content(ids: list[int], special: set[int]) -> list[int]:
    return [t for t in ids if t not in special]


def make_rewards(tokenizer):
    special = set(tokenizer.all_special_ids)

    def first_sentence(completion_ids, reference, **kwargs):
        """F1 of the completion's tokens against the first sentence's (bags of tokens)."""
        out = []
        for ids, ref in zip(completion_ids, reference):
            got, want = Counter(_content(ids, special)), Counter(ref)
            common = sum((got & want).values())
            out.append(0.0 if common == 0 else 2 * common / (sum(got.values()) + sum(want.values())))
        return out

    def first_words(completion_ids, reference, **kwargs):
        """How many of the first sentence's first FIRST_WORDS tokens the completion starts with, in order."""
        out = []
        for ids, ref in zip(completion_ids, reference):
            want, n = ref[:FIRST_WORDS], 0
            while n < len(want) and n < len(ids) and ids[n] == want[n]:
                n += 1
            out.append(n / len(want) if want else 0.0)
        return out

    return [first_sentence, first_words]


def warm_up(model, train: Dataset, held_out: Dataset, tokenizer, args: GRPOArguments, minutes: float):
    """The usual start of RL: a few minutes of supervised training on the task itself (loss on the first
    sentence only), sequence-parallel too. Returns the layout, which GRPO reuses with the patched model."""
    sft_args = SequenceParallelSFTConfig(
        output_dir=str(Path(args.output_dir) / "sft"),
        sp_size=args.sp_size,
        sp_mode=args.sp_mode,
        sp_ring_size=args.sp_ring_size,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        max_steps=10000,
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        max_length=None,
        bf16=args.bf16,
        seed=args.seed,
        **{CHECKPOINTING: getattr(args, CHECKPOINTING)},
        ddp_find_unused_parameters=args.ddp_find_unused_parameters,
        dataloader_num_workers=0,
        use_cpu=args.use_cpu,
        per_device_eval_batch_size=8,
        eval_strategy="no",
    )

    def pairs(data):
        return Dataset.from_dict(
            {
                "prompt": data["prompt"],
                "completion": [tokenizer.decode(ref) + tokenizer.eos_token for ref in data["reference"]],
            }
        )

    trainer = SequenceParallelSFTTrainer(
        model=model,
        args=sft_args,
        train_dataset=pairs(train),
        eval_dataset=pairs(held_out),
        processing_class=tokenizer,
        callbacks=[TimeBudgetCallback(minutes)],
    )
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    evals = [r["eval_loss"] for r in trainer.state.log_history if "eval_loss" in r]
    logger.info(
        "supervised warm-up: %d steps, loss %s, held-out loss %s",
        trainer.state.global_step,
        " -> ".join(f"{x:.3f}" for x in losses[:1] + losses[-1:]) or "-",
        f"{evals[-1]:.3f}" if evals else "-",
    )
    return trainer.layout


class JsonlLog(TrainerCallback):
    """Every log line (reward per step, loss, ...) appended to <output_dir>/log.jsonl, on the main process."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.path.write_text("")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": state.global_step, "time": time.time(), **logs}) + "\n")


def main(argv=None):
    recipe, args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    transformers.utils.logging.set_verbosity_warning()
    if not args.should_log:
        logger.setLevel(logging.WARNING)
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(recipe.num_threads or max(1, len(os.sched_getaffinity(0)) // local))
        logger.info("compute: %d threads per process", torch.get_num_threads())
    set_seed(args.seed)
    started = time.time()
    with args.main_process_first(desc="preparing the data"):  # the SFT recipe's cache entry (same settings)
        tokenizer, splits = translation_data.prepare(
            recipe.data_cache_dir,
            vocab_size=recipe.vocab_size,
            seed=0,
            max_source_length=80,
            max_target_length=80,
            max_pairs=recipe.max_pairs,
        )
    translation_data.check_same_tokenizer(tokenizer, args.device)  # a cache per node may differ
    tokenizer.padding_side = "left"
    train = prompts(splits["train"]["input_ids"], recipe.sentences_per_prompt, recipe.max_prompts, tokenizer)
    held_out = prompts(splits["test"]["input_ids"], recipe.sentences_per_prompt, recipe.eval_prompts, tokenizer)
    logger.info(
        "data: %d prompts of %d sentences (%d tokens on average)",
        len(train),
        recipe.sentences_per_prompt,
        sum(len(tokenizer(p)["input_ids"]) for p in train["prompt"][:50]) // min(50, len(train)),
    )

    if recipe.init_from:
        model = LlamaForCausalLM.from_pretrained(recipe.init_from)
    else:
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=recipe.hidden_size,
            intermediate_size=4 * recipe.hidden_size,
            num_hidden_layers=recipe.num_layers,
            num_attention_heads=recipe.num_heads,
            num_key_value_heads=recipe.num_kv_heads,
            max_position_embeddings=max(16 * recipe.sentences_per_prompt + 64, 2048),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
            tie_word_embeddings=True,
        )
        model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    logger.info(
        "model: Llama %d layers, hidden %d, %.1fM parameters; sp_size=%d (%s); %d completions per prompt",
        model.config.num_hidden_layers,
        model.config.hidden_size,
        sum(p.numel() for p in model.parameters()) / 1e6,
        args.sp_size,
        args.sp_mode,
        args.num_generations,
    )

    layout = warm_up(model, train, held_out, tokenizer, args, recipe.sft_minutes) if recipe.sft_minutes > 0 else None
    trainer = SequenceParallelGRPOTrainer(
        model=model,
        layout=layout,
        reward_funcs=make_rewards(tokenizer),
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=tokenizer,
        callbacks=[TimeBudgetCallback(recipe.max_train_minutes), JsonlLog(Path(args.output_dir) / "log.jsonl")],
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    evals = [r for r in trainer.state.log_history if "eval_reward" in r]

    if trainer.is_world_process_zero():
        rewards = [r for r in trainer.state.log_history if "reward" in r]
        first, last = rewards[: max(1, len(rewards) // 10)], rewards[-max(1, len(rewards) // 10) :]
        mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)
        print(
            f"\n{len(rewards)} steps; mean reward of the first tenth {mean(first, 'reward'):.3f} -> last tenth "
            f"{mean(last, 'reward'):.3f} (first_sentence {mean(first, 'rewards/first_sentence/mean'):.3f} -> "
            f"{mean(last, 'rewards/first_sentence/mean'):.3f}, first_words "
            f"{mean(first, 'rewards/first_words/mean'):.3f} -> {mean(last, 'rewards/first_words/mean'):.3f}); "
            f"total time {(time.time() - started) / 60:.1f} min; log: {Path(args.output_dir) / 'log.jsonl'}"
        )
        for r in evals:
            print(
                f"  eval at step {r['step']}: reward {r['eval_reward']:.3f} (first_sentence "
                f"{r['eval_rewards/first_sentence/mean']:.3f}, first_words {r['eval_rewards/first_words/mean']:.3f})"
            )
    # every rank generates (the prompt prefilled sharded over the SP group: a collective), rank 0 prints
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    for i in range(2):
        ids = tokenizer(train[i]["prompt"], return_tensors="pt")["input_ids"].to(model.device)
        out = model.generate(
            input_ids=ids,
            max_new_tokens=args.max_completion_length,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        if trainer.is_world_process_zero():
            print(
                f"  FIRST: {tokenizer.decode(train[i]['reference'])}\n  OUT:   "
                f"{tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)}"
            )


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # join gloo's threads before exit: without it a rank can abort there
        torch.distributed.destroy_process_group()  # ("terminate called without an active exception")
