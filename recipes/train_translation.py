"""Train an English->French Marian-style translation model on Tatoeba, with sequence parallelism.

Launch (from the repository root):

    # 1 process, the defaults (packed rows, bf16 where the CPU has it, the learning rate decayed over a
    # 26-minute budget): 26.9 minutes on a 2-core CPU with AVX512-BF16, test BLEU 54.48 (beam 4); fp32 on a
    # 2-core CPU with AVX2 only: about 29 minutes, test BLEU about 46 (its step count emulated, recipes/README.md)
    accelerate launch recipes/train_translation.py --output_dir runs/default

    # 2 CPU processes, one SP group of 2 (each rank holds half of every sequence): 23.3 minutes, test BLEU 48.80
    # (the 22-minute budget and dropout 0.1 of 2026-12-01)
    accelerate launch --config_file recipes/accelerate_cpu_2proc.yaml recipes/train_translation.py --sp_size 2 \
        --output_dir runs/sp2

    # document-level translation: 32 consecutive pairs joined into one long document (attention across
    # them, numbered sentence markers), after a sentence-level warm start and a ramp of growing pieces of the
    # documents (--document_ramp auto); test document BLEU 52.95 in 43.4 minutes from a fresh clone (the
    # sentence model's translations joined per document: 57.70)
    accelerate launch --config_file recipes/accelerate_cpu_2proc.yaml recipes/train_translation.py \
        --sp_size 2 --document_sentences 32 --max_train_minutes 41 --output_dir runs/documents

    # BLEU against training minutes of finished runs (each writes <output_dir>/run_summary.json)
    python recipes/plot_bleu.py runs/default runs/sp2 runs/documents --out translation_bleu.png

    # 8 GPUs: SP groups of 4 (Ulysses) x 2 data-parallel replicas, bf16, rows of 4096 tokens
    accelerate launch --config_file recipes/accelerate_8gpu.yaml recipes/train_translation.py \
        --sp_size 4 --sp_mode ulysses --pack_tokens 4096 --per_device_train_batch_size 1024 --bf16

`python recipes/train_translation.py --help` lists every flag, by section: the sequence-parallel ones
(`--sp_size`, `--sp_mode`, `--sp_ring_size`, `--tp_size`, ...) first, then the recipe's own (model size,
data), then the rest of `SequenceParallelArguments` (transformers' `Seq2SeqTrainingArguments`). The trained
model and tokenizer are saved in `--output_dir` as a plain transformers checkpoint
(`MarianMTModel.from_pretrained(output_dir)`, or `T5ForConditionalGeneration` with `--model_type t5`, needs no
seqpar_hf).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DataCollatorForSeq2Seq, set_seed

import seqpar_hf
from seqpar_hf.training.packing import Seq2SeqPackingCollator

if __package__:  # imported as recipes.train_translation (tests, benchmarks)
    from . import recipe_checks, translation_data
    from .document_sentences import documents_as_sentences
    from .sentence_positions import SentencePositions
    from .translation_training import (
        BudgetTrainer,
        DocumentRamp,
        RealTokens,
        TokenCounter,
        bleu_metric,
        build_model,
        choose_precision,
        describe_machine,
        generation_kwargs_fn,
        make_compute_metrics,
        sentence_warm_start,
        start_from,
        use_the_cores,
    )
else:  # launched as a script: its folder is on sys.path
    import recipe_checks
    import translation_data
    from document_sentences import documents_as_sentences
    from sentence_positions import SentencePositions
    from translation_training import (
        BudgetTrainer,
        DocumentRamp,
        RealTokens,
        TokenCounter,
        bleu_metric,
        build_model,
        choose_precision,
        describe_machine,
        generation_kwargs_fn,
        make_compute_metrics,
        sentence_warm_start,
        start_from,
        use_the_cores,
    )

ROOT = Path(__file__).resolve().parent.parent
SENTENCE_ROW_TOKENS = 128  # packed rows of the documents' sentences (--document_training sentences), the main command's
logger = logging.getLogger("train_translation")


@dataclass
class ModelArguments:
    model_type: str = field(
        default="marian",
        metadata={
            "help": "marian (sinusoidal positions, the default) or t5 (a relative position bias by query-key "
            "distance; its encoder and decoder stacks run by the model itself). Same sizes from the flags below. "
            "t5 is not tuned: at the recipe's Marian settings (bf16, peak learning rate 1e-3) it diverges, test "
            "BLEU 5.2 in the budget (recipes/README.md)",
            "choices": ["marian", "t5"],
        },
    )
    d_model: int = field(default=256, metadata={"help": "Hidden size."})
    encoder_layers: int = field(default=3, metadata={"help": "Encoder layers."})
    decoder_layers: int = field(default=3, metadata={"help": "Decoder layers."})
    attention_heads: int = field(default=4, metadata={"help": "Attention heads (encoder and decoder)."})
    ffn_dim: int = field(default=1024, metadata={"help": "Feed-forward size."})
    dropout: float = field(
        default=0.0,
        metadata={"help": "Dropout on hidden states (0: the time budget underfits; 0.1 measured 1.2 test BLEU lower)."},
    )
    attention_dropout: float = field(default=0.0, metadata={"help": "Dropout on attention weights (0 for ring modes)."})


@dataclass
class DataArguments:
    vocab_size: int = field(default=8000, metadata={"help": "Shared English+French BPE vocabulary."})
    lowercase: bool = field(
        default=False,
        metadata={
            "help": "Lowercase every sentence before NLTK tokenization, as the seed tutorial did (BLEU is then "
            "scored against lowercased references, so it is not comparable with cased BLEU)."
        },
    )
    pack_tokens: int = field(
        default=-1,
        metadata={
            "help": "Train on packed rows: the sentence pairs of each batch are packed into rows of up to N tokens "
            "per side, each pair attending only to itself, with restarting positions: the same training as "
            "padded batches without the padding. Evaluation stays one sentence per row. 0: padded batches; "
            "-1 (default): 128 for sentence pairs, padded batches for documents."
        },
    )
    document_sentences: int = field(
        default=1,
        metadata={
            "help": "Document-level translation: join N consecutive pairs into one source/target document (one long "
            "sequence, split by SP; in one process each sentence attends within itself, see "
            "--sentence_local_layers). The default training batch (of whole documents) and --max_eval_samples "
            "are divided by N (same sentences per step), the evaluation batch by N / 4 (fewer decoding "
            "steps)."
        },
    )
    mixed_documents: bool = field(
        default=False,
        metadata={
            "help": "With --document_sentences N: training documents of 1 to N pairs (a seeded draw per document) "
            "instead of N; held-out documents keep N. Test document BLEU 48.47 against 54.64 without, in one "
            "process (recipes/README.md)."
        },
    )
    sentence_markers: bool = field(
        default=True,
        metadata={
            "help": "With --document_sentences N: a numbered marker <s1> .. <sN> before each sentence of a document on "
            "both sides (the warm-start sentences start with a random one), so the decoder writing sentence k "
            "finds source sentence k by an exact token match instead of counting boundaries over hundreds of "
            "tokens; generation writes the markers in order, one per source sentence. Dropped from the output "
            "text. Test document BLEU 31.52-34.82 with them, 24.53-25.90 without, under the defaults before 2026-12-04 "
            "(52.95 with them under the present ones; recipes/README.md)."
        },
    )
    sentence_positions: str = field(
        default="auto",
        metadata={
            "help": "With --document_sentences N and the markers: the tokens of sentence k of a document at k x 80 + "
            "their offset in the sentence, on both sides, instead of their index in the document, so a target "
            "sentence sits at its source sentence's positions as in a sentence pair (recipes/sentence_positions.py; "
            "from the documents on, after the sentence warm start). auto (the default): on for documents with "
            "markers in one process (where it was measured: test document BLEU 55.23 against 53.15 without); true: "
            "under SP too (the same loss, gradients and tokens as one process, tested); not with --tp_size > 1."
        },
    )
    sentence_position_stride: str = field(
        default="auto",
        metadata={
            "help": "With the sentence positions: sentence k of a document at k x this + its offset. auto (the "
            "default): 0 where every layer is local (the default in one process): every sentence from position 0, "
            "as a sentence pair of the warm start, so each sentence reads as in the sentence model (test document "
            "BLEU 49.11 against 45.39 for 2 local layers at k x 80, side by side on one core each); else the "
            "position table divided by the document's sentences (80 for 32)."
        },
    )
    sentence_local_layers: str = field(
        default="auto",
        metadata={
            "help": "With the sentence positions: the lower N layers of each stack attend within each sentence of a "
            "document (its encoder's, its decoder's and the cross-attention from target sentence k to source "
            "sentence k, as G-Transformer's group attention), the layers above over the whole document, so the "
            "lower layers see each sentence as the sentence warm start trained them. auto (the default): every "
            "layer where the sentence positions are on in one process, so no layer sees the other sentences (the "
            "sentence model reading a document in one row: Tatoeba's 32 consecutive pairs are unrelated, and the "
            "top layer's view of them measured no gain), else 0; 0: every layer over the whole document. One "
            "process only (their masks are over whole sequences)."
        },
    )
    document_training: str = field(
        default="auto",
        metadata={
            "help": "How the documents train. sentences: each sentence of every training document an example of its "
            "own in the document's form (its marker and positions, its decoder inputs from the document, the next "
            "marker or </s> to predict), sampled across documents and packed into rows of 128 tokens: where every "
            "layer is within its sentence the same loss and gradients as whole documents (tested), without the "
            "attention over whole rows, and no warm start or ramp needed (recipes/document_sentences.py); whole: "
            "whole documents (after the warm start, through --document_ramp); auto (the default): sentences where "
            "every layer is local (one process) and no --document_ramp is given, else whole.",
            "choices": ["auto", "whole", "sentences"],
        },
    )
    sentence_separator: bool = field(
        default=False,
        metadata={
            "help": "With --document_sentences N: one <sep> token between a document's sentences on both sides instead "
            "of the numbered markers (needs --sentence_markers false); not better than nothing in the one run "
            "measured (recipes/README.md)."
        },
    )
    sentence_warmup_minutes: float = field(
        default=-1.0,
        metadata={
            "help": "With --document_sentences N: train on the single sentence pairs (packed rows) for the first M "
            "minutes of --max_train_minutes, then on documents: the model learns to align sentences before "
            "it learns long documents (a sentence-level warm start within the run); -1: a fifth of the "
            "budget for whole documents, none where they train as their sentences (--document_training); 0: "
            "documents from the start."
        },
    )
    document_ramp: str = field(
        default="auto",
        metadata={
            "help": "With --document_sentences N and the markers: token limits of the documents' pieces for the "
            "first part of their budget, e.g. 48,96,192: the documents are first cut into pieces of consecutive "
            "sentences of at most 48 tokens a side (each its own row, markers renumbered from <s1>; data "
            "parallel across the SP group, the rows being short), then 96, then 192, each for an equal share "
            "of --document_ramp_fraction of the documents' budget, then whole (split by SP); auto: 48,96,192 "
            "with the markers where the documents train whole (test document BLEU 52.95 and 53.12 against 50.84 "
            "without; recipes/README.md), none where they train as their sentences (--document_training); none: "
            "whole documents throughout."
        },
    )
    document_ramp_fraction: float = field(
        default=0.6, metadata={"help": "The part of the documents' budget --document_ramp takes."}
    )
    document_ramp_mix: bool = field(
        default=False,
        metadata={
            "help": "Instead of growing limits one after the other, each batch of the ramp's part of the budget is "
            "cut at a limit drawn from --document_ramp's and the whole document alike (pieces of every length all "
            "along), then whole documents."
        },
    )
    max_source_length: int = field(
        default=0,
        metadata={
            "help": "Truncate sources to this many tokens (0: 80 x document_sentences, which truncates nothing)."
        },
    )
    max_target_length: int = field(default=0, metadata={"help": "Same for targets."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training examples."})
    max_eval_samples: int | None = field(
        default=400, metadata={"help": "Validation examples for the periodic evaluation (BLEU by greedy decoding)."}
    )
    max_test_samples: int | None = field(default=None, metadata={"help": "Test examples (default: all)."})
    num_threads: int = field(
        default=0,
        metadata={"help": "Torch threads per process on CPU; 0: the usable cores divided by the local processes."},
    )
    init_from: str = field(
        default="",
        metadata={
            "help": "Start from a model this recipe saved (its --output_dir), e.g. the main command's sentence model "
            "before --document_sentences: its weights, the documents' marker rows added; the model flags must be "
            "the ones it was trained with. With documents there is then no sentence warm start unless "
            "--sentence_warmup_minutes is given."
        },
    )
    max_pairs: int | None = field(
        default=None,
        metadata={"help": "Read only the first N pairs of the data file (its shortest sentences; for quick tests)."},
    )
    test_num_beams: int = field(
        default=4,
        metadata={
            "help": "Beam size for the final test translation; documents: 8 unless given (+0.07 to +0.49 test "
            "document BLEU on three document models; the sentence model gains nothing from 8, recipes/README.md)."
        },
    )
    max_length_a: float = field(
        default=1.5,
        metadata={
            "help": "Each generated translation stops after a x source tokens + b (as translation toolkits bound it); "
            "0 disables the per-sentence bound."
        },
    )
    max_length_b: int = field(default=10, metadata={"help": "See --max_length_a."})
    no_repeat_ngram_size: int = field(
        default=3,
        metadata={
            "help": "Generation never repeats an n-gram of this size (guards beam search against 'propres propres "
            "propres ...'); 0 disables it."
        },
    )
    max_train_minutes: float = field(
        default=26.0,
        metadata={
            "help": "Stop training after this many minutes (evaluation, test and saving follow); 0: no limit. 26: "
            "the whole run within 30 minutes on a 2-core CPU without AVX512 (about 3 minutes beyond training "
            "from a fresh clone); a CPU with AVX512-BF16 ends its epochs first."
        },
    )
    eval_every_minutes: float = field(
        default=5.0,
        metadata={
            "help": "Evaluate (BLEU of greedy translations of the validation sample) each time this many more minutes "
            "of training were spent, and at the end; 0: only by --eval_strategy."
        },
    )
    lr_decay: str = field(
        default="budget",
        metadata={
            "help": "budget: linear warmup, then linear decay to 0 exactly when --max_train_minutes is spent (a run "
            "stopped by its budget ends annealed); steps: --lr_scheduler_type over the step count.",
            "choices": ["budget", "steps"],
        },
    )
    precision: str = field(
        default="auto",
        metadata={
            "help": "bf16: mixed precision (bf16 matmuls, fp32 weights and loss); fp32; auto: bf16 where the hardware "
            "computes it fast (CUDA with bf16, a CPU with AVX512-BF16 or AMX), else fp32.",
            "choices": ["auto", "bf16", "fp32"],
        },
    )
    num_examples_to_print: int = field(default=5, metadata={"help": "Test translations printed at the end."})
    data_cache_dir: str = field(default=str(ROOT / "cache"), metadata={"help": "Where preprocessed data is cached."})


@dataclass
class RecipeTrainingArguments(seqpar_hf.SequenceParallelArguments):
    """The recipe's defaults for the training arguments (each one fits the 2-core CPU budget; override any)."""

    output_dir: str = field(default=str(ROOT / "runs" / "translation"), metadata={"help": "Where the model is saved."})
    overwrite_output_dir: bool = True
    per_device_train_batch_size: int = 96  # sentences; ~1k target tokens per step
    per_device_eval_batch_size: int = 128
    learning_rate: float = 1.5e-3  # small model; decayed to 0 over the time budget (--lr_decay budget)
    lr_scheduler_type: str = "inverse_sqrt"  # with --lr_decay steps
    warmup_steps: float = 300
    weight_decay: float = 0.0
    # fairseq's for Transformer NMT: +1.2 test BLEU on the main command (52.80 against 51.60, the same 5,067 steps)
    # and +0.9 on the AVX2 step budget (recipes/README.md)
    adam_beta2: float = 0.98
    max_grad_norm: float = 1.0
    label_smoothing_factor: float = 0.1
    # an upper bound: --max_train_minutes ends training first on 2 cores, a CPU with AVX512-BF16 included (4.7
    # epochs there: test BLEU 54.48 against 53.61 when 3 epochs ended it, recipes/README.md)
    num_train_epochs: float = 6.0
    train_sampling_strategy: str = "group_by_length"  # ~2x fewer padding tokens than random batches
    logging_steps: float = 50
    eval_strategy: str = "no"  # by time instead: --eval_every_minutes
    save_strategy: str = "no"  # the final model is saved at the end
    predict_with_generate: bool = True
    generation_num_beams: int = 1  # greedy for the periodic evaluation; --test_num_beams for the test set
    report_to: None | str | list[str] = "none"
    dataloader_num_workers: int = 0
    seed: int = 0
    # every parameter takes part in every step: DDP need not search the graph for unused ones (transformers'
    # default, True, costs a graph traversal per step and makes DDP warn about it)
    ddp_find_unused_parameters: bool | None = False


DEFAULT_BATCH = {
    name: RecipeTrainingArguments.__dataclass_fields__[name].default
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size")
}


def parse_args(argv=None):
    """The three argument groups, checked (argparse's error, exit code 2, on every rank alike)."""
    model_args, data_args, training_args = recipe_checks.parse_checked(
        (ModelArguments, DataArguments, RecipeTrainingArguments), check_args, argv
    )
    data_args.pack_tokens = packed_row_tokens(data_args)
    return model_args, data_args, training_args


def packed_row_tokens(data_args) -> int:
    """--pack_tokens, -1 (auto) resolved: packed rows of 128 for sentence pairs (faster, and a better model
    here), padded batches for documents."""
    if data_args.pack_tokens != -1:
        return data_args.pack_tokens
    return 128 if data_args.document_sentences == 1 else 0


def check_args(model_args: ModelArguments, data_args: DataArguments, training_args: RecipeTrainingArguments) -> None:
    """The recipe's flags (and the training flags it relies on), before any data or process-group work:
    ValueError "--flag value: what is allowed". Reads only the arguments (and tries --output_dir)."""
    m, d, check = model_args, data_args, recipe_checks
    for flag, meaning in (
        ("d_model", "hidden size"),
        ("encoder_layers", "encoder layers"),
        ("decoder_layers", "decoder layers"),
        ("attention_heads", "attention heads"),
        ("ffn_dim", "feed-forward size"),
    ):
        check.at_least(flag, getattr(m, flag), 1, meaning)
    if m.d_model % m.attention_heads:
        raise ValueError(
            f"--d_model {m.d_model}: must be a multiple of --attention_heads {m.attention_heads} "
            "(each head gets d_model / attention_heads channels)"
        )
    check.fraction("dropout", m.dropout, "the probability of zeroing a hidden state")
    check.fraction("attention_dropout", m.attention_dropout, "the probability of zeroing an attention weight")
    specials = len(translation_data.SPECIAL_TOKENS)
    check.at_least(
        "vocab_size",
        d.vocab_size,
        specials + 1,
        f"the shared BPE vocabulary: {specials} special tokens and at least one more",
    )
    check.at_least("document_sentences", d.document_sentences, 1, "sentence pairs per document; 1: one per row")
    for flag in ("max_source_length", "max_target_length"):
        value = getattr(d, flag)
        if value != 0:  # 0: 80 x document_sentences
            check.at_least(flag, value, 2, "tokens, </s> included; 0: 80 x --document_sentences")
    if d.pack_tokens != -1:
        check.at_least("pack_tokens", d.pack_tokens, 0, "tokens per packed row; 0: padded batches; -1: auto")
    check.at_least("eval_every_minutes", d.eval_every_minutes, 0, "minutes between evaluations; 0: none by time")
    if d.sentence_separator and d.sentence_markers:
        raise ValueError(
            "--sentence_separator and --sentence_markers (on by default) both mark the sentences of "
            "a document: choose one (--sentence_markers false for <sep>)"
        )
    check_sentence_positions(d, training_args)
    stride = d.sentence_position_stride
    if stride != "auto" and not (stride.isdigit() and uses_sentence_positions(d, training_args)):
        raise ValueError(
            f"--sentence_position_stride {stride}: auto or a number of positions from 0, with the sentence positions "
            f"on (here --sentence_positions {d.sentence_positions})"
        )
    if stride.isdigit():  # here, not when the hooks install after the warm start: build_model's table
        docs, table = d.document_sentences, max(max_lengths(d)) + 2  # build_model's
        if int(stride) * docs > table:
            raise ValueError(
                f"--sentence_position_stride {stride}: {docs} sentences x {stride} = {int(stride) * docs} positions, "
                f"more than the model's position table of {table} (the longer of --max_source_length / "
                f"--max_target_length, + 2): at most {table // docs}, or auto"
            )
    local = d.sentence_local_layers
    if local != "auto" and not (local.isdigit() and 0 <= int(local) <= shallower_stack(m)):
        raise ValueError(
            f"--sentence_local_layers {local}: auto, or from 0 to {shallower_stack(m)} (the "
            "layers of the shallower stack; the layers above those attend over the whole document)"
        )
    if local not in ("auto", "0") and (not uses_sentence_positions(d, training_args) or training_args.sp_size > 1):
        raise ValueError(
            f"--sentence_local_layers {local}: with the sentence positions in one process (here "
            f"--sentence_positions {d.sentence_positions}, --sp_size {training_args.sp_size}): its masks are over "
            "whole sequences, which SP shards"
        )
    check_document_training(m, d, training_args)
    pack = packed_row_tokens(d)
    if pack and d.document_sentences > 1:
        raise ValueError(
            f"--pack_tokens {pack} packs sentence pairs into rows; --document_sentences "
            f"{d.document_sentences} joins them into documents: choose one"
        )
    longest = max(d.max_source_length or 80 * d.document_sentences, d.max_target_length or 80 * d.document_sentences)
    if pack and pack < longest:
        raise ValueError(
            f"--pack_tokens {pack}: shorter than the longest pair ({longest} tokens: "
            "--max_source_length / --max_target_length); raise it (e.g. --pack_tokens 128) or truncate "
            "the pairs"
        )
    check.optional_positive("max_train_samples", d.max_train_samples, "training examples; leave it out for all")
    check.optional_positive(
        "max_eval_samples",
        d.max_eval_samples,
        "validation examples evaluated periodically; more than the split holds takes all of it",
    )
    check.optional_positive("max_test_samples", d.max_test_samples, "test examples; leave it out for all")
    check.optional_positive("max_pairs", d.max_pairs, "pairs read from the data file; leave it out for all")
    check.at_least(
        "num_threads", d.num_threads, 0, "torch threads per process; 0: the usable cores divided by the local processes"
    )
    check.at_least("test_num_beams", d.test_num_beams, 1, "beams of the final test translation; 1: greedy")
    check.at_least(
        "max_length_a", d.max_length_a, 0, "a translation stops after a x source tokens + b; 0: no per-sentence bound"
    )
    check.at_least("max_length_b", d.max_length_b, 0, "tokens added to a x source tokens")
    check.at_least("no_repeat_ngram_size", d.no_repeat_ngram_size, 0, "n-grams never repeated; 0: off")
    check.at_least("max_train_minutes", d.max_train_minutes, 0, "minutes of training; 0: no limit")
    warm = d.sentence_warmup_minutes
    if warm != -1:
        check.at_least(
            "sentence_warmup_minutes",
            warm,
            0,
            "minutes on single sentences before the documents; -1: a fifth of --max_train_minutes; 0: none",
        )
    if warm > 0 and d.max_train_minutes and warm >= d.max_train_minutes:
        raise ValueError(
            f"--sentence_warmup_minutes {warm}: must be shorter than --max_train_minutes "
            f"{d.max_train_minutes} (the documents train in the rest)"
        )
    if d.document_ramp not in ("auto", "none", ""):
        try:
            sizes = [int(n) for n in d.document_ramp.split(",")]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 16 or sizes != sorted(sizes) or d.document_sentences == 1:
            raise ValueError(
                f"--document_ramp {d.document_ramp}: growing token limits per piece, comma-separated, each at "
                "least 16, e.g. 48,96,192 (with --document_sentences N > 1)"
            )
        if not d.sentence_markers:
            raise ValueError(
                f"--document_ramp {d.document_ramp}: needs the sentence markers (--sentence_markers true): the "
                "pieces are cut and renumbered at them"
            )
    check.fraction("document_ramp_fraction", d.document_ramp_fraction, "the part of the documents' budget cut")
    if d.document_ramp_mix and not ramp_steps(d):
        raise ValueError(
            "--document_ramp_mix true: mixes the ramp's pieces, and there is no ramp (it needs --document_sentences "
            "N > 1, the sentence markers and a --document_ramp other than none)"
        )
    check.at_least("num_examples_to_print", d.num_examples_to_print, 0, "test translations printed")
    for flag in ("per_device_train_batch_size", "per_device_eval_batch_size"):
        check.at_least(flag, getattr(training_args, flag), 1, "examples per rank and step")
    if d.init_from and not Path(d.init_from, "config.json").is_file():
        raise ValueError(
            f"--init_from {d.init_from}: no saved model there (no config.json); give the --output_dir of a finished "
            "run of this recipe"
        )
    check.folder("data_cache_dir", d.data_cache_dir, writable=False)  # a prepared cache may be read-only
    check.folder("output_dir", training_args.output_dir, writable=True)


def check_sentence_positions(d, training_args) -> None:
    """--sentence_positions: auto, true or false; true needs documents with markers in one process."""
    if d.sentence_positions not in ("auto", "true", "false"):
        raise ValueError(
            f"--sentence_positions {d.sentence_positions}: auto, true or false (sentences of a document placed by "
            "their markers; auto: with documents and markers in one process)"
        )
    if d.sentence_positions == "true" and (d.document_sentences == 1 or not d.sentence_markers):
        raise ValueError(
            "--sentence_positions true: places the sentences of a document by their markers; it needs "
            "--document_sentences N > 1 and --sentence_markers true"
        )
    if d.sentence_positions == "true" and training_args.tp_size > 1:
        raise ValueError(
            f"--sentence_positions true: not with tensor parallelism (--tp_size {training_args.tp_size}): its "
            "positions are put in by hooks that the TP layout does not run; --sentence_positions auto (off with TP)"
        )


def check_document_training(model_args, d, training_args) -> None:
    """--document_training sentences: every layer local (each sentence's terms its own), no pieces to cut."""
    if d.document_training != "sentences":
        return
    if sentence_local_layers(model_args, d, training_args) != shallower_stack(model_args):
        raise ValueError(
            "--document_training sentences: trains each sentence of a document alone, which gives the documents' "
            "loss only where no layer sees another sentence: it needs the sentence positions in one process with "
            f"every layer local (here --document_sentences {d.document_sentences}, --sentence_positions "
            f"{d.sentence_positions}, --sentence_local_layers {d.sentence_local_layers}, --sp_size "
            f"{training_args.sp_size}); or --document_training whole"
        )
    if asks_for_pieces(d):
        raise ValueError(
            f"--document_ramp {d.document_ramp}{' --document_ramp_mix true' if d.document_ramp_mix else ''}: cuts "
            "whole documents into pieces; --document_training sentences trains their sentences, none whole: leave "
            "it out, or --document_training whole"
        )


def asks_for_pieces(d) -> bool:
    """--document_ramp given as token limits, or --document_ramp_mix: pieces of whole documents asked for."""
    return d.document_ramp not in ("auto", "none", "") or d.document_ramp_mix


def trains_sentences(model_args, data_args, training_args) -> bool:
    """--document_training resolved (checked flags): auto is sentences where every layer is local."""
    if data_args.document_sentences == 1 or data_args.document_training == "whole":
        return False
    if data_args.document_training == "sentences":
        return True
    if asks_for_pieces(data_args):
        return False  # they are cut from whole documents
    return sentence_local_layers(model_args, data_args, training_args) == shallower_stack(model_args)


def uses_sentence_positions(data_args, training_args) -> bool:
    """--sentence_positions resolved: auto is on for documents with markers in one process (checked flags)."""
    if data_args.sentence_positions != "auto":
        return data_args.sentence_positions == "true"
    documents = data_args.document_sentences > 1 and data_args.sentence_markers
    return documents and training_args.sp_size == 1 and training_args.tp_size == 1  # measured in one process


def shallower_stack(model_args) -> int:
    """The layers a document's sentences can be local in: those of the shallower stack."""
    return min(model_args.encoder_layers, model_args.decoder_layers)


def max_lengths(data_args) -> tuple[int, int]:
    """(source, target) tokens per example, 0 resolved: 80 per sentence of a document."""
    docs = data_args.document_sentences
    return data_args.max_source_length or 80 * docs, data_args.max_target_length or 80 * docs


def sentence_local_layers(model_args, data_args, training_args) -> int:
    """--sentence_local_layers resolved (checked flags): auto is every layer where the sentence positions are on in
    one process, else 0."""
    if data_args.sentence_local_layers != "auto":
        return int(data_args.sentence_local_layers)
    if not uses_sentence_positions(data_args, training_args) or training_args.sp_size > 1:
        return 0
    return shallower_stack(model_args)


def sentence_position_stride(model_args, data_args, training_args, table: int) -> int:
    """--sentence_position_stride resolved (checked flags): auto is 0 where every layer is within its sentence (each
    sentence then reads as a sentence pair of the warm start), else the position table (`table` rows, 2 of them
    Marian's offset) over the document's sentences."""
    if data_args.sentence_position_stride != "auto":
        return int(data_args.sentence_position_stride)
    if sentence_local_layers(model_args, data_args, training_args) == shallower_stack(model_args):
        return 0
    return (table - 2) // data_args.document_sentences


def warmup_minutes(data_args, sentences: bool = False) -> float:
    """Minutes of the sentence-level warm start (documents only; `sentences`: they train as their sentences)."""
    if data_args.document_sentences == 1 or data_args.sentence_warmup_minutes == 0:
        return 0.0
    if (data_args.init_from or sentences) and data_args.sentence_warmup_minutes < 0:
        return 0.0  # the model it starts from translates sentences already; the documents are trained as sentences
    if data_args.sentence_warmup_minutes < 0:
        # 8.2 of 41 minutes: 8 measured best (54.64 against 53.95 / 52.70 with 2 / 4, 50.24 with 14; recipes/README.md)
        return round(data_args.max_train_minutes / 5, 2) if data_args.max_train_minutes > 0 else 0.0
    return data_args.sentence_warmup_minutes


AUTO_RAMP = "48,96,192"  # --document_ramp auto with the markers


def ramp_steps(data_args) -> list[tuple[float, int]]:
    """--document_ramp "48,96,192" -> [(0.2, 48), (0.4, 96), (0.6, 192)] with the default fraction 0.6."""
    ramp = data_args.document_ramp
    if ramp == "auto":
        ramp = AUTO_RAMP if data_args.sentence_markers else ""
    if data_args.document_sentences == 1 or ramp in ("none", ""):
        return []
    sizes = [int(n) for n in ramp.split(",")]
    share = data_args.document_ramp_fraction / len(sizes)
    return [(share * (i + 1), n) for i, n in enumerate(sizes)]


def check_splits(splits, data_args: DataArguments, evaluating: bool) -> None:
    """After preparing: no empty split (held-out sentences are 1% and 2% of the distinct English sources, so a
    small --max_pairs can leave none); the same data on every rank, so the same error."""
    sizes = {name: len(splits[name]) for name in ("train", "validation", "test")}
    empty = [name for name, n in sizes.items() if n == 0 and (name != "validation" or evaluating)]
    if empty:
        raise ValueError(
            f"--max_pairs {data_args.max_pairs}: the {' and '.join(empty)} split"
            f"{'s are' if len(empty) > 1 else ' is'} empty ({sizes['train']} train / {sizes['validation']}"
            f" validation / {sizes['test']} test examples); read more pairs: validation and test take 1% "
            "and 2% of the distinct English sentences, rounded"
        )


DOCUMENT_TEST_BEAMS = 8  # the test's beams for documents (document_defaults)


def document_defaults(data_args, training_args, argv: list[str], sentences: bool = False) -> None:
    """With --document_sentences N > 1, the defaults the documents need, each unless its flag is in `argv`
    (`sentences`: the documents train as their sentences, one per example)."""
    docs = data_args.document_sentences
    if docs == 1:
        return
    # keep ~the same number of sentences per step and per evaluation as one sentence per row
    per_train_document = (docs + 1) / 2 if data_args.mixed_documents else docs  # sentences, on average
    if sentences:
        per_train_document = 1
    for name, default in DEFAULT_BATCH.items():
        if getattr(training_args, name) == default:
            # generation: 4x the sentences per batch, so 4x fewer sequential decoding steps (each a round of
            # SP collectives): the test documents decode in 136 s instead of 206 s on 2 cores
            per_document = per_train_document if "train" in name else max(1.0, docs / 4)
            setattr(training_args, name, max(1, round(default / per_document)))
    if data_args.max_eval_samples == DataArguments.max_eval_samples:
        data_args.max_eval_samples = max(8, DataArguments.max_eval_samples // docs)
    if training_args.sp_generate == "auto" and "--sp_generate" not in argv:
        training_args.sp_generate = "always"  # long documents: their encoder states stay sharded
    if "--no_repeat_ngram_size" not in argv:
        data_args.no_repeat_ngram_size = 0  # a document repeats 3-grams across its sentences ("Je ne ...")
    if "--test_num_beams" not in argv:
        # one beam search over a whole document: 8 beams gave +0.07 to +0.49 test document BLEU on three document
        # models, where the sentence model's joined translations lose 0.19 (57.68 against 57.87)
        data_args.test_num_beams = DOCUMENT_TEST_BEAMS


def main(argv=None):
    model_args, data_args, training_args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not training_args.should_log:
        logger.setLevel(logging.WARNING)
    transformers.utils.logging.set_verbosity_warning()
    set_seed(training_args.seed)
    started = time.time()
    if not training_args.use_cpu and torch.cuda.is_available():
        threads = "CUDA"
    else:
        threads = use_the_cores(data_args.num_threads)
    machine = describe_machine(training_args)
    logger.info("machine: %s; compute: %s", machine, threads)
    choose_precision(data_args.precision, training_args)

    docs = data_args.document_sentences
    sentences = trains_sentences(model_args, data_args, training_args)
    document_defaults(data_args, training_args, argv or sys.argv, sentences)
    max_source, max_target = max_lengths(data_args)
    if (
        (data_args.pack_tokens or sentences)
        and training_args.train_sampling_strategy == "group_by_length"
        and "--train_sampling_strategy" not in (argv or sys.argv)
    ):
        training_args.train_sampling_strategy = "random"  # packed rows carry no padding: no need to sort by length
    with training_args.main_process_first(desc="preparing the data"):  # rank 0 builds the cache, others read it
        tokenizer, splits = translation_data.prepare(
            data_args.data_cache_dir,
            vocab_size=data_args.vocab_size,
            seed=training_args.seed,
            document_sentences=docs,
            max_source_length=max_source,
            max_target_length=max_target,
            max_pairs=data_args.max_pairs,
            lowercase=data_args.lowercase,
            mixed_documents=data_args.mixed_documents,
            sentence_separator=data_args.sentence_separator,
            sentence_markers=data_args.sentence_markers,
        )
    translation_data.check_same_tokenizer(tokenizer, training_args.device)  # a cache per node may differ
    check_splits(splits, data_args, evaluating=training_args.eval_strategy != "no" or data_args.eval_every_minutes > 0)
    train, validation, test = splits["train"], splits["validation"], splits["test"]
    if data_args.max_train_samples:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    if data_args.max_eval_samples:
        validation = validation.select(range(min(data_args.max_eval_samples, len(validation))))
    if data_args.max_test_samples:
        test = test.select(range(min(data_args.max_test_samples, len(test))))
    logger.info(
        "data: %d train / %d validation / %d test examples (%d sentence pair%s each%s); prepared in %.0f s",
        len(train),
        len(validation),
        len(test),
        docs,
        "s" if docs > 1 else "",
        ", lowercased" if data_args.lowercase else "",
        time.time() - started,
    )

    model = build_model(model_args, tokenizer, max(max_source, max_target))
    if data_args.init_from:
        start_from(model, data_args.init_from, tokenizer)
    # saved with the model, so plain generate() after from_pretrained guards against repetition too
    model.generation_config.no_repeat_ngram_size = data_args.no_repeat_ngram_size or None
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "model: %s d=%d, %d+%d layers, %d heads, %.1fM parameters; %s",
        type(model).__name__,
        model_args.d_model,
        model_args.encoder_layers,
        model_args.decoder_layers,
        model_args.attention_heads,
        n_params / 1e6,
        f"sp_size={training_args.sp_size} ({training_args.sp_mode})",
    )
    training_args.generation_max_length = max_target
    metric = bleu_metric()
    columns = ["input_ids", "attention_mask", "labels"]
    columns_train = columns
    # the sentence markers' ids, <s1> .. <sN> (documents with markers; what the ramp, the positions and the
    # sentences' examples find sentences by)
    markers = [tokenizer.convert_tokens_to_ids(translation_data.marker(k)) for k in range(1, docs + 1)]
    markers = markers if docs > 1 and data_args.sentence_markers else []
    padded = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    if sentences:
        train = documents_as_sentences(train, markers, model.config.decoder_start_token_id)
        columns_train = ["input_ids", "attention_mask", "decoder_input_ids", "labels"]
        train_collator = Seq2SeqPackingCollator(
            SENTENCE_ROW_TOKENS, tokenizer.pad_token_id, model.config.decoder_start_token_id
        )
        logger.info(
            "training on the documents' %d sentences, each in its document's form, packed into rows of up to %d "
            "tokens per side (every layer within each sentence: the whole documents' loss and gradients)",
            len(train),
            SENTENCE_ROW_TOKENS,
        )
    elif data_args.pack_tokens:
        train_collator = Seq2SeqPackingCollator(
            data_args.pack_tokens,
            tokenizer.pad_token_id,
            model.config.decoder_start_token_id,
            pad_to_multiple_of=training_args.sp_size,
        )
        logger.info("training on packed rows of up to %d tokens per side", data_args.pack_tokens)
    else:
        train_collator = padded
    warm = warmup_minutes(data_args, sentences)
    if (warm > 0 or data_args.init_from) and "--warmup_steps" not in (argv or sys.argv):
        training_args.warmup_steps = 100  # the optimizer starts fresh on a model that already translates
    budget = seqpar_hf.TimeBudgetCallback(
        data_args.max_train_minutes - warm if data_args.max_train_minutes else 0, data_args.eval_every_minutes
    )
    ramp = [] if sentences else ramp_steps(data_args)
    if ramp:
        train_collator = DocumentRamp(
            train_collator, markers, tokenizer.eos_token_id, ramp, lambda: budget.fraction, data_args.document_ramp_mix
        )
        logger.info(
            "document ramp: %s",
            f"each batch cut at {', '.join(str(n) for _, n in ramp)} tokens or whole, drawn alike, until "
            f"{ramp[-1][0]:.0%} of the documents' budget"
            if data_args.document_ramp_mix
            else ", ".join(f"pieces of up to {n} tokens until {f:.0%} of the documents' budget" for f, n in ramp),
        )
    counter = TokenCounter(train_collator)
    tokens_log = RealTokens(counter, offset_minutes=warm)
    trainer = BudgetTrainer(
        model=model,
        args=training_args,
        train_dataset=train.select_columns(columns_train),
        eval_dataset=validation.select_columns(columns),
        processing_class=tokenizer,
        data_collator=counter,
        eval_data_collator=padded,
        generation_kwargs_fn=generation_kwargs_fn(data_args, tokenizer),
        compute_metrics=make_compute_metrics(tokenizer, validation["fr_refs"], metric),
        callbacks=[budget, tokens_log],
    )
    if data_args.lr_decay == "budget" and data_args.max_train_minutes > 0:
        trainer.budget = budget
    if ramp:  # the pieces are short rows: split across the SP group, not along their sequences (a batch of
        # pieces has more rows than documents; every rank sees the same batch, so decides alike)
        documents_per_step = training_args.per_device_train_batch_size
        trainer.split_rows = lambda batch: batch["labels"].shape[0] > documents_per_step

    if warm > 0:
        trainer.train_steps_before = sentence_warm_start(
            model, tokenizer, splits["train_sentences"], training_args, warm
        )
    if uses_sentence_positions(data_args, training_args):  # after the warm start: its sentences at their
        # random marker's slot instead gave 54.53 against 55.23 (docs/translation-experiments.md)
        local = sentence_local_layers(model_args, data_args, training_args)
        stride = sentence_position_stride(model_args, data_args, training_args, model.config.max_position_embeddings)
        SentencePositions(model, markers, stride, local)
        logger.info(
            "sentence positions: %s, both sides",
            f"sentence k of a document at k x {stride} + its offset" if stride else "each sentence from position 0",
        )
        if local == shallower_stack(model_args):
            logger.info("sentence attention: every layer within each sentence (no layer sees another sentence)")
        elif local:
            logger.info("sentence attention: the lower %d layers of each stack attend within each sentence", local)
    elif docs > 1 and data_args.sentence_markers and data_args.sentence_positions == "auto":
        logger.info(
            "sentence positions: off under SP by default (measured in one process only; --sentence_positions true "
            "gives one process's numbers under SP); positions count through each document"
        )
    trainer.train()
    trainer.save_model(training_args.output_dir)  # a plain checkpoint (+ the tokenizer: processing_class)

    # Test: beam search, each English sentence scored against all its French translations.
    trainer.compute_metrics = make_compute_metrics(tokenizer, test["fr_refs"], metric)
    output = trainer.predict(
        test.select_columns(columns),
        metric_key_prefix="test",
        num_beams=data_args.test_num_beams,
        max_length=max_target,
    )
    trainer.log_metrics("test", output.metrics)
    if trainer.is_world_process_zero():
        ids = np.where(output.predictions < 0, tokenizer.pad_token_id, output.predictions)
        hypotheses = translation_data.decode_french(tokenizer, ids[: data_args.num_examples_to_print].tolist())
        print("\nTest translations:")
        for en, refs, hyp in zip(test["en"], test["fr_refs"], hypotheses):
            print(f"  EN:  {en}\n  REF: {refs[0]}\n  OUT: {hyp}\n")
        print(
            f"test BLEU {output.metrics['test_bleu']:.2f} (beam {data_args.test_num_beams}, decoding "
            f"{output.metrics['test_runtime']:.0f} s); total time {(time.time() - started) / 60:.1f} min"
        )
        print(f"saved model: {os.path.abspath(training_args.output_dir)}")
        summary = {
            "command": sys.argv,
            "steps": trainer.state.global_step,
            "real_tokens_per_s": round(tokens_log.rate),
            "eval_curve": tokens_log.curve,
            "test_bleu": output.metrics["test_bleu"],
            "test_decoding_s": round(output.metrics["test_runtime"], 1),
            "test_beams": data_args.test_num_beams,
            "wall_minutes": round((time.time() - started) / 60, 2),
            "sp_size": training_args.sp_size,
            "document_sentences": docs,
            "mixed_documents": data_args.mixed_documents and docs > 1,
            "sentence_warmup_minutes": warm,
            "sentence_warmup_steps": getattr(trainer, "train_steps_before", 0),
            "precision": "bf16" if training_args.bf16 else "fp32",
            "machine": machine,
        }
        # what recipes/README.md's demo table and figure are drawn from (recipes/plot_bleu.py)
        Path(training_args.output_dir, "run_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return output.metrics


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # join gloo's threads before exit: without it a rank can abort there
        torch.distributed.destroy_process_group()  # ("terminate called without an active exception")
