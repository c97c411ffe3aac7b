"""The translation recipe's training pieces (recipes/train_translation.py is the script): the model, the
precision and threads it runs with, the time-budgeted trainer, the logging of real tokens and of BLEU
over time, the per-sentence length bound of generation, and the BLEU metric."""

from __future__ import annotations

import logging
import os
import random
import time
import zlib
from pathlib import Path

import evaluate
import numpy as np
import torch
import torch.nn.functional as F
from transformers import (
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    MarianConfig,
    MarianMTModel,
    T5Config,
    T5ForConditionalGeneration,
    TrainerCallback,
)

import seqpar_hf

if __package__:  # imported as recipes.translation_training (tests, benchmarks)
    from . import translation_data
else:  # imported by recipes/train_translation.py launched as a script: its folder is on sys.path
    import translation_data

ROOT = Path(__file__).resolve().parent.parent
logger = logging.getLogger("train_translation")


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says it, else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def use_the_cores(requested: int) -> str:
    """On CPU, one process per core share: torch threads = usable cores // local processes (accelerate
    launch with no config exports OMP_NUM_THREADS=1, which would leave all but one core idle)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = usable_cores()
    threads = requested or max(1, cores // local)
    torch.set_num_threads(threads)
    return f"{threads} threads per process ({cores} cores, {local} local process{'es' if local > 1 else ''})"


def cpu_flags() -> tuple[str, set[str]]:
    """The CPU's model name and its flags (/proc/cpuinfo; empty where there is none)."""
    name, flags = "", set()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    return name, flags


def describe_machine(training_args) -> str:
    """What the run's numbers depend on, for its log and summary: the GPU, or the CPU's model, its usable cores and
    whether it has the instructions that make bf16 fast (AVX512-BF16, AMX) or only AVX2 / AVX512 for fp32. The
    demo's speed differs 2.6x between such CPUs (recipes/README.md), so every row of its table names one."""
    if not training_args.use_cpu and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA)"
    name, flags = cpu_flags()
    cores = usable_cores()
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        isa = " + ".join(n for f, n in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX")) if f in flags)
    elif "avx512f" in flags:
        isa = "AVX512 (no BF16)"
    elif "avx2" in flags:
        isa = "AVX2 only"
    else:
        isa = torch.backends.cpu.get_cpu_capability()
    return f"{name or 'CPU'}, {cores} core{'s' if cores > 1 else ''}, {isa}"


def choose_precision(requested: str, training_args) -> str:
    """bf16 mixed precision where the hardware computes bf16 fast: a CUDA device with bf16, or a CPU with
    AVX512-BF16 or AMX (on such a 2-core CPU the model's matmuls run 4-6x faster in bf16 and a training
    step 1.85x, with the same losses to 1e-4). Decided from the hardware, so every rank decides alike."""
    if requested == "auto":
        if not training_args.use_cpu and torch.cuda.is_available():
            fast, where = torch.cuda.is_bf16_supported(), "this GPU"
        else:
            flags = cpu_flags()[1]
            fast, where = bool(flags & {"avx512_bf16", "amx_bf16"}), "this CPU"
        requested = "bf16" if fast else "fp32"
        logger.info("precision: %s (auto: bf16 is %sfast on %s)", requested, "" if fast else "not ", where)
    if requested == "bf16" and not training_args.bf16:
        # TrainingArguments turns bf16 into mixed_precision in __post_init__, and the Trainer's Accelerator reads
        # only that: setting bf16 alone afterwards trains in fp32 while the logs say bf16
        training_args.bf16, training_args.mixed_precision = True, "bf16"
    return "bf16" if training_args.bf16 else "fp32"


def build_model(model_args, tokenizer, max_length: int) -> MarianMTModel | T5ForConditionalGeneration:
    if getattr(model_args, "model_type", "marian") == "t5":
        return _t5(model_args, tokenizer)
    config = MarianConfig(
        vocab_size=len(tokenizer),
        decoder_vocab_size=len(tokenizer),
        share_encoder_decoder_embeddings=True,
        d_model=model_args.d_model,
        encoder_layers=model_args.encoder_layers,
        decoder_layers=model_args.decoder_layers,
        encoder_attention_heads=model_args.attention_heads,
        decoder_attention_heads=model_args.attention_heads,
        encoder_ffn_dim=model_args.ffn_dim,
        decoder_ffn_dim=model_args.ffn_dim,
        dropout=model_args.dropout,
        attention_dropout=model_args.attention_dropout,
        activation_dropout=0.0,
        scale_embedding=True,
        max_position_embeddings=max_length + 2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        forced_eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    model = MarianMTModel(config)
    model.set_attn_implementation("sdpa")
    model.generation_config.bad_words_ids = [[tokenizer.pad_token_id]]  # never generate <pad> after the start
    return model


def start_from(model, init_dir: str, tokenizer) -> None:
    """--init_from: `model` (built from the flags) takes the weights of a model this recipe saved in `init_dir`,
    e.g. the main command's sentence model before documents. Its vocabulary must be the first ids of
    `tokenizer` (the same data and --vocab_size): the rows the documents add (the sentence markers) are drawn
    at the scale of the saved rows, seeded. The position tables are fixed sinusoids, longer here, the same rows
    where both have them. Any other shape that differs is an error naming the tensor (the model flags differ)."""
    saved_tokenizer = AutoTokenizer.from_pretrained(init_dir)
    n = len(saved_tokenizer)
    if n > len(tokenizer) or saved_tokenizer.convert_ids_to_tokens(list(range(n))) != tokenizer.convert_ids_to_tokens(
        list(range(n))
    ):
        raise ValueError(
            f"--init_from {init_dir}: its vocabulary ({n} tokens) is not the first ids of this run's "
            f"({len(tokenizer)}): train both on the same data with the same --vocab_size and --lowercase"
        )
    saved = type(model).from_pretrained(init_dir, dtype=torch.float32)
    embeddings = model.get_input_embeddings().weight
    vocab_rows = {embeddings.data_ptr()}
    with torch.no_grad():
        grown = saved.get_input_embeddings().weight
        extra = torch.randn(embeddings.shape[0] - n, grown.shape[1], generator=torch.Generator().manual_seed(0))
        embeddings.copy_(torch.cat([grown, extra * grown.std()]))
        target = model.state_dict()
        for name, value in saved.state_dict().items():
            here = target[name]
            if "embed_positions" in name or here.data_ptr() in vocab_rows:
                continue  # fixed sinusoids; the tied token embeddings, set above
            if name == "final_logits_bias":
                here.zero_()
                here[:, :n] = value
            elif here.shape != value.shape:
                raise ValueError(
                    f"--init_from {init_dir}: {name} is {tuple(value.shape)} there and {tuple(here.shape)} here: "
                    "pass the model flags it was trained with (--d_model, --encoder_layers, ...)"
                )
            else:
                here.copy_(value)
    logger.info("weights from %s (%d of %d token rows)", init_dir, n, embeddings.shape[0])


def _t5(model_args, tokenizer) -> T5ForConditionalGeneration:
    """The same sizes as a T5 (v1.0: ReLU feed-forward, a relative position bias in the first layer of each stack,
    shared by its layers; the head tied and scaled by d_model^-0.5): its decoder starts from <pad>, like Marian's.
    Hidden dropout `--dropout`, attention-weight dropout `--attention_dropout` (T5 has one rate for both)."""
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=model_args.d_model,
        d_kv=model_args.d_model // model_args.attention_heads,
        d_ff=model_args.ffn_dim,
        num_layers=model_args.encoder_layers,
        num_decoder_layers=model_args.decoder_layers,
        num_heads=model_args.attention_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=model_args.dropout,
        feed_forward_proj="relu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = T5ForConditionalGeneration(config)
    for module in model.modules():  # T5 drops attention weights at its hidden dropout: the recipe's own rate
        if isinstance(getattr(module, "dropout", None), float):  # (0: the ring and the bias kernels take none)
            module.dropout = model_args.attention_dropout
    model.set_attn_implementation("sdpa")
    model.generation_config.bad_words_ids = [[tokenizer.pad_token_id]]
    model.generation_config.forced_eos_token_id = tokenizer.eos_token_id
    return model


class BudgetTrainer(seqpar_hf.SequenceParallelTrainer):
    """With `budget` set: the learning rate decays over the time budget, or over the steps of the epochs
    where those end first (`TimeBudgetCallback.schedule`)."""

    budget = None
    split_rows = None  # a callable(batch): True where the batch's rows are short enough to split across the SP group

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Short rows (--document_ramp's pieces): each rank of the SP group takes every sp-th row of the full
        batch and runs the plain model on them (data parallel inside the group); long rows: sequence
        parallel. The same loss and gradients either way: the token loss sum over this rank's rows / the
        batch's labelled tokens x sp, which the data-parallel wrapper's average over the group turns into
        the batch's mean loss (the scaling of seqpar_hf's own loss, models/forward/loss.py). On 2 cores a
        row of tens of tokens gains nothing from being split, and pays the exchange in every layer."""
        sp, rows = self.layout.sp_size, inputs["labels"].shape[0]
        # training only: evaluation's batches hold more documents than a training step, and its loss is the
        # group's on every rank (prediction_step)
        if sp == 1 or not model.training or self.split_rows is None or rows < sp or not self.split_rows(inputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if num_items_in_batch is None:
            num_items_in_batch = self._labelled_tokens([inputs])
        mine = {k: v[self.layout.sp_rank :: sp] for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        labels = mine.pop("labels")
        with seqpar_hf.sp_disabled(self.accelerator.unwrap_model(model)):
            outputs = model(**mine)  # the wrapper's forward: its gradient hooks average over the group
        total = F.cross_entropy(
            outputs.logits.float().flatten(0, 1),
            labels.flatten(),
            ignore_index=-100,
            reduction="sum",
            label_smoothing=self.args.label_smoothing_factor,
        )
        loss = total / num_items_in_batch * sp * self.layout.dp_size
        return (loss, outputs) if return_outputs else loss

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.budget is not None and self.lr_scheduler is None:
            self.lr_scheduler = self.budget.schedule(
                optimizer or self.optimizer, self.args.get_warmup_steps(num_training_steps), num_training_steps
            )
        return super().create_scheduler(num_training_steps, optimizer)


class TokenCounter:
    """Wraps the training collator and counts the real (non-padding) source + target tokens it collates."""

    def __init__(self, collator):
        self.collator, self.tokens = collator, 0

    def __call__(self, features):
        self.tokens += sum(len(f["input_ids"]) + len(f["labels"]) for f in features)
        return self.collator(features)


class DocumentRamp:
    """--document_ramp: the documents' first part of the budget trains on their pieces, runs of consecutive
    sentences of at most T tokens a side (whole sentences, at least one), each piece a document of its own (its
    own row, its markers renumbered from <s1>, </s> at its end: the format of a test document's first
    sentences), T growing as the budget goes (`steps`: (fraction, T) pairs), then on the whole documents. Each
    step keeps its sentences; pieces of about one length pad little, cost less attention and sit closer to
    the sentence warm start. `progress` is the budget's agreed fraction (every rank reads the same value, so
    every rank cuts the batch alike)."""

    def __init__(
        self, collator, marker_ids: list[int], eos_id: int, steps: list[tuple[float, int]], progress, mix=False
    ):
        if marker_ids != list(range(marker_ids[0], marker_ids[0] + len(marker_ids))):
            raise ValueError("the sentence markers' ids must be consecutive to renumber them")
        self.collator, self.first, self.count, self.eos = collator, marker_ids[0], len(marker_ids), eos_id
        self.steps, self.progress, self.current, self.mix = steps, progress, None, mix

    def limit(self) -> int | None:
        """Tokens per piece now; None: whole documents; -1: each batch at a limit drawn for it (`mix`)."""
        fraction = self.progress()
        if self.mix:
            return -1 if fraction < self.steps[-1][0] else None
        return next((n for until, n in self.steps if fraction < until), None)

    def mixed_limit(self, features) -> int | None:
        """`mix`: one batch's limit, drawn from the ramp's limits and the whole document alike (per batch, not per
        document: rows of one length pad little, as a length-bucketed batch); drawn from the batch's first tokens
        and the agreed progress, so every rank (and every data-loader worker) draws the same."""
        choices = [n for _, n in self.steps] + [None]
        ids = np.asarray(list(features[0]["input_ids"]), dtype=np.int64)
        key = zlib.crc32(ids.tobytes()) ^ int(self.progress() * 1e6)
        return choices[random.Random(key).randrange(len(choices))]

    def _spans(self, ids: list[int]) -> list[tuple[int, int]]:
        starts = [i for i, t in enumerate(ids) if self.first <= t < self.first + self.count]
        if not starts or starts[0] != 0:
            raise ValueError("a document must start with its first sentence marker to be cut into pieces")
        return list(zip(starts, [*starts[1:], len(ids)]))

    def _piece(self, ids: list[int], spans: list[tuple[int, int]], first: int) -> list[int]:
        piece = [t - first if self.first <= t < self.first + self.count else t for t in ids[spans[0][0] : spans[-1][1]]]
        return piece if piece[-1] == self.eos else [*piece, self.eos]

    def pieces(self, source: list[int], target: list[int], limit: int) -> list[tuple[list[int], list[int]]]:
        """(source, target) pieces of one document: its sentences in order, grouped while both sides fit."""
        src, tgt = self._spans(source), self._spans(target)
        if len(src) != len(tgt):
            raise ValueError(f"{len(src)} source sentences but {len(tgt)} target sentences")
        groups, group, size = [], [], (0, 0)
        for k, ((a, b), (c, d)) in enumerate(zip(src, tgt)):
            if group and max(size[0] + b - a, size[1] + d - c) + 1 > limit:  # + 1: the piece's </s>
                groups.append(group)
                group, size = [], (0, 0)
            group.append(k)
            size = (size[0] + b - a, size[1] + d - c)
        groups.append(group)
        return [
            (self._piece(source, src[g[0] : g[-1] + 1], g[0]), self._piece(target, tgt[g[0] : g[-1] + 1], g[0]))
            for g in groups
        ]

    def __call__(self, features):
        limit = self.limit()
        if limit != self.current:
            what = {None: "whole documents", -1: "documents cut at limits drawn from " + ", ".join(
                f"{n}" for _, n in self.steps) + " tokens and whole, alike, per batch"}  # fmt: skip
            logger.info("training on %s", what.get(limit, f"pieces of up to {limit} tokens"))
            self.current = limit
        if limit == -1:
            limit = self.mixed_limit(features)
        if limit:
            features = [
                {"input_ids": s, "attention_mask": [1] * len(s), "labels": t}
                for f in features
                for s, t in self.pieces(list(f["input_ids"]), list(f["labels"]), limit)
            ]
        return self.collator(features)


class RealTokens(TrainerCallback):
    """Logs real (non-padding) training tokens per second (what packing and length grouping change), and
    keeps the evaluations' BLEU against the minutes spent training (`curve`, for run_summary.json)."""

    def __init__(self, counter: TokenCounter, offset_minutes: float = 0.0):
        self.counter, self.start, self.rate, self.curve = counter, None, 0.0, []
        self.offset = offset_minutes  # training minutes spent before this trainer's (a warm start)

    def on_train_begin(self, args, state, control, **kwargs):
        self.start, self.counter.tokens = time.time(), 0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics and "eval_bleu" in metrics:
            self.curve.append(
                {
                    "minutes": round(self.offset + (time.time() - self.start) / 60, 2),
                    "step": state.global_step,
                    "eval_bleu": metrics["eval_bleu"],
                }
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and state.is_world_process_zero:
            self.rate = self.counter.tokens / (time.time() - self.start)
            logger.info("step %d: %.0f real tokens/s", state.global_step, self.rate)

    def on_train_end(self, args, state, control, **kwargs):
        self.rate = self.counter.tokens / (time.time() - self.start)
        if state.is_world_process_zero:
            logger.info(
                "training: %d real tokens in %.0f s = %.0f real tokens/s (%d steps)",
                self.counter.tokens,
                time.time() - self.start,
                self.rate,
                state.global_step,
            )


class SourceLengthLimit(LogitsProcessor):
    """Forces </s> once a row has generated `a x source length + b` tokens (per sentence, per beam)."""

    def __init__(self, limits: torch.Tensor, eos_token_id: int, prompt_length: int):
        self.limits, self.eos, self.prompt = limits, eos_token_id, prompt_length

    def __call__(self, input_ids, scores):
        rows = self.limits.repeat_interleave(input_ids.shape[0] // self.limits.shape[0]).to(scores.device)
        done = input_ids.shape[1] - self.prompt >= rows  # [batch * beams]
        if bool(done.any()):
            forced = torch.full_like(scores[0], float("-inf"))
            forced[self.eos] = 0.0
            scores = torch.where(done[:, None], forced, scores)
        return scores


class SentenceMarkerOrder(LogitsProcessor):
    """Documents with numbered sentence markers (--sentence_markers): the translation writes the markers in
    order, one per source sentence, and ends only after the last one. So it has exactly the source's number of
    sentences, aligned by their markers; which words follow each marker is the model's choice."""

    def __init__(self, source_ids: torch.Tensor, marker_ids: list[int], eos_token_id: int):
        self.markers = torch.tensor(marker_ids)
        self.sentences = torch.isin(source_ids, self.markers.to(source_ids.device)).sum(-1)  # [batch]
        self.eos = eos_token_id

    def __call__(self, input_ids, scores):
        markers = self.markers.to(scores.device)
        sentences = self.sentences.repeat_interleave(input_ids.shape[0] // self.sentences.shape[0]).to(scores.device)
        written = torch.isin(input_ids, markers).sum(-1)  # markers written so far, per row (beam)
        allowed = scores.clone()
        allowed[:, markers] = float("-inf")
        rows = torch.nonzero(written < sentences).squeeze(-1)
        nxt = markers[written[rows].clamp(max=len(markers) - 1)]
        allowed[rows, nxt] = scores[rows, nxt]  # the next marker, while source sentences are left
        allowed[rows, self.eos] = float("-inf")  # and no end before the last one
        return allowed


def generation_kwargs_fn(data_args, tokenizer):
    """Per-batch generate() arguments: the per-sentence length bound from each source's length, and with
    --sentence_markers the markers' order."""
    docs = data_args.document_sentences
    markers = (
        [tokenizer.convert_tokens_to_ids(translation_data.marker(k)) for k in range(1, docs + 1)]
        if docs > 1 and data_args.sentence_markers
        else []
    )

    def kwargs(inputs: dict) -> dict:
        processors = []
        if markers:
            processors.append(SentenceMarkerOrder(inputs["input_ids"], markers, tokenizer.eos_token_id))
        if data_args.max_length_a > 0:  # last: its forced </s> wins
            sources = inputs["attention_mask"].sum(-1)
            limits = (data_args.max_length_a * sources).ceil().long() + data_args.max_length_b
            processors.append(SourceLengthLimit(limits, tokenizer.eos_token_id, 1))
        return {"logits_processor": LogitsProcessorList(processors)} if processors else {}

    return kwargs


def bleu_metric():
    return evaluate.load(str(ROOT / "metrics" / "sacrebleu_local"))


def make_compute_metrics(tokenizer, references: list[list[str]], metric):
    """BLEU of detokenized greedy translations against all French references of each sentence."""

    def compute_metrics(prediction):
        ids = np.where(prediction.predictions < 0, tokenizer.pad_token_id, prediction.predictions)
        hypotheses = translation_data.decode_french(tokenizer, ids.tolist())
        result = metric.compute(predictions=hypotheses, references=references[: len(hypotheses)])
        logger.info("BLEU %.2f (sacrebleu %s)", result["score"], result["signature"])
        return {"bleu": result["score"]}

    return compute_metrics


def sentence_warm_start(model, tokenizer, sentences, training_args, minutes: float) -> int:
    """Train `model` on `sentences` (the training pairs one per row, translation_data's "train_sentences")
    in packed rows of 128 tokens, 96 pairs per step, the learning rate warmed up then constant, for
    `minutes`, before the documents: the model learns to align sentences, which long documents alone
    teach slowly. Returns the steps taken."""
    import copy

    from seqpar_hf.training.packing import Seq2SeqPackingCollator

    args = copy.copy(training_args)
    args.per_device_train_batch_size, args.train_sampling_strategy = 96, "random"
    args.eval_strategy, args.lr_scheduler_type, args.warmup_steps = "no", "constant_with_warmup", 300
    collator = TokenCounter(
        Seq2SeqPackingCollator(
            128, tokenizer.pad_token_id, model.config.decoder_start_token_id, pad_to_multiple_of=training_args.sp_size
        )
    )
    trainer = seqpar_hf.SequenceParallelTrainer(
        model=model,
        args=args,
        train_dataset=sentences.select_columns(["input_ids", "attention_mask", "labels"]),
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=[seqpar_hf.TimeBudgetCallback(minutes), RealTokens(collator)],
    )
    logger.info("sentence-level warm start: %.1f minutes on %d sentence pairs, then documents", minutes, len(sentences))
    trainer.train()
    return trainer.state.global_step
