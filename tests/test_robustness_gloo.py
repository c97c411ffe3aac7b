"""Tier 2: bad input fails fast with a clear error on every rank (never a hang, never a wrong number); odd
but valid input works; the per-forward check costs one small all-gather. In-rank bodies:
tests/runs/robustness.py and tests/runs/checkpoints.py (the `misc` group, 2 ranks). Each row of the
README's Robustness table names its case here."""

from __future__ import annotations

import math
import re

import pytest

FINGERPRINT = r"ranks of one replica .* got different batches or settings \("
LAYOUTS = r"ranks disagree on the ParallelLayout they build \("
ATTENTION_CHANGED = (
    r"RuntimeError: the attention implementation of this patched model was changed to '{}' after patch_model"
)
# the weights' checksum, compared with every forward's fingerprint: the same error on every rank
WEIGHTS = (
    r"RuntimeError: ranks of one replica hold different weights \(a checksum of every parameter differs: "
    r"rank 0: [0-9a-f]{8}, rank 1: [0-9a-f]{8}\): the replica has diverged\. Likely causes: a trainer that is "
    r"not sequence-parallel aware .*train with seqpar_hf\.SequenceParallelTrainer .*optimizer settings .*differ "
    r"per rank"
)
# case -> message (regex) on every rank
EXPECTED = {
    # layouts: compared before the mesh is built
    "world-not-divisible": "ValueError: world size 2 is not divisible by sp_size=4",
    "ring-size-not-dividing": "ValueError: ring_size=3 does not divide sp_size=2",
    "unknown-mode": "ValueError: unknown sequence-parallel mode 'stripes'",
    "layout-modes-differ": LAYOUTS + "mode: rank 0: 'ulysses', rank 1: 'ring'",
    "layout-sp-sizes-differ": LAYOUTS + "sp_size: rank 0: 2, rank 1: 1",
    "layout-mixer-splits-differ": LAYOUTS + "mixer_split: rank 0: 'auto', rank 1: 'heads'",
    "layout-tp-vs-sp": LAYOUTS + "sp_size: rank 0: 2, rank 1: 1; tp_size: rank 0: 1, rank 1: 2",
    "layout-one-rank-invalid": LAYOUTS + "sp_size: rank 0: 4, rank 1: 2",
    "layouts-in-another-order": LAYOUTS
    + "sp_size: rank 0: 1, rank 1: 2.* \\| "
    + LAYOUTS
    + "sp_size: rank 0: 2, rank 1: 1",
    "layout-bad-timeout": "ValueError: timeout=5: pass a positive datetime.timedelta",
    # the per-forward fingerprint, over the replica
    "different-lengths": FINGERPRINT + r"input_ids shapes differ: rank 0: \(3, 13\), rank 1: \(3, 11\)",
    "mask-on-one-rank": FINGERPRINT + r"attention_mask given on ranks \[0\] only",
    "different-token-ids": FINGERPRINT + "input_ids values differ",
    "different-dtypes": FINGERPRINT + "input_ids dtypes differ: rank 0: torch.int64, rank 1: torch.int32",
    "shift-labels-on-one-rank": FINGERPRINT + r"shift_labels given on ranks \[1\] only",
    "num-items-differ": FINGERPRINT + "num_items_in_batch differs: rank 0: 6, rank 1: 7",
    "num-items-tensor-differ": FINGERPRINT + "num_items_in_batch differs: rank 0: 6, rank 1: 7",
    "label-smoothing-differs": FINGERPRINT + "label_smoothing differs: rank 0: 0.0, rank 1: 0.1",
    "training-mode-differs": FINGERPRINT + "model.training differs: rank 0: 1, rank 1: 0",
    "logits-to-keep-on-one-rank": FINGERPRINT + "logits_to_keep differs: rank 0: 0, rank 1: 1",
    "output-hidden-states-on-one-rank": FINGERPRINT + "output_hidden_states differs: rank 0: 0, rank 1: 1",
    "tiled-loss-differs": FINGERPRINT + r"tiled loss differs: rank 0: \(True, .*rank 1: \(False",
    "lm-loss-differs": FINGERPRINT + "labels given on ranks .0. only; lm_loss differs: rank 0: 1, rank 1: 0",
    "tiled-mlp-differs": FINGERPRINT + r"tiled_mlp differs: rank 0: True \(\d+ MLPs tiled\), rank 1: False",
    "token-mixers-differ": FINGERPRINT
    + r"token mixers differs: rank 0: 1 split along the sequence, 0 by heads, rank 1: 0 split along the sequence, "
    r"1 by heads",
    "offload-without-checkpointing-on-one-rank": FINGERPRINT
    + r"offload_activations differs: rank 0: True \(\d+ layers checkpointed\), rank 1: True \(0 layers",
    "attention-set-on-one-rank": FINGERPRINT + "attention implementation differs: rank 0: seqpar_hf, rank 1: sdpa",
    "tp-ranks-different-batches": FINGERPRINT + "input_ids values differ",
    "patched-with-another-layout": FINGERPRINT + r"layout differs: rank 0: layout #\d+ .*rank 1: layout #\d+",
    "attention-set-after-patch": ATTENTION_CHANGED.format("sdpa"),
    "attention-config-after-patch": ATTENTION_CHANGED.format("eager"),
    "logits-to-keep-with-labels": "ValueError: logits_to_keep is not supported with labels",
    "output-attentions": "NotImplementedError: output_attentions is not available",
    "mask-4d": r"ValueError: seqpar_hf takes 2D padding masks .* 4D mask of shape \(3, 1, 11, 11\)",
    # the full batch, validated before sharding (classes: those of the unpatched model, tests/test_validate.py)
    "causal-labels-longer": r"ValueError: labels of shape \(3, 12\) do not match input_ids of shape \(3, 11\)",
    "causal-labels-shorter": r"ValueError: labels of shape \(3, 10\) do not match input_ids of shape \(3, 11\)",
    "causal-labels-much-longer": r"ValueError: labels of shape \(3, 11\) do not match input_ids of shape \(3, 3\)",
    "causal-labels-batch": r"ValueError: labels of shape \(2, 11\) do not match input_ids of shape \(3, 11\)",
    "shift-labels-shorter": r"ValueError: shift_labels of shape \(3, 10\) do not match input_ids of shape \(3, 11\)",
    "position-ids-shorter": r"RuntimeError: position_ids of shape \(1, 10\) does not match input_ids of shape "
    r"\(3, 11\)",
    "position-ids-batch": r"RuntimeError: position_ids of shape \(2, 11\) does not match input_ids",
    "attention-mask-shorter": r"ValueError: attention_mask of shape \(3, 10\) does not match input_ids .*pad a shorter",
    "empty-sequence": r"RuntimeError: input_ids of shape \(3, 0\) holds no token",
    "empty-batch": r"RuntimeError: input_ids of shape \(0, 11\) holds no token",
    "float-input-ids": "RuntimeError: input_ids must hold integer ids .* got torch.float32",
    "input-ids-1d": r"RuntimeError: input_ids must be 2D \[batch, length\], got shape \(11,\)",
    "float-labels": "RuntimeError: labels must hold integer ids .* got torch.float32",
    "id-past-vocab-second-half": r"IndexError: input_ids holds ids from 0 to 100, but the token embedding has 97 rows",
    "id-minus-one": r"IndexError: input_ids holds ids from -1 to \d+, but the token embedding has 97 rows",
    "label-past-vocab-second-half": r"IndexError: labels \(after the causal shift\) hold values from \d+ to 97, but "
    "the LM head has 97 outputs",
    "label-minus-five": r"IndexError: labels \(after the causal shift\) hold values from -5 to",
    "seq2seq-decoder-longer-than-labels": r"ValueError: labels of shape \(3, 9\) do not match decoder_input_ids of "
    r"shape \(3, 11\)",
    "seq2seq-labels-batch": r"RuntimeError: labels of shape \(2, 9\) and input_ids of shape \(3, 13\)",
    "seq2seq-empty-source": r"RuntimeError: input_ids of shape \(3, 0\) holds no token",
    "seq2seq-empty-labels": r"IndexError: labels of shape \(3, 0\) hold no token",
    "seq2seq-decoder-mask-shorter": r"ValueError: decoder_attention_mask of shape \(3, 5\) does not match labels of "
    r"shape \(3, 9\)",
    "seq2seq-decoder-id-past-vocab": "IndexError: decoder_input_ids holds ids from 0 to 97, but the decoder's token "
    "embedding has 97 rows",
    "seq2seq-label-past-vocab": r"IndexError: labels hold values from \d+ to 97, but the LM head has 97 outputs",
    "source-past-position-table": r"IndexError: input_ids has 200 tokens \(positions 0..199\), but "
    r"encoder.embed_positions \(MarianSinusoidalPositionalEmbedding\) holds positions 0..127",
    "bart-target-past-position-table": r"IndexError: labels has 129 tokens \(positions 0..128\), but "
    r"decoder.embed_positions \(BartLearnedPositionalEmbedding\) holds positions 0..127",
    "gpt2-past-n-positions": r"IndexError: input_ids has 77 tokens \(positions 0..76\), but wpe \(Embedding\) holds "
    "positions 0..63",
    "bad-id-without-check-inputs": "IndexError: input_ids holds ids from 0 to 100",
    # the patched model's structure and use
    "submodule-called-directly": "outside a sharded forward of the patched model.*sp_disabled",
    "unsupported-attention": "attn_implementation='my_kernel'",
    "no-process-group": "no process group is initialised",
    # the Trainer: saves, resumes, output_dir, layout arguments
    "save-fails-plain": r"OSError: saving .*/plain/checkpoint-2 failed on rank 0 \(nothing was written to "
    r".*\): rank 0: OSError: \[Errno 28\] No space left on device",
    "save-fails-tp": r"OSError: saving .*/tp/checkpoint-2 failed on rank 0 .*No space left on device",
    "save-fails-fsdp": r"OSError: saving .*/fsdp/checkpoint-2 failed on rank 0 .*No space left on device",
    "resume-missing-weight-plain": r"RuntimeError: the checkpoint .*/plain/checkpoint-1 misses 1 weight\(s\) of the "
    r"model: \['model.decoder.layers.0.encoder_attn.out_proj.bias'\]",
    "resume-missing-weight-tp": r"RuntimeError: the checkpoint .*/tp/checkpoint-1 misses 1 weight\(s\)",
    "resume-missing-weight-fsdp": r"RuntimeError: the checkpoint .*/fsdp/checkpoint-1 misses 1 weight\(s\)",
    "resume-unexpected-weight-plain": r"holds 1 the model does not have: \['model.no_such.weight'\]",
    "resume-numbered-optimizer-at-tp": r"ValueError: resuming from .*/plain/checkpoint-1 failed on ranks 0, 1: rank 0: "
    r"ValueError: .*/plain/checkpoint-1/optimizer.pt was written at another layout "
    r"and this run is at sp_size=1, tp_size=2, dp_size=1: it numbers the parameters "
    r".* Resume at the layout it was written at \(tp_size=1 without FSDP\)",
    "resume-truncated-weights-tp": r"ValueError: resuming from .*/tp/checkpoint-1 failed on ranks 0, 1: rank 0: "
    r"ValueError: .*/tp/checkpoint-1/model.safetensors cannot be read "
    r"\(SafetensorError: .*\): the file is truncated or corrupt",
    "save-model-fails": r"OSError: saving the model to .*plain-final failed on rank 0: rank 0: OSError: \[Errno 28\]",
    "output-dir-unwritable": r"NotADirectoryError: creating output_dir '.*a-file/out' failed on rank 0",
    "trainer-sp-sizes-differ": LAYOUTS + "sp_size: rank 0: 2, rank 1: 1",
    # ranks of a replica that would drift apart (tests/runs/divergence.py)
    "plain-trainer-diverges": WEIGHTS,
    "learning-rates-differ": WEIGHTS,
    "tp-norm-differs": WEIGHTS,
    "generate-and-forward": r"^RuntimeError: ranks of one replica are in different calls of the patched model \(rank 0 "
    r"is in generate, rank 1 is in a forward\)\. Every rank of a replica must make the same "
    r"calls with the same batch \(every forward, and generate, on every rank together\); "
    r"otherwise their collectives would mix or hang\.$",
    "trainer-learning-rates-differ": r"ValueError: ranks disagree on the training arguments "
    r"\(SequenceParallelArguments: learning_rate: rank 0: 0\.001, rank 1: 0\.002\)\. Every rank must train with "
    "the same arguments",
    "tokenizers-differ": r"ValueError: ranks disagree on the tokenizer \(tokenizer sha256: rank 0: '[0-9a-f]{16}', "
    r"rank 1: '[0-9a-f]{16}'\)\. Nodes that each built --data_cache_dir can train different BPE "
    r"merges: build the cache on one node .* and copy it to the others",
    "mixers-cu-seq-lens": r"NotImplementedError: cu_seq_lens_q / max_length_q with token mixers outside attention "
    r"\(Qwen3_5GatedDeltaNet\)",
}
# seconds, on the 2-core machine (shared: loads of 10 seen): the check itself; more where a Trainer trains or
# saves first, and where the process group is torn down (no-process-group)
SECONDS = {
    "save-fails-plain": 20,
    "save-fails-tp": 20,
    "save-fails-fsdp": 20,
    "output-dir-unwritable": 10,
    "trainer-sp-sizes-differ": 10,
    "unsupported-attention": 5,
    "submodule-called-directly": 5,
    "no-process-group": 10,
    "plain-trainer-diverges": 20,
    "learning-rates-differ": 5,
    "tp-norm-differs": 5,
    "generate-and-forward": 5,
    "trainer-learning-rates-differ": 10,
    "resume-numbered-optimizer-at-tp": 5,
    "resume-truncated-weights-tp": 5,
}


@pytest.fixture(scope="module")
def bad(spawned):
    return [r["bad"] for r in spawned("misc", 2)]


@pytest.mark.parametrize("case", list(EXPECTED))
def test_bad_input_raises_on_every_rank_quickly(bad, case):
    for rank_results in bad:
        message, seconds = rank_results[case]
        assert message is not None and re.search(EXPECTED[case], message), message
        assert seconds < SECONDS.get(case, 1.0), seconds


@pytest.mark.parametrize(
    "case",
    [
        "plain-trainer-diverges",
        "learning-rates-differ",
        "tp-norm-differs",
        "generate-and-forward",
        "trainer-learning-rates-differ",
    ],
)
def test_diverging_ranks_raise_the_same_error_on_every_rank(bad, case):
    assert bad[0][case][0] == bad[1][case][0]


def test_the_plain_trainer_stops_at_its_second_step(bad):
    """The plain transformers Trainer with a patched model, in processes it does not see as distributed (no DDP,
    no data split): each rank steps on its own shard's gradient; the second step's forward raises (WEIGHTS)."""
    for rank_results in bad:
        assert rank_results["plain-trainer-diverges-steps"] == ([1], False)  # one step done, no DDP wrapper
        assert rank_results["learning-rates-differ-steps"] == (1, None)  # per-rank learning rates: the same


def test_a_fused_convolution_kernel_runs_the_halo_mixer_by_channels(bad):
    """LFM2's convolution computed by a kernel that bypasses torch.nn.functional.conv1d (as causal-conv1d does on
    CUDA): the halo cannot apply, so the forward is redone split by channels (proven too; the kernel runs on each
    rank's channels), with a warning: one process's loss."""
    assert [rank_results["halo-conv-not-seen"][0] for rank_results in bad] == [None, None]


def test_a_scan_unseen_runs_by_heads_and_the_head_split_can_be_asked_for(bad):
    """Qwen3-Next's scan called where the split does not see it (a fused kernel under another name): redone split
    by heads, with a warning; the same model with `mixer_split="heads"` splits by heads, and with the split along
    the sequence hidden too: one process's loss every way."""
    assert [rank_results["scan-not-seen-and-heads"][0] for rank_results in bad] == [None, None]


def test_a_scan_unseen_in_generations_prompt_forward_puts_the_cache_back_and_runs_whole(bad):
    """Qwen3-Next's scan unseen in generation's prompt forward (a fused kernel): the cache layer the split had begun
    to fill is put back and the prompt runs the mixer whole, with a warning: the unpatched model's tokens and its
    cache's states (once, not the split's and the whole's both)."""
    assert [rank_results["scan-not-seen-in-generate"][0] for rank_results in bad] == [None, None]


def test_the_same_tokenizer_on_every_rank_passes(bad):
    assert [rank_results["tokenizer-same"][0] for rank_results in bad] == [None, None]


@pytest.mark.parametrize("path", ["plain", "tp", "fsdp"])
def test_a_failed_save_leaves_no_checkpoint_to_resume_from(bad, path):
    """checkpoint-1 complete, checkpoint-2 (whose optimizer write failed on rank 0) absent, and no partial folder."""
    for rank_results in bad:
        assert rank_results[f"save-fails-{path}-listing"][0] == "['checkpoint-1']"


def test_a_rank_that_skips_a_forward_makes_the_other_fail_with_the_reason(bad):
    """The one rank that waits raises when the group's timeout (here 2 s) is over, saying why ranks get there."""
    message, seconds = bad[0]["rank-skips-a-forward"]
    assert re.search(
        r"rank 0 timed out in the batch check at the start of a forward: the other ranks of its group "
        r"never joined .*disagreed.*Timed out waiting 2000ms",
        message,
    ), message
    assert 2 <= seconds < 4, seconds


@pytest.fixture(scope="module")
def odd(spawned):
    return [r["odd"] for r in spawned("misc", 2)]


@pytest.mark.parametrize(
    "case,tol",
    [
        ("batch-size-1", 1e-5),
        ("shorter-than-sp", 1e-5),
        ("shard-all-padding", 1e-5),
        ("labels-ignored-on-one-rank", 1e-5),
        ("labels-ignored-everywhere", 0),
        ("bf16", 2e-2),  # bf16: different summation order, 8 mantissa bits
        ("inputs-embeds", 1e-5),
        ("bart-at-position-table", 1e-5),
    ],
)
def test_odd_input_matches_the_unpatched_model(odd, case, tol):
    for rank_results in odd:
        got, want = rank_results[case]
        if math.isnan(want):
            assert math.isnan(got), (got, want)
        else:
            assert abs(got - want) <= tol * abs(want), (got, want)


def test_the_check_is_one_small_all_gather_per_forward(odd):
    """One training forward with labels (Marian, sp=2): the check adds exactly one collective, an all-gather
    of 912 bytes per rank (19 rows x 6 int64: the weights' checksum, generate's row and the memory options'
    settings included; was 16 rows, 768 bytes, without them)."""
    for rank_results in odd:
        with_check, without = rank_results["cost"][True], rank_results["cost"][False]
        added = list(with_check)
        for call in without:
            added.remove(call)
        assert len(with_check) == len(without) + 1 and len(added) == 1, (with_check, without)
        name, sent = added[0]
        assert name in ("all_gather_single", "all_gather_into_tensor") and sent == 912, added
