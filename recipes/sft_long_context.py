"""Supervised fine-tuning of a small decoder-only model on long packed documents, with sequence
parallelism through TRL's SFTTrainer.

Launch (from the repository root):

    # 2 CPU processes, one SP group of 2: every 2048-token row is split over both ranks
    accelerate launch --config_file recipes/accelerate_cpu_2proc.yaml recipes/sft_long_context.py --sp_size 2

    # the same in one process (the reference: same losses, twice the activation memory per rank)
    python recipes/sft_long_context.py

    # 8 GPUs: SP groups of 4 x 2 replicas, longer rows, a bigger model
    accelerate launch --config_file recipes/accelerate_8gpu.yaml recipes/sft_long_context.py \\
        --sp_size 4 --max_length 32768 --hidden_size 1024 --num_layers 8 --bf16

The data are the project's Tatoeba pairs (data/), tokenized as in the translation recipe (NLTK, shared
BPE). A document is `--pairs_per_document` consecutive pairs, each "English </s> French </s>"; TRL
packs documents into padding-free rows of `--max_length` tokens (best-fit decreasing), positions
restarting per document, and seqpar_hf keeps attention inside each document while splitting the row
over the SP group. After training it continues a few English sentences (the model learned to
translate them) and saves a plain checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, set_seed

from seqpar_hf import TimeBudgetCallback
from seqpar_hf.training.trl import SequenceParallelSFTConfig, SequenceParallelSFTTrainer

if __package__:  # imported as recipes.sft_long_context (tests)
    from . import recipe_checks, translation_data
else:  # launched as a script: its folder (with the translation recipe's data module) is on sys.path
    import recipe_checks
    import translation_data

ROOT = Path(__file__).resolve().parent.parent
EVAL_PAIRS = 2000  # evaluation documents are cut from the last pairs of the training split
logger = logging.getLogger("sft_long_context")


@dataclass
class RecipeArguments:
    hidden_size: int = field(default=256, metadata={"help": "Model width."})
    num_layers: int = field(default=4, metadata={"help": "Decoder layers."})
    num_heads: int = field(default=8, metadata={"help": "Attention heads."})
    num_kv_heads: int = field(default=2, metadata={"help": "Key/value heads (grouped-query attention)."})
    pairs_per_document: int = field(default=48, metadata={"help": "Sentence pairs per document (~900 tokens)."})
    max_documents: int = field(default=2000, metadata={"help": "Training documents (each of consecutive pairs)."})
    eval_documents: int = field(default=16, metadata={"help": "Held-out documents for eval_loss."})
    max_train_minutes: float = field(default=6.0, metadata={"help": "Stop training after this many minutes."})
    num_threads: int = field(default=0, metadata={"help": "Torch threads per process on CPU; 0: cores / processes."})
    data_cache_dir: str = field(default=str(ROOT / "cache"), metadata={"help": "Where preprocessed data is cached."})


@dataclass
class SFTArguments(SequenceParallelSFTConfig):
    """The recipe's defaults (fit a 2-core CPU in minutes; override any)."""

    output_dir: str = field(default=str(ROOT / "runs" / "sft_long_context"), metadata={"help": "Where to save."})
    max_length: int | None = 2048  # tokens per packed row: what SP splits
    packing: bool = True
    per_device_train_batch_size: int = 1  # rows
    per_device_eval_batch_size: int = 1
    learning_rate: float = 2e-3
    lr_scheduler_type: str = "cosine"
    warmup_steps: float = 20
    max_steps: int = 400  # upper bound: --max_train_minutes usually ends training first
    logging_steps: float = 10
    eval_strategy: str = "steps"
    eval_steps: float = 200
    save_strategy: str = "no"
    report_to: None | str | list[str] = "none"
    seed: int = 0
    dataloader_num_workers: int = 0
    bf16: bool = False  # TRL turns bf16 on by default, which on a CPU without bf16 units is several times slower
    # every parameter takes part in every step: DDP need not search the graph for unused ones (transformers'
    # default, True, costs a graph traversal per step and makes DDP warn about it)
    ddp_find_unused_parameters: bool | None = False
    # TRL checkpoints by default; a small model's activations fit (turn it on for long rows on a GPU). Where the
    # field is activation_checkpointing (False unless set), the old name stays unset: setting it warns
    gradient_checkpointing: bool | None = (
        None if recipe_checks.checkpointing_field() == "activation_checkpointing" else False
    )


def parse_args(argv=None):
    """The recipe's and the trainer's arguments, checked (argparse's error, exit code 2, on every rank alike)."""
    return recipe_checks.parse_checked((RecipeArguments, SFTArguments), check_args, argv)


def check_args(recipe: RecipeArguments, args: SFTArguments) -> None:
    """The recipe's flags (and the training flags it relies on), before any data or process-group work:
    ValueError "--flag value: what is allowed". Reads only the arguments (and tries --output_dir)."""
    check = recipe_checks
    for flag, meaning in (
        ("hidden_size", "model width"),
        ("num_layers", "decoder layers"),
        ("num_heads", "attention heads"),
        ("num_kv_heads", "key/value heads"),
        ("pairs_per_document", "sentence pairs per document"),
        ("max_documents", "training documents"),
        ("eval_documents", "held-out documents"),
    ):
        check.at_least(flag, getattr(recipe, flag), 1, meaning)
    if recipe.num_kv_heads > recipe.num_heads or recipe.num_heads % recipe.num_kv_heads:
        raise ValueError(
            f"--num_kv_heads {recipe.num_kv_heads}: must divide --num_heads {recipe.num_heads} "
            "(grouped-query attention: each key/value head serves the same number of query heads)"
        )
    if recipe.hidden_size % recipe.num_heads or (recipe.hidden_size // recipe.num_heads) % 2:
        raise ValueError(
            f"--hidden_size {recipe.hidden_size}: must be --num_heads {recipe.num_heads} x an even head "
            "size (each head gets hidden_size / num_heads channels; rotary positions turn pairs of them)"
        )
    if recipe.pairs_per_document * recipe.eval_documents > EVAL_PAIRS:
        raise ValueError(
            f"--eval_documents {recipe.eval_documents} x --pairs_per_document {recipe.pairs_per_document}: "
            f"must be at most {EVAL_PAIRS} pairs (the held-out documents are cut from the last "
            f"{EVAL_PAIRS} pairs of the training split)"
        )
    check.at_least("max_train_minutes", recipe.max_train_minutes, 0, "minutes of training; 0: no limit")
    check.at_least(
        "num_threads",
        recipe.num_threads,
        0,
        "torch threads per process; 0: the usable cores divided by the local processes",
    )
    if args.max_length is None:
        raise ValueError("--max_length None: must be a number of tokens (the packed rows' length, what SP splits)")
    check.at_least("max_length", args.max_length, 1, "tokens per packed row, what SP splits")
    for flag in ("per_device_train_batch_size", "per_device_eval_batch_size"):
        check.at_least(flag, getattr(args, flag), 1, "rows per rank and step")
    check.folder("data_cache_dir", recipe.data_cache_dir, writable=False)  # a prepared cache may be read-only
    check.folder("output_dir", args.output_dir, writable=True)


def documents(split, pairs: int, limit: int) -> Dataset:
    """Consecutive pairs joined into documents: English ids, French ids (each ends with </s>), repeated."""
    src, tgt = split["input_ids"], split["labels"]
    docs = []
    for start in range(0, len(src) - pairs + 1, pairs):
        ids = [t for i in range(start, start + pairs) for t in src[i] + tgt[i]]
        docs.append({"input_ids": ids})
        if len(docs) == limit:
            break
    return Dataset.from_list(docs)


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
    with args.main_process_first(desc="preparing the data"):
        tokenizer, splits = translation_data.prepare(
            recipe.data_cache_dir, vocab_size=8000, seed=0, max_source_length=80, max_target_length=80
        )
    translation_data.check_same_tokenizer(tokenizer, args.device)  # a cache per node may differ
    held_out = len(splits["train"]) - EVAL_PAIRS  # training never reaches the evaluation pairs, however many documents
    train = documents(splits["train"].select(range(held_out)), recipe.pairs_per_document, recipe.max_documents)
    evaluation = documents(
        splits["train"].select(range(held_out, len(splits["train"]))), recipe.pairs_per_document, recipe.eval_documents
    )
    lengths = [len(d) for d in train["input_ids"]]
    logger.info(
        "data: %d documents of %d pairs (%.0f tokens on average), packed into rows of %d tokens",
        len(train),
        recipe.pairs_per_document,
        sum(lengths) / len(lengths),
        args.max_length,
    )

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=4 * recipe.hidden_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=max(args.max_length, 2048),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    logger.info(
        "model: Llama %d layers, hidden %d, %d/%d heads, %.1fM parameters; sp_size=%d (%s)",
        recipe.num_layers,
        recipe.hidden_size,
        recipe.num_heads,
        recipe.num_kv_heads,
        sum(p.numel() for p in model.parameters()) / 1e6,
        args.sp_size,
        args.sp_mode,
    )

    trainer = SequenceParallelSFTTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        callbacks=[TimeBudgetCallback(recipe.max_train_minutes)],
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(args.output_dir)

    # every rank generates (under SP with sp_size > 1: the group's ranks share each prompt's KV cache); rank 0 prints
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    test = splits["test"]
    continuations = []
    for i in range(3):
        prompt = torch.tensor([test["input_ids"][i]], device=model.device)
        out = model.generate(input_ids=prompt, max_new_tokens=30, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        continuations.append(translation_data.decode_french(tokenizer, [out[0, prompt.shape[1] :].tolist()])[0])
    if trainer.is_world_process_zero():
        print("\nContinuations (English </s> -> the model's French):")
        for i, french in enumerate(continuations):
            print(f"  EN:  {test['en'][i]}\n  OUT: {french}\n")
        print(
            f"eval_loss {metrics['eval_loss']:.3f}; eval token accuracy {metrics['eval_mean_token_accuracy']:.3f}; "
            f"total time {(time.time() - started) / 60:.1f} min; saved model: {os.path.abspath(args.output_dir)}"
        )
    return metrics


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # join gloo's threads before exit: without it a rank can abort there
        torch.distributed.destroy_process_group()  # ("terminate called without an active exception")
