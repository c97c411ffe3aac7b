"""The recipes' flag checks (tier 1: parsed arguments, no process group, no data), then end to end: the
translation recipe on a small slice, 2 CPU processes with sp_size=2 launched by accelerate with the
shipped config; the saved model translates with plain transformers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import HfArgumentParser

ROOT = Path(__file__).resolve().parent.parent


# -- tier 1: every bad flag refused right after parsing, naming the flag, the value and what is allowed ----------
@pytest.fixture(scope="module")
def recipes():
    from recipes import sft_long_context, train_translation

    return {"translation": train_translation, "sft": sft_long_context}


def _parsed(recipe, argv, tmp_path):
    """The recipe's dataclasses for `argv` (unchecked), writing only under tmp_path."""
    groups = (
        (recipe.ModelArguments, recipe.DataArguments, recipe.RecipeTrainingArguments)
        if hasattr(recipe, "ModelArguments")
        else (recipe.RecipeArguments, recipe.SFTArguments)
    )
    argv = ["--output_dir", str(tmp_path / "out"), "--data_cache_dir", str(tmp_path / "cache"), *argv]
    return HfArgumentParser(groups).parse_args_into_dataclasses(args=argv)


TRANSLATION = {  # flags: the start of the message
    "num_threads -1": (["--num_threads", "-1"], "--num_threads -1: must be >= 0 (torch threads per process; 0: "),
    "pack_tokens -5": (["--pack_tokens", "-5"], "--pack_tokens -5: must be >= 0 (tokens per packed row; 0: padded"),
    "pack_tokens < pair": (["--pack_tokens", "64"], "--pack_tokens 64: shorter than the longest pair (80 tokens"),
    "pack + documents": (
        ["--pack_tokens", "256", "--document_sentences", "2"],
        "--pack_tokens 256 packs sentence pairs into rows; --document_sentences 2 joins them",
    ),
    "separator + markers": (
        ["--document_sentences", "4", "--sentence_separator"],
        "--sentence_separator and --sentence_markers (on by default) both mark the sentences",
    ),
    "document_sentences 0": (["--document_sentences", "0"], "--document_sentences 0: must be >= 1 (sentence pairs"),
    "max_train_minutes -1": (["--max_train_minutes", "-1"], "--max_train_minutes -1.0: must be >= 0 (minutes of"),
    "max_train_minutes nan": (["--max_train_minutes", "nan"], "--max_train_minutes nan: must be >= 0"),
    "sentence_warmup_minutes -2": (
        ["--sentence_warmup_minutes", "-2"],
        "--sentence_warmup_minutes -2.0: must be >= 0 (minutes on single sentences",
    ),
    "sentence_warmup >= budget": (
        ["--document_sentences", "4", "--sentence_warmup_minutes", "26"],
        "--sentence_warmup_minutes 26.0: must be shorter than --max_train_minutes 26.0",
    ),
    "document_ramp shrinking": (
        ["--document_sentences", "32", "--document_ramp", "96,48"],
        "--document_ramp 96,48: growing token limits per piece, comma-separated, each at least 16, e.g. 48,96,192",
    ),
    "document_ramp small": (["--document_sentences", "8", "--document_ramp", "8"], "--document_ramp 8: growing token"),
    "document_ramp sentences": (["--document_ramp", "48"], "--document_ramp 48: growing token limits per piece"),
    "document_ramp none words": (["--document_ramp", "off"], "--document_ramp off: growing token limits per piece"),
    "document_ramp words": (["--document_sentences", "8", "--document_ramp", "four"], "--document_ramp four: growing"),
    "document_ramp no markers": (
        ["--document_sentences", "8", "--document_ramp", "48", "--sentence_markers", "false"],
        "--document_ramp 48: needs the sentence markers (--sentence_markers true)",
    ),
    "document_ramp_fraction 1": (["--document_ramp_fraction", "1"], "--document_ramp_fraction 1.0: must be in [0, 1)"),
    "document_ramp_mix sentences": (
        ["--document_ramp_mix", "true"],
        "--document_ramp_mix true: mixes the ramp's pieces, and there is no ramp (it needs --document_sentences N > 1",
    ),
    "document_ramp_mix none": (
        ["--document_sentences", "8", "--document_ramp", "none", "--document_ramp_mix", "true"],
        "--document_ramp_mix true: mixes the ramp's pieces, and there is no ramp",
    ),
    "sentence_positions yes": (["--sentence_positions", "yes"], "--sentence_positions yes: auto, true or false"),
    "sentence_positions sentences": (
        ["--sentence_positions", "true"],
        "--sentence_positions true: places the sentences of a document by their markers; it needs --document_sentences",
    ),
    "sentence_positions no markers": (
        ["--document_sentences", "8", "--sentence_positions", "true", "--sentence_markers", "false"],
        "--sentence_positions true: places the sentences of a document by their markers",
    ),
    "sentence_position_stride without the positions": (
        ["--document_sentences", "8", "--sentence_position_stride", "0", "--sentence_positions", "false"],
        "--sentence_position_stride 0: auto or a number of positions from 0, with the sentence positions on (here "
        "--sentence_positions false)",
    ),
    "sentence_position_stride past the table": (
        ["--document_sentences", "8", "--sentence_position_stride", "81"],
        "--sentence_position_stride 81: 8 sentences x 81 = 648 positions, more than the model's position table of "
        "642 (the longer of --max_source_length / --max_target_length, + 2): at most 80, or auto",
    ),
    "sentence_local_layers past the layers": (
        ["--document_sentences", "8", "--sentence_local_layers", "4"],
        "--sentence_local_layers 4: auto, or from 0 to 3 (the layers of the shallower stack",
    ),
    "sentence_local_layers no positions": (
        ["--document_sentences", "8", "--sentence_local_layers", "1", "--sentence_positions", "false"],
        "--sentence_local_layers 1: with the sentence positions in one process (here --sentence_positions false",
    ),
    "document_training sentences with a global layer": (
        ["--document_sentences", "8", "--document_training", "sentences", "--sentence_local_layers", "2"],
        "--document_training sentences: trains each sentence of a document alone, which gives the documents' loss "
        "only where no layer sees another sentence: it needs the sentence positions in one process with every layer "
        "local (here --document_sentences 8, --sentence_positions auto, --sentence_local_layers 2, --sp_size 1); or "
        "--document_training whole",
    ),
    "document_training sentences with a ramp": (
        ["--document_sentences", "8", "--document_training", "sentences", "--document_ramp", "48"],
        "--document_ramp 48: cuts whole documents into pieces; --document_training sentences trains their sentences,",
    ),
    "init_from no model": (["--init_from", "/nonexistent/run"], "--init_from /nonexistent/run: no saved model there"),
    "max_length_a -1": (["--max_length_a", "-1"], "--max_length_a -1.0: must be >= 0 (a translation stops after"),
    "max_length_b -3": (["--max_length_b", "-3"], "--max_length_b -3: must be >= 0"),
    "vocab_size 3": (["--vocab_size", "3"], "--vocab_size 3: must be >= 4 (the shared BPE vocabulary: 3 special"),
    "test_num_beams 0": (["--test_num_beams", "0"], "--test_num_beams 0: must be >= 1 (beams of the final test"),
    "max_pairs 0": (["--max_pairs", "0"], "--max_pairs 0: must be >= 1 (pairs read from the data file"),
    "max_train_samples 0": (["--max_train_samples", "0"], "--max_train_samples 0: must be >= 1 (training examples"),
    "max_eval_samples 0": (["--max_eval_samples", "0"], "--max_eval_samples 0: must be >= 1 (validation examples"),
    "max_test_samples -1": (["--max_test_samples", "-1"], "--max_test_samples -1: must be >= 1 (test examples"),
    "max_source_length 1": (["--max_source_length", "1"], "--max_source_length 1: must be >= 2 (tokens, </s>"),
    "max_target_length -1": (["--max_target_length", "-1"], "--max_target_length -1: must be >= 2"),
    "no_repeat_ngram_size -1": (["--no_repeat_ngram_size", "-1"], "--no_repeat_ngram_size -1: must be >= 0"),
    "num_examples_to_print -1": (["--num_examples_to_print", "-1"], "--num_examples_to_print -1: must be >= 0"),
    "d_model % heads": (["--d_model", "250"], "--d_model 250: must be a multiple of --attention_heads 4"),
    "d_model 0": (["--d_model", "0"], "--d_model 0: must be >= 1 (hidden size)"),
    "encoder_layers 0": (["--encoder_layers", "0"], "--encoder_layers 0: must be >= 1 (encoder layers)"),
    "decoder_layers -1": (["--decoder_layers", "-1"], "--decoder_layers -1: must be >= 1 (decoder layers)"),
    "attention_heads 0": (["--attention_heads", "0"], "--attention_heads 0: must be >= 1 (attention heads)"),
    "ffn_dim 0": (["--ffn_dim", "0"], "--ffn_dim 0: must be >= 1 (feed-forward size)"),
    "dropout 1": (["--dropout", "1"], "--dropout 1.0: must be in [0, 1) (the probability of zeroing"),
    "attention_dropout -0.1": (["--attention_dropout", "-0.1"], "--attention_dropout -0.1: must be in [0, 1)"),
    "train batch 0": (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be >= 1"),
    "eval batch 0": (["--per_device_eval_batch_size", "0"], "--per_device_eval_batch_size 0: must be >= 1"),
}
SFT = {
    "num_threads -1": (["--num_threads", "-1"], "--num_threads -1: must be >= 0 (torch threads per process"),
    "hidden_size 0": (["--hidden_size", "0"], "--hidden_size 0: must be >= 1 (model width)"),
    "num_layers 0": (["--num_layers", "0"], "--num_layers 0: must be >= 1 (decoder layers)"),
    "num_heads 0": (["--num_heads", "0"], "--num_heads 0: must be >= 1 (attention heads)"),
    "num_kv_heads 3": (["--num_kv_heads", "3"], "--num_kv_heads 3: must divide --num_heads 8 (grouped-query"),
    "num_kv_heads > heads": (["--num_kv_heads", "16"], "--num_kv_heads 16: must divide --num_heads 8"),
    "hidden_size % heads": (["--hidden_size", "100"], "--hidden_size 100: must be --num_heads 8 x an even head size"),
    "odd head size": (["--hidden_size", "264"], "--hidden_size 264: must be --num_heads 8 x an even head size"),
    "pairs_per_document 0": (["--pairs_per_document", "0"], "--pairs_per_document 0: must be >= 1"),
    "max_documents 0": (["--max_documents", "0"], "--max_documents 0: must be >= 1 (training documents)"),
    "eval_documents 0": (["--eval_documents", "0"], "--eval_documents 0: must be >= 1 (held-out documents)"),
    "eval pairs > held out": (
        ["--pairs_per_document", "200"],
        "--eval_documents 16 x --pairs_per_document 200: must be at most 2000 pairs",
    ),
    "max_train_minutes -1": (["--max_train_minutes", "-1"], "--max_train_minutes -1.0: must be >= 0"),
    "max_length 0": (["--max_length", "0"], "--max_length 0: must be >= 1 (tokens per packed row"),
    "train batch 0": (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be >= 1"),
}


@pytest.mark.parametrize("recipe_name, case", [("translation", c) for c in TRANSLATION] + [("sft", c) for c in SFT])
def test_recipe_flags_checked_before_any_work(recipes, recipe_name, case, tmp_path):
    recipe = recipes[recipe_name]
    argv, message = (TRANSLATION if recipe_name == "translation" else SFT)[case]
    with pytest.raises(ValueError) as error:
        recipe.check_args(*_parsed(recipe, argv, tmp_path))
    assert str(error.value).startswith(message), str(error.value)


@pytest.mark.parametrize("recipe_name", ["translation", "sft"])
def test_recipe_defaults_pass_and_bad_folders_are_refused(recipes, recipe_name, tmp_path):
    recipe = recipes[recipe_name]
    recipe.check_args(*_parsed(recipe, [], tmp_path))  # the defaults pass (and make the folders)
    assert (tmp_path / "out").is_dir() and not list((tmp_path / "out").iterdir())  # the write test left nothing
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError) as error:  # a file where a folder is needed: fails for root too
        recipe.check_args(*_parsed(recipe, ["--output_dir", str(blocker / "model")], tmp_path))
    assert (
        str(error.value) == f"--output_dir {str(blocker / 'model')!r}: must be a folder to write to (Not a directory)"
    )
    with pytest.raises(ValueError) as error:
        recipe.check_args(*_parsed(recipe, ["--data_cache_dir", str(blocker)], tmp_path))
    assert str(error.value) == f"--data_cache_dir {str(blocker)!r}: must be a folder (File exists)"


@pytest.mark.parametrize("recipe_name", ["translation", "sft"])
def test_recipe_parse_args_exits_2_with_one_line(recipes, recipe_name, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        recipes[recipe_name].parse_args(["--num_threads", "-1", "--output_dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith(
            "error: --num_threads -1: must be >= 0 (torch "
            "threads per process; 0: the usable cores divided "
            "by the local processes)"
        )
    )


HELP_SECTIONS = {
    "translation": [
        "sequence parallelism (seqpar_hf)",
        "model (this recipe)",
        "data (this recipe)",
        "training arguments (transformers Seq2SeqTrainingArguments, with this recipe's defaults)",
    ],
    "sft": [
        "sequence parallelism (seqpar_hf)",
        "this recipe",
        "training arguments (trl SFTConfig, with this recipe's defaults)",
    ],
}


@pytest.mark.parametrize("recipe_name", ["translation", "sft"])
def test_help_starts_with_the_sequence_parallel_flags(recipes, recipe_name, capsys, tmp_path):
    """--help: a one-line usage, the SP flags in their own section first, the recipe's, then transformers' long
    list; every flag still parses (the flags of every section reach their dataclass)."""
    with pytest.raises(SystemExit) as exit_:
        recipes[recipe_name].parse_args(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: ") and out.splitlines()[1] == ""
    assert re.findall(r"^(\S.*):$", out, re.M) == ["options", *HELP_SECTIONS[recipe_name]]
    sp = out.split("sequence parallelism (seqpar_hf):")[1].split("\n\n")[0]
    assert re.findall(r"^  (--\w+)", sp, re.M)[:6] == [
        "--sp_size",
        "--sp_mode",
        "--sp_ring_size",
        "--sp_head_chunks",
        "--sp_mixer_split",
        "--tp_size",
    ]
    recipe = recipes[recipe_name]
    parsed = recipe.parse_args(
        [
            "--sp_size",
            "1",
            "--sp_mode",
            "ring",
            "--learning_rate",
            "0.5",
            "--num_threads",
            "1",
            "--output_dir",
            str(tmp_path / "out"),
            "--data_cache_dir",
            str(tmp_path / "cache"),
        ]
    )
    training, own = parsed[-1], parsed[-2]
    assert (training.sp_mode, training.learning_rate, own.num_threads) == ("ring", 0.5, 1)
    assert training.ddp_find_unused_parameters is False  # every parameter is used: no DDP graph search, no warning


def test_translation_refuses_empty_splits(recipes):
    """A small --max_pairs leaves no held-out sentence: refused after preparing (same data on every rank)."""
    check, data_args = recipes["translation"].check_splits, recipes["translation"].DataArguments(max_pairs=20)
    splits = {"train": [0] * 19, "validation": [], "test": [0]}
    with pytest.raises(ValueError) as error:
        check(splits, data_args, evaluating=True)
    assert str(error.value).startswith(
        "--max_pairs 20: the validation split is empty (19 train / 0 validation / 1 test examples); read more pairs"
    )
    check(splits, data_args, evaluating=False)  # no periodic evaluation: no validation split needed
    with pytest.raises(ValueError, match="the validation and test splits are empty"):
        check({**splits, "test": []}, data_args, evaluating=True)


def _recipe(out, *extra: str) -> str:
    """Run the translation recipe small, in 2 processes at sp=2; its log."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "recipes" / "accelerate_cpu_2proc.yaml"),
        str(ROOT / "recipes" / "train_translation.py"),
        "--sp_size",
        "2",
        "--max_pairs",
        "3000",
        "--vocab_size",
        "1000",
        "--max_steps",
        "16",
        "--eval_strategy",
        "steps",
        "--eval_steps",
        "8",
        "--logging_steps",
        "4",
        "--warmup_steps",
        "4",
        "--per_device_train_batch_size",
        "32",
        "--max_eval_samples",
        "16",
        "--max_test_samples",
        "16",
        "--test_num_beams",
        "2",
        "--max_source_length",
        "24",
        "--max_target_length",
        "24",
        "--num_examples_to_print",
        "2",
        "--data_cache_dir",
        str(out / "cache"),
        "--output_dir",
        str(out / "model"),
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe")
    return _recipe(out), out / "model"


def test_recipe_logs_bleu_and_eval_speed(recipe_run):
    log, _ = recipe_run
    assert re.search(r"'eval_bleu': '[0-9.]+'", log), log[-3000:]
    assert re.search(r"'eval_steps_per_second': '[0-9.]+'", log)
    assert "sp_size=2" in log and "test BLEU" in log and "saved model:" in log


def test_the_run_names_its_machine(recipe_run, monkeypatch):
    """The log and run_summary.json name the machine the numbers were measured on (the demo's speed differs 2.6x
    between a CPU with AVX512-BF16 and one with AVX2 only), and each kind of CPU is told apart."""
    import json
    from types import SimpleNamespace

    from recipes import translation_training

    log, model_dir = recipe_run
    summary = json.loads((model_dir / "run_summary.json").read_text())
    assert f"machine: {summary['machine']}; compute: " in log
    cpu = SimpleNamespace(use_cpu=True)
    for flags, said in [
        ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "AVX512-BF16 + AMX"),
        ({"avx2", "avx512f", "avx512_bf16"}, "AVX512-BF16"),
        ({"avx2", "avx512f"}, "AVX512 (no BF16)"),
        ({"avx2", "fma"}, "AVX2 only"),
    ]:
        monkeypatch.setattr(translation_training, "cpu_flags", lambda flags=flags: ("AMD EPYC", flags))
        name, cores, isa = translation_training.describe_machine(cpu).split(", ")
        assert (name, isa) == ("AMD EPYC", said) and cores.split()[1] in ("core", "cores")


def test_saved_model_translates_with_plain_transformers(recipe_run):
    log, model_dir = recipe_run
    script = f"""
from recipes import translation_data
from transformers import AutoTokenizer, MarianMTModel
tokenizer = AutoTokenizer.from_pretrained({str(model_dir)!r})
model = MarianMTModel.from_pretrained({str(model_dir)!r}).eval()
batch = tokenizer([translation_data.tokenize_en("I am here.")], return_tensors="pt")
out = model.generate(**batch, num_beams=2, max_length=24)
print("TRANSLATION", repr(translation_data.decode_french(tokenizer, out.tolist())[0]))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        cwd=ROOT,
    )  # `recipes` from the repository root
    assert proc.returncode == 0 and "TRANSLATION" in proc.stdout, proc.stderr[-3000:]
    assert "seqpar" not in (model_dir / "config.json").read_text()


def test_recipe_trains_t5_and_saves_a_plain_checkpoint(tmp_path):
    """--model_type t5: T5's relative position bias and its own two stacks under SP, through the whole recipe
    (8 steps), and a checkpoint plain transformers loads."""
    log = _recipe(tmp_path, "--model_type", "t5", "--max_steps", "8", "--eval_steps", "4")
    assert "model: T5ForConditionalGeneration" in log and "test BLEU" in log, log[-3000:]
    assert '"model_type": "t5"' in (tmp_path / "model" / "config.json").read_text()
    assert "seqpar" not in (tmp_path / "model" / "config.json").read_text()


# -- the document ramp's short rows: data parallel inside the SP group, the same loss and gradients ----------------
def _row_split_rank(out_dir: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import MarianConfig, MarianMTModel

    from recipes.train_translation import RecipeTrainingArguments
    from recipes.translation_training import BudgetTrainer

    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, dropout=0.0,
    )  # fmt: skip
    model = MarianMTModel(config)
    args = RecipeTrainingArguments(
        output_dir=out_dir, sp_size=2, use_cpu=True, report_to=[], label_smoothing_factor=0.1
    )
    trainer = BudgetTrainer(model=model, args=args, train_dataset=[{"input_ids": [2, 1], "labels": [3, 1]}] * 2)
    g = torch.Generator().manual_seed(1)  # every rank the same full batch of 5 rows (odd: 3 + 2 rows per rank)
    ids = torch.randint(2, 64, (5, 9), generator=g)
    labels = torch.randint(2, 64, (5, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:], labels[2, 4:] = 0, -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    batch["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels=labels)
    results = {}
    for name, split in (("sequences", None), ("rows", lambda inputs: True)):
        trainer.split_rows = split
        model.zero_grad()
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        # what the data-parallel wrapper does over the group: the average of every rank's loss and gradients
        grads = [p.grad.flatten() for p in model.parameters() if p.requires_grad and p.grad is not None]
        flat = torch.cat([loss.detach().reshape(1), *grads])
        dist.all_reduce(flat)
        results[name + " on this rank"] = loss.item()
        results[name] = (flat / dist.get_world_size()).tolist()
    model.eval()  # evaluation never splits the rows: its loss is the group's on every rank
    with torch.no_grad():
        results["evaluation on this rank"] = trainer.compute_loss(trainer.model, dict(batch)).item()
    return results


@pytest.mark.multiprocess
def test_short_rows_split_across_the_group_train_as_sequence_parallel(tmp_path):
    """--document_ramp's pieces: each rank of the SP group takes every second row of the full batch and runs the
    plain model on them; the loss and every gradient are those of the batch split along its sequences."""
    import numpy as np

    from tests.helpers.spawn import spawn

    ranks = spawn(_row_split_rank, 2, str(tmp_path))
    # each rank's own rows: their losses differ (split along the sequences, every rank returns the group's)
    assert ranks[0]["rows on this rank"] != pytest.approx(ranks[1]["rows on this rank"], rel=1e-3)
    assert ranks[0]["sequences on this rank"] == pytest.approx(ranks[1]["sequences on this rank"], rel=1e-6)
    assert ranks[0]["evaluation on this rank"] == pytest.approx(ranks[1]["evaluation on this rank"], rel=1e-6)
    assert ranks[0]["evaluation on this rank"] == pytest.approx(ranks[0]["sequences on this rank"], rel=1e-5)
    for rank in ranks:
        sequences, rows = np.array(rank["sequences"]), np.array(rank["rows"])
        assert np.abs(sequences).max() > 0
        np.testing.assert_allclose(rows, sequences, rtol=1e-5, atol=1e-6)


def test_document_ramp_auto(recipes, tmp_path):
    """--document_ramp auto (the default): 48, 96 and 192 tokens over 20% each of the documents' budget, with the
    markers; nothing for sentences, without markers, or with none."""
    recipe = recipes["translation"]

    def steps(*argv):
        _, data_args, _ = _parsed(recipe, list(argv), tmp_path)
        return recipe.ramp_steps(data_args)

    assert [(round(f, 2), n) for f, n in steps("--document_sentences", "32")] == [(0.2, 48), (0.4, 96), (0.6, 192)]
    assert steps() == []
    assert steps("--document_sentences", "32", "--sentence_markers", "false") == []
    assert steps("--document_sentences", "32", "--document_ramp", "none") == []
    assert steps("--document_sentences", "32", "--document_ramp", "64", "--document_ramp_fraction", "0.5") == [
        (0.5, 64)
    ]


def test_sentence_positions_auto_in_one_process_with_documents_and_markers(recipes, tmp_path):
    """auto: on for documents with markers in one process (where measured), off under SP unless true; not with TP."""
    from types import SimpleNamespace

    recipe = recipes["translation"]

    def used(*argv, sp=1, tp=1):
        _, data_args, training_args = _parsed(recipe, list(argv), tmp_path)
        recipe.check_args(*_parsed(recipe, list(argv), tmp_path))
        training_args = SimpleNamespace(sp_size=sp, tp_size=tp)  # sp > 1 needs its processes to parse
        recipe.check_sentence_positions(data_args, training_args)
        return recipe.uses_sentence_positions(data_args, training_args)

    assert used("--document_sentences", "32")
    assert not used()  # sentences
    assert not used("--document_sentences", "32", sp=2)  # off under SP unless asked for
    assert used("--document_sentences", "32", "--sentence_positions", "true", sp=2)
    with pytest.raises(ValueError, match=r"^--sentence_positions true: not with tensor parallelism \(--tp_size 2\)"):
        used("--document_sentences", "32", "--sentence_positions", "true", tp=2)
    assert not used("--document_sentences", "32", "--sentence_markers", "false")
    assert not used("--document_sentences", "32", "--sentence_positions", "false")
    assert used("--document_sentences", "4", "--sentence_positions", "true")


def test_sentence_local_layers_auto_with_the_positions_in_one_process(recipes, tmp_path):
    """auto: every layer where the sentence positions are on in one process, else 0; a number as given."""
    from types import SimpleNamespace

    recipe = recipes["translation"]

    def local(*argv, sp=1):
        model_args, data_args, _ = _parsed(recipe, list(argv), tmp_path)
        return recipe.sentence_local_layers(model_args, data_args, SimpleNamespace(sp_size=sp, tp_size=1))

    assert local("--document_sentences", "32") == 3
    assert local("--document_sentences", "32", "--encoder_layers", "6", "--decoder_layers", "4") == 4
    assert local() == 0  # sentences
    assert local("--document_sentences", "32", "--sentence_positions", "true", sp=2) == 0  # whole sequences only
    assert local("--document_sentences", "32", "--sentence_positions", "false") == 0
    assert local("--document_sentences", "32", "--sentence_local_layers", "1") == 1
    assert local("--document_sentences", "32", "--sentence_local_layers", "0") == 0


def test_sentence_position_stride_auto_is_0_where_every_layer_is_local(recipes, tmp_path):
    """auto: each sentence from 0 where no layer sees another sentence (the default in one process), else the
    position table over the sentences; a number as given."""
    from types import SimpleNamespace

    recipe = recipes["translation"]

    def stride(*argv, sp=1):
        model_args, data_args, _ = _parsed(recipe, ["--document_sentences", "32", *argv], tmp_path)
        return recipe.sentence_position_stride(model_args, data_args, SimpleNamespace(sp_size=sp, tp_size=1), 2562)

    assert stride() == 0
    assert stride("--sentence_local_layers", "2") == 80
    assert stride("--sentence_positions", "true", sp=2) == 80  # no local layer under SP
    assert stride("--sentence_position_stride", "40") == 40


def test_documents_train_as_their_sentences_where_every_layer_is_local(recipes, tmp_path):
    """--document_training auto: sentences where every layer is local (the one-process default) and no ramp is asked
    for, else whole; then no warm start unless given, and 96 sentences a step."""
    from types import SimpleNamespace

    recipe = recipes["translation"]

    def resolved(*argv, sp=1):
        model_args, data_args, training_args = _parsed(recipe, list(argv), tmp_path)
        sentences = recipe.trains_sentences(model_args, data_args, SimpleNamespace(sp_size=sp, tp_size=1))
        recipe.document_defaults(data_args, training_args, list(argv), sentences)
        return sentences, recipe.warmup_minutes(data_args, sentences), training_args.per_device_train_batch_size

    assert resolved("--document_sentences", "32") == (True, 0.0, 96)
    assert resolved("--document_sentences", "32", "--sentence_warmup_minutes", "3") == (True, 3.0, 96)
    assert resolved("--document_sentences", "32", "--sentence_local_layers", "2") == (False, 5.2, 3)
    assert resolved("--document_sentences", "32", "--document_training", "whole") == (False, 5.2, 3)
    assert resolved("--document_sentences", "32", "--document_ramp", "48,96") == (False, 5.2, 3)
    assert resolved("--document_sentences", "32", "--sentence_positions", "true", sp=2)[0] is False
    assert resolved()[0] is False  # sentence pairs


def test_init_from_skips_the_sentence_warm_start_unless_given(recipes, tmp_path):
    recipe = recipes["translation"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")

    def minutes(*argv):
        _, data_args, _ = _parsed(recipe, ["--document_sentences", "32", *argv], tmp_path)
        return recipe.warmup_minutes(data_args)

    assert minutes() == round(26 / 5, 2)
    assert minutes("--init_from", str(tmp_path / "run")) == 0.0
    assert minutes("--init_from", str(tmp_path / "run"), "--sentence_warmup_minutes", "3") == 3.0


def test_bleu_figure_from_kept_summaries_with_a_baseline(tmp_path):
    """recipes/plot_bleu.py draws output_dirs and kept summaries (NAME.json) alike, a dashed line per --baseline,
    more runs than one palette's worth; a baseline that is not a number is refused with its value."""
    pytest.importorskip("matplotlib")
    import json

    from recipes import plot_bleu

    runs = []
    for i in range(7):
        summary = {
            "eval_curve": [
                {"minutes": 5.0, "step": 10, "eval_bleu": 10.0 + i},
                {"minutes": 9.0, "step": 20, "eval_bleu": 20.0},
            ],
            "test_bleu": 21.0 + i,
            "steps": 100 * (i + 1),
            "sp_size": 1 + i % 2,
            "document_sentences": 32 if i % 2 else 1,
            "sentence_warmup_minutes": 2.0 if i % 2 else 0,
            "command": ["--mixed_documents", "false"],
            "precision": "bf16",
        }
        if i == 0:
            (tmp_path / "out").mkdir()
            (tmp_path / "out" / "run_summary.json").write_text(json.dumps(summary))
            runs.append(str(tmp_path / "out"))
        else:
            (tmp_path / f"run{i}.json").write_text(json.dumps(summary))
            runs.append(str(tmp_path / f"run{i}.json"))
    out = tmp_path / "bleu.png"
    plot_bleu.main([*runs, "--baseline", "57.70", "the sentence model, joined", "--steps_panel", "--out", str(out)])
    assert out.stat().st_size > 10_000
    assert plot_bleu.label(json.loads(Path(runs[1]).read_text()), Path(runs[1])).startswith(
        "run1: sp=2, documents of 32"
    )
    with pytest.raises(SystemExit):
        plot_bleu.main([*runs, "--baseline", "high", "x", "--out", str(out)])


def test_documents_decode_the_test_with_8_beams_unless_told(recipes, tmp_path):
    """--document_sentences N > 1: the test's beam search over whole documents takes 8 beams (4 for sentences),
    unless --test_num_beams is given; the other document defaults as before."""
    recipe = recipes["translation"]

    def applied(*argv):
        _, data_args, training_args = _parsed(recipe, list(argv), tmp_path)
        recipe.document_defaults(data_args, training_args, list(argv))
        return data_args, training_args

    data_args, training_args = applied("--document_sentences", "32", "--mixed_documents", "false")
    assert data_args.test_num_beams == 8 and data_args.no_repeat_ngram_size == 0
    assert training_args.per_device_train_batch_size == 3 and training_args.sp_generate == "always"
    assert applied("--document_sentences", "32", "--test_num_beams", "4")[0].test_num_beams == 4
    data_args, training_args = applied()
    assert data_args.test_num_beams == 4 and data_args.no_repeat_ngram_size == 3
    assert training_args.per_device_train_batch_size == 96
    # documents of N sentences by default (3 of 32 per step); 1 to N with --mixed_documents (6 of 16.5 on average)
    assert applied("--document_sentences", "32")[1].per_device_train_batch_size == 3
    assert applied("--document_sentences", "32", "--mixed_documents", "true")[1].per_device_train_batch_size == 6


def test_bleu_figure_labels_documents_fixed_or_mixed():
    """A summary says whether its documents were mixed; older ones say it by the command (unset: N each now)."""
    from recipes import plot_bleu

    def label(**summary):
        return plot_bleu.label({"document_sentences": 32, **summary}, Path("run.json"))

    assert "documents of 32 sentences" in label(mixed_documents=False)
    assert "documents of up to 32 sentences" in label(mixed_documents=True, command=["--mixed_documents", "false"])
    assert "documents of 32 sentences" in label(command=["--document_sentences", "32"])
    assert "documents of up to 32 sentences" in label(command=["--mixed_documents", "true"])


# -- --init_from: documents start from a saved sentence model ------------------------------------------------------
def test_init_from_takes_a_saved_sentence_model_into_documents(tmp_path):
    """The document model built from the flags takes the sentence model's weights: the same logits over the shared
    vocabulary for a sentence (its positions are the same sinusoids), the markers' rows new, distinct, at the
    saved rows' scale; other model flags or another vocabulary are refused, naming what differs."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoTokenizer

    from recipes import translation_data
    from recipes.translation_training import build_model, start_from

    texts = ["the cat sat on the mat .", "le chat est assis sur le tapis .", "I am here .", "je suis ici ."] * 4
    sizes = SimpleNamespace(d_model=16, encoder_layers=1, decoder_layers=1, attention_heads=2, ffn_dim=32)
    sizes.dropout = sizes.attention_dropout = 0.0
    tokenizer = translation_data.train_tokenizer(texts, 60)
    torch.manual_seed(0)
    sentence = build_model(sizes, tokenizer, 24).eval()
    sentence.save_pretrained(tmp_path / "sentences")
    tokenizer.save_pretrained(tmp_path / "sentences")
    documents_tokenizer = translation_data.add_markers(AutoTokenizer.from_pretrained(tmp_path / "sentences"), 4)
    document = build_model(sizes, documents_tokenizer, 4 * 24).eval()
    start_from(document, str(tmp_path / "sentences"), documents_tokenizer)

    n = len(tokenizer)
    rows = document.get_input_embeddings().weight
    assert torch.equal(rows[:n], sentence.get_input_embeddings().weight)
    new = rows[n:]
    assert new.shape[0] == 4 and torch.isfinite(new).all() and len({tuple(r.tolist()) for r in new}) == 4
    assert 0.5 < new.std().item() / rows[:n].std().item() < 2
    batch = tokenizer(["the cat sat ."], return_tensors="pt")
    labels = tokenizer(["le chat ."], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = sentence(**batch, labels=labels).logits
        got = document(**batch, labels=labels).logits
    torch.testing.assert_close(got[..., :n], expected, rtol=0, atol=1e-5)

    wider = build_model(SimpleNamespace(**{**vars(sizes), "ffn_dim": 64}), documents_tokenizer, 96)
    fc1 = r"--init_from .*: model\.encoder\.layers\.0\.fc1\.weight is \(32, 16\) there and \(64, 16\) here"
    with pytest.raises(ValueError, match=fc1):
        start_from(wider, str(tmp_path / "sentences"), documents_tokenizer)
    other = translation_data.train_tokenizer(["completely other words here ."] * 8, 40)
    with pytest.raises(ValueError, match=r"its vocabulary \(\d+ tokens\) is not the first ids of this run's"):
        start_from(build_model(sizes, other, 24), str(tmp_path / "sentences"), other)
