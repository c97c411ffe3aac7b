"""Tier 1: the memory planner (python -m seqpar_hf.plan) against the exact per-rank counts of
benchmarks/longest_sequence.py (benchmarks/results/longest_sequence.json): within 10% for every
configuration and length the benchmark ran, and the longest sequences it implies; every bad input
refused with one line naming the flag, the value and what is allowed (exit code 2), and the library
functions refusing the same values with ValueError in the same words."""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

import pytest

from seqpar_hf import plan

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "longest_sequence.json"
OPTIONS = {
    "plain": (False, False),
    "tiled loss": (False, True),
    "checkpointing": (True, False),
    "checkpointing + tiled loss": (True, True),
}


def _results():
    return json.loads(RESULTS.read_text())


def _model(results):
    config = results["config"]
    return plan.Model(
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        ffn=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied=config["tie_word_embeddings"],
    )


def _predict(model, record):
    checkpointing, tiled = OPTIONS[record["option"]]
    layout = plan.Layout(sp=record["sp"], checkpointing=checkpointing, tiled=tiled)
    return plan.plan(model, layout, record["length"], gpus=record["sp"], act_bytes=4).peak


def test_planner_within_10_percent_of_the_measured_peaks():
    results = _results()
    model = _model(results)
    errors = []
    for record in results["records"]:
        measured = max(record["total"], record["optimizer_total"])
        predicted = _predict(model, record)
        errors.append((abs(predicted - measured) / measured, record["sp"], record["option"], record["local"]))
    worst = max(errors)
    assert worst[0] < 0.10, worst


def test_planner_longest_sequence_within_10_percent():
    results = _results()
    model = _model(results)
    for row in results["rows"]:
        checkpointing, tiled = OPTIONS[row["option"]]
        layout = plan.Layout(sp=row["sp"], checkpointing=checkpointing, tiled=tiled)
        budget = results["budget_bytes"]
        lo, hi = 0, 1 << 26
        while hi - lo > 64:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if plan.plan(model, layout, mid, gpus=row["sp"]).peak <= budget else (lo, mid)
        assert abs(lo - row["longest"]) <= 0.10 * row["longest"], (row, lo)


def test_known_model_sizes_and_the_command_line(capsys):
    assert abs(plan.Model(**plan.KNOWN["llama-3-8b"]).params / 1e9 - 8.03) < 0.01
    assert abs(plan.Model(**plan.KNOWN["bench-44m"]).params / 1e6 - 44.04) < 0.01
    best = plan.main(["--model", "llama-3-8b", "--seq-len", "131072", "--gpus", "8", "--gpu-memory", "80"])
    out = capsys.readouterr().out
    assert "recommended:" in out and best is not None and best.layout.sp > 1
    assert _refused(capsys, *RUN, "--model", "no-such-model").startswith("--model 'no-such-model': not a config.json")


def test_config_file(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=32000,
    ).save_pretrained(tmp_path)
    assert plan.load_model(str(tmp_path)) == plan.Model(**plan.KNOWN["bench-44m"])


# -- bad inputs: one line on stderr, exit code 2, no traceback -----------------------------------------
RUN = ["--seq-len", "4096", "--gpus", "8", "--gpu-memory", "80"]


def _refused(capsys, *argv) -> str:
    """main(argv) must exit 2 with one error line; returns the message after 'error: '."""
    with pytest.raises(SystemExit) as exit_:
        plan.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("python -m seqpar_hf.plan: error: "), err
    return err[-1].removeprefix("python -m seqpar_hf.plan: error: ")


GQA = "(grouped-query attention"
CLI_CASES = {  # argv: the start of the message
    "seq-len -5": (
        ["--seq-len", "-5", "--gpus", "8", "--gpu-memory", "80"],
        "--seq-len -5: must be a positive integer",
    ),
    "seq-len 0": (["--seq-len", "0", "--gpus", "8", "--gpu-memory", "80"], "--seq-len 0: must be a positive integer"),
    "batch 0": ([*RUN, "--batch", "0"], "--batch 0: must be a positive integer (sequences per SP group"),
    "heads 0": ([*RUN, "--heads", "0"], "--heads 0: must be a positive integer (query attention heads)"),
    "kv-heads 64 > heads": (
        [*RUN, "--kv-heads", "64"],
        f"--kv-heads 64: must divide heads of --model llama-3-8b = 32 {GQA}",
    ),
    "kv-heads 5": ([*RUN, "--heads", "32", "--kv-heads", "5"], f"--kv-heads 5: must divide --heads = 32 {GQA}"),
    "kv-heads 0": ([*RUN, "--kv-heads", "0"], "--kv-heads 0: must be a positive integer"),
    "kv_heads 0 (the old spelling)": ([*RUN, "--kv_heads", "0"], "--kv-heads 0: must be a positive integer"),
    "head-dim 0": ([*RUN, "--head-dim", "0"], "--head-dim 0: must be a positive integer"),
    "hidden -1": ([*RUN, "--hidden", "-1"], "--hidden -1: must be a positive integer"),
    "layers 0": ([*RUN, "--layers", "0"], "--layers 0: must be a positive integer (decoder layers)"),
    "ffn 0": ([*RUN, "--ffn", "0"], "--ffn 0: must be a positive integer"),
    "vocab 0": ([*RUN, "--vocab", "0"], "--vocab 0: must be a positive integer (vocabulary size)"),
    "gpus 0": (["--seq-len", "4096", "--gpus", "0", "--gpu-memory", "80"], "--gpus 0: must be a positive integer"),
    "gpu-memory -80": ([*RUN, "--gpu-memory", "-80"], "--gpu-memory -80.0: must be a positive number (GiB per rank)"),
    "gpu-memory 0": ([*RUN, "--gpu-memory", "0"], "--gpu-memory 0.0: must be a positive number"),
    "gpu-memory nan": ([*RUN, "--gpu-memory", "nan"], "--gpu-memory nan: must be a positive number"),
    "gpu-memory in MiB": (
        [*RUN, "--gpu-memory", "81920"],
        "--gpu-memory 81920: GiB per rank, at most 4096 (is it in MiB",
    ),
    "reserve -1": ([*RUN, "--reserve", "-1"], "--reserve -1.0: must be a fraction of each rank's memory in [0, 1)"),
    "reserve 1.5 (GiB?)": (
        [*RUN, "--reserve", "1.5"],
        "--reserve 1.5: must be a fraction of each rank's memory in [0, 1)",
    ),
    "reserve 1": ([*RUN, "--reserve", "1"], "--reserve 1.0: must be a fraction"),
    "dtype fp16": ([*RUN, "--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    "seq-len missing": (["--gpus", "8"], "--seq-len, --gpu-memory required"),
    "unknown model": ([*RUN, "--model", "no-such-model"], "--model 'no-such-model': not a config.json"),
    "validate missing": (["--validate", "no/such.json"], "--validate no/such.json: no such file"),
    "validate + seq-len": (
        ["--validate", str(RESULTS), "--seq-len", "5"],
        "--validate reads the model and the lengths from its json: drop --seq-len",
    ),
}


@pytest.mark.parametrize("case", CLI_CASES)
def test_bad_arguments_exit_2_with_the_flag_and_value(case, capsys):
    argv, message = CLI_CASES[case]
    assert _refused(capsys, *argv).startswith(message)


def test_reserve_in_gib_gets_the_fraction_it_meant(capsys):
    assert _refused(capsys, *RUN, "--reserve", "1.5").endswith("to keep 1.5 GiB of 80 free, pass --reserve 0.0187")


FAMILY = "the planner models decoder-only transformers with Llama's layer"
CONFIGS = {  # config.json text: the start of the message after '--model <path>: ', and the family named
    "corrupt": ('{"hidden_size": 4', "not valid JSON (Expecting ',' delimiter at line 1, column 18)"),
    "empty": ("", "not valid JSON (Expecting value at line 1, column 1)"),
    "array": ("[1, 2]", "holds an array, not a JSON object of keys"),
    "gpt2-like": (
        json.dumps({"n_embd": 768, "n_layer": 12, "vocab_size": 50257}),
        f"no hidden_size, num_hidden_layers, num_attention_heads, intermediate_size; {FAMILY}",
    ),
    "encoder-decoder": (
        json.dumps({"is_encoder_decoder": True, "d_model": 512}),
        f"an encoder-decoder model (is_encoder_decoder: true); {FAMILY}",
    ),
    "bert-like": (
        json.dumps(
            {
                "hidden_size": 768,
                "num_hidden_layers": 12,
                "num_attention_heads": 12,
                "intermediate_size": 3072,
                "vocab_size": 30522,
                "layer_norm_eps": 1e-12,
            }
        ),
        f"LayerNorm (layer_norm_eps, no rms_norm_eps), not Llama's layer; {FAMILY}",
    ),
    "mixture of experts": (
        json.dumps(
            {
                "hidden_size": 4096,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "intermediate_size": 14336,
                "vocab_size": 32000,
                "num_local_experts": 8,
            }
        ),
        "a mixture of experts (num_local_experts: 8), whose MLPs the planner does not count",
    ),
    "zero heads": (
        json.dumps(
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 0,
                "intermediate_size": 128,
                "vocab_size": 100,
            }
        ),
        "num_attention_heads 0: must be a positive integer",
    ),
    "kv heads": (
        json.dumps(
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 3,
                "intermediate_size": 128,
                "vocab_size": 100,
            }
        ),
        "num_key_value_heads 3: must divide num_attention_heads = 4",
    ),
    "string size": (
        json.dumps(
            {
                "hidden_size": "64",
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "vocab_size": 100,
                "head_dim": 16,
            }
        ),
        "hidden_size '64': must be a positive integer",
    ),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_bad_config_json_one_line_naming_file_and_key(case, tmp_path, capsys):
    text, message = CONFIGS[case]
    path = tmp_path / "config.json"
    path.write_text(text)
    assert _refused(capsys, *RUN, "--model", str(tmp_path)).startswith(f"--model {path}: {message}")
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: {message}")):
        plan.load_model(str(path))


def test_unreadable_config_and_validate_json(tmp_path, capsys):
    binary = tmp_path / "config.json"
    binary.write_bytes(b"\xff\xfe\x00")
    assert (
        _refused(capsys, *RUN, "--model", str(binary))
        == f"--model {binary}: not a text file (not UTF-8), so not a JSON file"
    )
    assert _refused(capsys, "--validate", str(binary)).startswith(f"--validate {binary}: not a text file")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"config": {}, "records": []}))
    assert _refused(capsys, "--validate", str(other)) == (
        f"--validate {other}: not a benchmarks/longest_sequence.py result (no rows, budget_bytes)"
    )


def test_library_functions_refuse_the_same_values():
    model = plan.Model(**plan.KNOWN["llama-3-8b"])
    cases = [
        (
            lambda: plan.plan(model, plan.Layout(), -5, 1),
            "seq_len -5: must be a positive integer (tokens per sequence)",
        ),
        (lambda: plan.plan(model, plan.Layout(), 1024, 1, batch=0), "batch 0: must be a positive integer"),
        (lambda: plan.plan(model, plan.Layout(), 1024, 0), "gpus 0: must be a positive integer"),
        (lambda: plan.plan(model, plan.Layout(sp=4), 1024, 6), "gpus 6: must be a multiple of sp x tp = 4 x 1"),
        (lambda: plan.plan(model, plan.Layout(tp=3), 1024, 3), "tp 3: must divide heads 32 and kv_heads 8"),
        (lambda: plan.plan(model, plan.Layout(sp=64), 1024, 64), "sp 64 with mode 'ulysses': Ulysses splits the 32"),
        (lambda: plan.plan(model, plan.Layout(), 1024, 1, act_bytes=3), "act_bytes 3: must be 2 (bf16) or 4 (fp32)"),
        (lambda: plan.Layout(sp=0), "sp 0: must be a positive integer"),
        (lambda: plan.Layout(mode="hybrid"), "mode 'hybrid': the planner counts one of 'ulysses', 'ring'"),
        (lambda: plan.Model(**{**plan.KNOWN["llama-3-8b"], "heads": 0}), "heads 0: must be a positive integer"),
        (lambda: plan.Model(**{**plan.KNOWN["llama-3-8b"], "kv_heads": 64}), "kv_heads 64: must divide heads = 32"),
        (lambda: plan.Model(**{**plan.KNOWN["llama-3-8b"], "head_dim": 0}), "head_dim 0: must be a positive integer"),
        (lambda: plan.layouts(model, 0), "gpus 0: must be a positive integer"),
        (lambda: plan.recommend([], -1.0), "budget -1.0: must be a positive number"),
        (lambda: plan.longest(model, plan.Layout(), 0, 1), "budget 0: must be a positive number"),
        (lambda: plan.load_model("no-such-model"), "'no-such-model': not a config.json"),
        (lambda: plan.validate("no/such.json"), "no/such.json: no such file"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value).startswith(message), (str(error.value), message)


def test_exit_codes_of_python_m(monkeypatch, capsys):
    """`python -m seqpar_hf.plan` (run in this process): 0 with a recommendation, 1 when nothing fits (explained),
    2 for a bad argument; one line, no traceback."""

    def run(*argv):
        monkeypatch.setattr(sys, "argv", ["seqpar_hf.plan", *argv])
        sys.modules.pop("seqpar_hf.plan.__main__", None)
        with pytest.raises(SystemExit) as exit_:
            runpy.run_module("seqpar_hf.plan", run_name="__main__")
        out = capsys.readouterr()
        return exit_.value.code, out.out.splitlines(), out.err.splitlines()

    code, out, _ = run(*RUN)
    assert code == 0 and out[-5].startswith("recommended: sp=1, tp=1, tiled loss, dp=8") and out[-4] == "to run it:", (
        out
    )
    code, out, _ = run("--seq-len", "1000000", "--gpus", "1", "--gpu-memory", "8")
    assert code == 1 and out[-1] == (
        "nothing fits: the smallest peak, 575.9 GiB (sp=1, tp=1, checkpointing, tiled loss), "
        "is above the 7.2 GiB usable per rank (8 GiB less the 10% reserve); more ranks or a "
        "shorter sequence"
    ), out  # the run is bf16 already
    code, out, _ = run("--seq-len", "1000000", "--gpus", "1", "--gpu-memory", "8", "--dtype", "fp32")
    assert code == 1 and out[-1].endswith("; more ranks, a shorter sequence, or bf16"), out
    code, out, err = run("--seq-len", "-5", "--gpus", "8", "--gpu-memory", "80")
    assert (
        code == 2
        and out == []
        and err[-1]
        == ("python -m seqpar_hf.plan: error: --seq-len -5: must be a positive integer (tokens per sequence)")
    )


def test_recommendation_prints_how_to_run_it_and_the_columns(capsys, monkeypatch):
    """The recommended layout as flags, a launch and a patch_model call; a legend naming every column."""
    from seqpar_hf.plan import howto

    monkeypatch.setattr(howto, "checkpointing_flag", lambda: "--activation_checkpointing")  # transformers' own name
    best = plan.main(["--model", "llama-3-8b", "--seq-len", "131072", "--gpus", "8", "--gpu-memory", "80"])
    out = capsys.readouterr().out.splitlines()
    assert (best.layout.sp, best.layout.mode, best.layout.checkpointing, best.layout.tiled) == (
        2,
        "ulysses",
        True,
        True,
    )
    at = out.index("to run it:")
    assert out[at - 1].startswith("recommended: sp=2 ulysses, tp=1, checkpointing, tiled loss, dp=4")
    assert out[at + 1 :] == [
        "  flags:   --sp_size 2 --sp_mode ulysses --activation_checkpointing --bf16  (SequenceParallelArguments, the "
        "TRL configs, the recipes)",
        "  launch:  accelerate launch --num_processes 8 --use_fsdp --fsdp_version 2 <script> <flags>  (FSDP2 over dp x "
        "sp = 8 ranks)",
        "  python:  layout = seqpar_hf.ParallelLayout(sp_size=2, mode='ulysses'); seqpar_hf.patch_model(model, layout, "
        "tiled_loss=True); model.gradient_checkpointing_enable(); seqpar_hf.training.fsdp.shard_model(model, layout)",
    ]
    header = next(line for line in out if line.startswith("layout "))
    legend = out[out.index(howto.LEGEND.splitlines()[0]) : at - 1]
    assert [c for c in header.split()[1:] if c not in ("GiB", "at")] == [
        "states",
        "fsdp",
        "activ.",
        "logits",
        "comm",
        "peak",
    ]
    assert [line.split()[0] for line in legend if line.startswith("  ") and not line.startswith("   ")] == [
        "states",
        "fsdp",
        "activ.",
        "logits",
        "comm",
        "peak",
    ]


def test_tensor_parallel_and_small_logits_flags():
    """TP is a flag of its own and never gets the tiled loss (refused under TP); a tiled loss whose logits stay
    below the trainers' 'auto' threshold is asked for by name."""
    from seqpar_hf.plan import howto

    tp = howto.run_lines(plan.Layout(sp=2, tp=2, mode="ring", tiled=True), gpus=4, dtype="fp32", logits_per_rank=2**30)
    assert tp[1].split("  (")[0] == "  flags:   --sp_size 2 --sp_mode ring --tp_size 2"
    assert "tiled_loss" not in tp[3] and "(FSDP2 over dp x sp = 2 ranks)" in tp[2]
    small = howto.run_lines(plan.Layout(tiled=True), gpus=1, dtype="bf16", logits_per_rank=1000)
    assert "patch the model with tiled_loss=True before the trainer" in small[1]
    assert (
        small[2] == "  launch:  accelerate launch --num_processes 1 <script> <flags>" and "shard_model" not in small[3]
    )


def test_old_flag_spelling_is_the_same_flag(capsys):
    plan.main([*RUN, "--kv_heads", "4", "--head_dim", "64"])
    old = capsys.readouterr().out
    plan.main([*RUN, "--kv-heads", "4", "--head-dim", "64"])
    assert capsys.readouterr().out == old and "32/4 heads" in old


def test_offload_and_tiled_mlp_fit_llama_3_8b_at_4m_tokens_on_8_ranks(capsys):
    """ALST (arXiv 2506.13996): 3.8M tokens with both on 8 x H100 80GB; neither alone reaches 4M."""
    argv = ["--model", "llama-3-8b", "--seq-len", "4194304", "--gpus", "8", "--gpu-memory", "80"]
    assert plan.main(argv) is None
    assert plan.main([*argv, "--offload-activations"]) is None
    assert plan.main([*argv, "--tiled-mlp"]) is None
    best = plan.main([*argv, "--offload-activations", "--tiled-mlp"])
    assert best is not None and best.layout.sp == 8 and best.layout.offload and best.layout.tiled_mlp
    out = capsys.readouterr().out
    assert "--sp_offload_activations --sp_tiled_mlp true" in out
    assert "GiB of pinned host memory per node (8 ranks)" in out and "hidden behind the compute" in out


def test_offload_says_when_the_copies_outlast_the_compute():
    from seqpar_hf.plan import offload
    from seqpar_hf.plan.configs import load_model
    from seqpar_hf.plan.memory import Layout, Model

    layout = Layout(8, checkpointing=True, offload=True)
    big = offload.traffic(load_model("llama-3-8b"), layout, 8192, 8, 2)
    assert big.hidden and big.pcie_bytes_per_step == 2 * 32 * 1024 * 4096 * 2  # both ways, each layer's [s/sp, h]
    # a narrow model computes too little per byte of its layer inputs (~24 h^2 flops per token and layer)
    small = offload.traffic(Model(256, 8, 4, 4, 64, 1024, 32000), layout, 2048, 8, 2)
    assert not small.hidden and "SLOWER than the compute it overlaps" in offload.describe(small)


def test_offload_needs_checkpointing():
    from seqpar_hf.plan.memory import Layout

    with pytest.raises(ValueError, match="offload: the offloaded tensors are the checkpointed layer inputs"):
        Layout(8, offload=True)
