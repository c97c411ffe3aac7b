"""In-rank bodies of tests/test_robustness_gloo.py: bad input fails fast with a clear error on every
rank (never a hang, never a wrong number); odd but valid input matches the unpatched model; what the
per-forward check costs in collectives and bytes."""

from __future__ import annotations

import contextlib
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import seqpar_hf

from ..helpers.collectives import counting
from ..helpers.models import VOCAB, build_model, make_batch


@contextlib.contextmanager
def fused_scan():
    """Qwen3-Next's scan called where the split does not see it (the same computation under another name, as a
    fused kernel would be); yields the warnings raised meanwhile."""
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next

    original = qwen3_next.torch_chunk_gated_delta_rule
    fused = original.forward
    qwen3_next.torch_chunk_gated_delta_rule = lambda *a, **k: fused(*a, **k)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            yield seen
    finally:
        qwen3_next.torch_chunk_gated_delta_rule = original


def attempt(fn):
    """(message or None, seconds) of `fn`; the ranks start together, so a rank's seconds are its own wait."""
    dist.barrier()
    start = time.time()
    try:
        fn()
        return None, time.time() - start
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}", time.time() - start


def per_rank(values):
    """This rank's value of a (rank 0, rank 1) pair."""
    return values[dist.get_rank()]


def mixers_decided_apart(rank: int):
    """Rank 1's scan kernel fails its check at patch_model (it drops the incoming state): its DeltaNet splits by
    heads, rank 0's along the sequence; the first forward must raise on both ranks, not run mismatched
    collectives."""
    from seqpar_hf.models.mixers import kernels, scan

    from ..helpers.kernels import Calls, dispatcher, gated_delta_rule_kernel

    layout = seqpar_hf.ParallelLayout(sp_size=2)
    model = build_model("qwen3_5")
    module = next(m for m in model.modules() if "torch_chunk_gated_delta_rule" in scan.find(m))
    space = scan.global_space(module)
    original = space["torch_chunk_gated_delta_rule"]
    if rank == 1:
        ref = kernels.reference(original)
        space["torch_chunk_gated_delta_rule"] = dispatcher(
            ref, gated_delta_rule_kernel(ref, Calls(), ignores_state=True)
        )
    try:
        seqpar_hf.patch_model(model, layout)
    finally:
        space["torch_chunk_gated_delta_rule"] = original
    return lambda: model(**make_batch("qwen3_5", seed=0))


def layout_cases(results: dict) -> None:
    results["world-not-divisible"] = attempt(lambda: seqpar_hf.ParallelLayout(sp_size=4))
    results["ring-size-not-dividing"] = attempt(lambda: seqpar_hf.ParallelLayout(sp_size=2, mode="hybrid", ring_size=3))
    results["unknown-mode"] = attempt(lambda: seqpar_hf.ParallelLayout(sp_size=2, mode="stripes"))
    results["layout-modes-differ"] = attempt(
        lambda: seqpar_hf.ParallelLayout(sp_size=2, mode=per_rank(("ulysses", "ring")))
    )
    results["layout-sp-sizes-differ"] = attempt(lambda: seqpar_hf.ParallelLayout(sp_size=per_rank((2, 1))))
    results["layout-mixer-splits-differ"] = attempt(  # the ranks would run different collectives in the mixers
        lambda: seqpar_hf.ParallelLayout(sp_size=2, mixer_split=per_rank(("auto", "heads")))
    )
    results["layout-tp-vs-sp"] = attempt(
        lambda: seqpar_hf.ParallelLayout(**per_rank(({"sp_size": 2}, {"sp_size": 1, "tp_size": 2})))
    )
    results["layout-one-rank-invalid"] = attempt(lambda: seqpar_hf.ParallelLayout(sp_size=per_rank((4, 2))))

    def built_in_another_order():  # rank 0 builds (sp 1, sp 2), rank 1 (sp 2, sp 1): both fail, twice
        errors = []
        for sp in per_rank(((1, 2), (2, 1))):
            try:
                seqpar_hf.ParallelLayout(sp_size=sp)
            except ValueError as exc:
                errors.append(str(exc))
        if len(errors) == 2:
            raise ValueError(" | ".join(errors))

    results["layouts-in-another-order"] = attempt(built_in_another_order)
    results["layout-bad-timeout"] = attempt(lambda: seqpar_hf.ParallelLayout(sp_size=2, timeout=5))


def fingerprint_cases(results: dict, layout) -> None:
    def run(family, batch_fn, model_fn=None, call=None, **patch):
        model = seqpar_hf.patch_model(build_model(family), layout, **patch)
        if model_fn is not None:
            model_fn(model)
        return lambda: (call or (lambda m, b: m(**b)))(model, batch_fn())

    rank = dist.get_rank()
    marian = lambda **kw: make_batch("marian", seed=0, **kw)
    llama = lambda **kw: make_batch("llama", seed=0, **kw)

    def without_mask_on_rank_1():
        batch = marian()
        if rank == 1:
            batch.pop("attention_mask")
        return batch

    def int32_on_rank_1():
        batch = marian()
        batch["input_ids"] = batch["input_ids"].to(torch.int32 if rank == 1 else torch.int64)
        return batch

    def shift_labels_on_rank_1():
        batch = llama()
        if rank == 1:
            batch["shift_labels"] = torch.cat([batch["labels"][:, 1:], torch.full((3, 1), -100)], 1)
        return batch

    results["different-lengths"] = attempt(run("marian", lambda: marian(src_len=13 if rank == 0 else 11)))
    results["mask-on-one-rank"] = attempt(run("marian", without_mask_on_rank_1))
    results["different-token-ids"] = attempt(run("marian", lambda: make_batch("marian", seed=rank)))
    results["different-dtypes"] = attempt(run("marian", int32_on_rank_1))
    results["shift-labels-on-one-rank"] = attempt(run("llama", shift_labels_on_rank_1))
    results["num-items-differ"] = attempt(run("llama", lambda: {**llama(), "num_items_in_batch": 6 + rank}))
    results["num-items-tensor-differ"] = attempt(
        run("llama", lambda: {**llama(), "num_items_in_batch": torch.tensor(6 + rank)})
    )
    results["label-smoothing-differs"] = attempt(run("llama", lambda: {**llama(), "label_smoothing": 0.1 * rank}))
    results["training-mode-differs"] = attempt(run("llama", llama, model_fn=lambda m: m.train(rank == 0)))
    results["logits-to-keep-on-one-rank"] = attempt(run("llama", lambda: {**llama(), "logits_to_keep": rank}))
    results["output-hidden-states-on-one-rank"] = attempt(
        run("llama", lambda: {**llama(), "output_hidden_states": rank == 1})
    )
    results["tiled-loss-differs"] = attempt(run("llama", llama, model_fn=lambda m: m.train(), tiled_loss=rank == 0))
    results["lm-loss-differs"] = attempt(run("llama", llama, lm_loss=rank == 0))
    results["tiled-mlp-differs"] = attempt(run("llama", llama, model_fn=lambda m: m.train(), tiled_mlp=rank == 0))
    results["token-mixers-differ"] = attempt(mixers_decided_apart(rank))

    def checkpointing_on_rank_0(model):  # offload needs it: rank 1 alone would refuse (before: a hang)
        model.train()
        if rank == 0:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    results["offload-without-checkpointing-on-one-rank"] = attempt(
        run("llama", llama, model_fn=checkpointing_on_rank_0, offload_activations=True)
    )
    results["attention-set-on-one-rank"] = attempt(
        run("llama", llama, model_fn=lambda m: m.set_attn_implementation("sdpa") if rank == 1 else None)
    )
    results["attention-set-after-patch"] = attempt(
        run("llama", llama, model_fn=lambda m: m.set_attn_implementation("sdpa"))
    )
    results["attention-config-after-patch"] = attempt(
        run("marian", marian, model_fn=lambda m: setattr(m.config, "_attn_implementation", "eager"))
    )

    def other_layout_object():  # same sizes, another layout object (its group is the same: the world)
        second = seqpar_hf.ParallelLayout(sp_size=2)
        model = seqpar_hf.patch_model(build_model("llama"), layout if rank == 0 else second)
        return lambda: model(**llama())

    results["patched-with-another-layout"] = attempt(other_layout_object())
    tp = seqpar_hf.ParallelLayout(sp_size=1, tp_size=2)  # a replica of 2 TP ranks (no SP group): checked too
    tp_model = seqpar_hf.patch_model(build_model("llama"), tp)
    results["tp-ranks-different-batches"] = attempt(lambda: tp_model(**make_batch("llama", seed=rank)))
    results["logits-to-keep-with-labels"] = attempt(run("llama", lambda: {**llama(), "logits_to_keep": 1}))
    results["output-attentions"] = attempt(run("llama", lambda: {**llama(), "output_attentions": True}))
    results["mask-4d"] = attempt(run("llama", lambda: {**llama(), "attention_mask": torch.ones(3, 1, 11, 11)}))


def validation_batches() -> dict:
    """Bad batches that the unpatched model rejects (or accepts with a silently different meaning):
    name -> (family, batch). Also tier 1: tests/test_validate.py compares the error classes."""
    llama, marian = make_batch("llama", seed=0), make_batch("marian", seed=0)
    ids, labels = llama["input_ids"], llama["labels"]

    def at(x, col, value):  # one token changed, in rank 1's half of the sequence
        x = x.clone()
        x[0, col] = value
        return x

    return {
        "causal-labels-longer": ("llama", {"input_ids": ids, "labels": torch.cat([labels, labels[:, :1]], 1)}),
        "causal-labels-shorter": ("llama", {"input_ids": ids, "labels": labels[:, :-1]}),
        "causal-labels-much-longer": ("llama", {"input_ids": ids[:, :3], "labels": labels}),
        "causal-labels-batch": ("llama", {"input_ids": ids, "labels": labels[:2]}),
        "shift-labels-shorter": ("llama", {"input_ids": ids, "shift_labels": labels[:, :-1]}),
        "position-ids-shorter": ("llama", {"input_ids": ids, "labels": labels, "position_ids": torch.arange(10)[None]}),
        "position-ids-batch": (
            "llama",
            {"input_ids": ids, "labels": labels, "position_ids": torch.arange(11)[None].repeat(2, 1)},
        ),
        "attention-mask-shorter": ("llama", {**llama, "attention_mask": llama["attention_mask"][:, :-1]}),
        "empty-sequence": ("llama", {"input_ids": ids[:, :0], "labels": labels[:, :0]}),
        "empty-batch": ("llama", {"input_ids": ids[:0], "labels": labels[:0]}),
        "float-input-ids": ("llama", {"input_ids": ids.float(), "labels": labels}),
        "input-ids-1d": ("llama", {"input_ids": ids[0], "labels": labels[0]}),
        "float-labels": ("llama", {"input_ids": ids, "labels": labels.float()}),
        "id-past-vocab-second-half": ("llama", {"input_ids": at(ids, 9, VOCAB + 3), "labels": labels}),
        "id-minus-one": ("llama", {"input_ids": at(ids, 9, -1), "labels": labels}),
        "label-past-vocab-second-half": ("llama", {"input_ids": ids, "labels": at(labels, 9, VOCAB)}),
        "label-minus-five": ("llama", {"input_ids": ids, "labels": at(labels, 9, -5)}),
        "seq2seq-decoder-longer-than-labels": (
            "marian",
            {**marian, "decoder_input_ids": torch.cat([marian["labels"], marian["labels"][:, :2]], 1).clamp(min=0)},
        ),
        "seq2seq-labels-batch": ("marian", {**marian, "labels": marian["labels"][:2]}),
        "seq2seq-empty-source": ("marian", {"input_ids": marian["input_ids"][:, :0], "labels": marian["labels"]}),
        "seq2seq-empty-labels": ("marian", {**marian, "labels": marian["labels"][:, :0]}),
        "seq2seq-decoder-mask-shorter": (
            "marian",
            {**marian, "decoder_attention_mask": torch.ones(3, 5, dtype=torch.long)},
        ),
        "seq2seq-decoder-id-past-vocab": (
            "marian",
            {**marian, "decoder_input_ids": at(marian["labels"].clamp(min=0), 7, VOCAB)},
        ),
        "seq2seq-label-past-vocab": ("marian", {**marian, "labels": at(marian["labels"], 6, VOCAB)}),
        "source-past-position-table": (
            "marian",
            {"input_ids": torch.randint(3, VOCAB, (1, 200)), "labels": marian["labels"][:1]},
        ),
        "bart-target-past-position-table": (
            "bart",
            {"input_ids": marian["input_ids"], "labels": torch.randint(3, VOCAB, (3, 129))},
        ),
        "gpt2-past-n-positions": ("gpt2", {"input_ids": ids.repeat(1, 7), "labels": labels.repeat(1, 7)}),
    }


def build(family: str):
    """`build_model`, and a tiny GPT-2 (learned positions of n_positions=64 rows)."""
    if family != "gpt2":
        return build_model(family)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=2,
            attn_implementation="sdpa",
        )
    )


def validation_cases(results: dict, layout) -> None:
    """Every rank holds the same full batch: the same error on every rank, before any other collective."""

    def run(family, batch, **patch):
        model = seqpar_hf.patch_model(build(family), layout, **patch)
        return lambda: model(**batch)

    batches = validation_batches()
    for name, (family, batch) in batches.items():
        results[name] = attempt(run(family, batch))
    family, batch = batches["id-past-vocab-second-half"]
    results["bad-id-without-check-inputs"] = attempt(run(family, batch, check_inputs=False))


def timeout_case(results: dict) -> None:
    """A rank that skips a forward: the other times out in the fingerprint's all-gather, with the reason.
    On its own group (a gloo group that timed out is closed), with a 2-second timeout."""
    from seqpar_hf.models.forward.checks import check_same_batch, forward_settings
    from seqpar_hf.models.forward.state import state_of

    group = dist.new_group([0, 1])
    dist.barrier(group=group)
    group.set_timeout(timedelta(seconds=2))
    layout = seqpar_hf.ParallelLayout(sp_size=2)
    model = seqpar_hf.patch_model(build_model("llama"), layout)
    state = state_of(model)
    settings = forward_settings(state, False, {})

    def forward_on_rank_0_only():
        if dist.get_rank() == 0:
            check_same_batch(make_batch("llama", seed=0), settings, group, torch.device("cpu"))
        else:
            time.sleep(4)  # past the other's timeout: it reports, this one has nothing to report
            raise RuntimeError("skipped the forward")

    results["rank-skips-a-forward"] = attempt(forward_on_rank_0_only)


def fingerprint_cost() -> dict:
    """Collectives and bytes sent per rank in one training forward, with and without the check."""
    layout = seqpar_hf.ParallelLayout(sp_size=2)
    out = {}
    for check in (True, False):
        model = seqpar_hf.patch_model(build_model("marian"), layout, check_inputs=check)
        batch = make_batch("marian", seed=0)
        with counting() as calls:
            model(**batch)
        out[check] = calls
    return out


def tokenizer_case(results: dict) -> None:
    """The translation recipes' data check: ranks whose caches trained different BPE merges (a cache built per
    node) stop before training, on every rank; the same tokenizer passes."""
    from recipes import translation_data as td  # imported first: the check's seconds are its own

    texts = ["the cat sat on the mat .", "le chat est assis sur le tapis ."] * 3
    same, mine = td.train_tokenizer(texts, 40), td.train_tokenizer(texts, per_rank((40, 45)))
    results["tokenizer-same"] = attempt(lambda: td.check_same_tokenizer(same, torch.device("cpu")))
    results["tokenizers-differ"] = attempt(lambda: td.check_same_tokenizer(mine, torch.device("cpu")))


def bad_inputs():
    from . import checkpoints, divergence

    results = {}
    layout_cases(results)
    layout = seqpar_hf.ParallelLayout(sp_size=2)
    fingerprint_cases(results, layout)
    validation_cases(results, layout)
    tokenizer_case(results)

    def submodule_called_directly():  # what a library that skips the patched forward would do
        model = seqpar_hf.patch_model(build_model("llama"), layout)
        hidden = torch.randn(2, 6, model.config.hidden_size)
        model.model.layers[0](hidden, position_embeddings=model.model.rotary_emb(hidden, torch.arange(6)[None]))

    results["submodule-called-directly"] = attempt(submodule_called_directly)

    def mixers_with_cu_seq_lens():  # a kernel that reads cu_seqlens would reset its state per document
        model = seqpar_hf.patch_model(build_model("qwen3_5"), layout)
        ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
        model(input_ids=ids, labels=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu)

    results["mixers-cu-seq-lens"] = attempt(mixers_with_cu_seq_lens)

    def halo_conv_not_seen():  # a fused kernel (causal-conv1d) computing the convolution without its halo
        import copy
        import warnings

        import transformers.models.lfm2.modeling_lfm2 as lfm2

        from conformance.tiny import build_tiny

        plain = build_tiny("lfm2", "Lfm2ForCausalLM")[0].float()
        model = seqpar_hf.patch_model(copy.deepcopy(plain), layout)
        assert set(seqpar_hf.models.patch.state_of(model).mixers.values()) == {"sequence"}  # split along the sequence
        ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(0))
        original = lfm2.causal_conv1d_fn
        lfm2.causal_conv1d_fn = lambda x, w, b=None, **kw: x * w[..., -1:] + (0 if b is None else b[:, None])
        try:
            want = plain(input_ids=ids, labels=ids).loss
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                got = model(input_ids=ids, labels=ids).loss
        finally:
            lfm2.causal_conv1d_fn = original
        assert abs(float(got) - float(want)) < 1e-6, (float(got), float(want))
        said = [str(w.message) for w in seen]
        assert any("a fused kernel" in m and "runs split by heads instead" in m for m in said), said

    results["halo-conv-not-seen"] = attempt(halo_conv_not_seen)

    def scan_not_seen_and_heads():  # a fused kernel computing the scan unseen; then the split by heads, in gloo
        import copy

        from conformance.tiny import build_tiny
        from seqpar_hf.models.mixers import halo, scan

        plain = build_tiny("qwen3_next", "Qwen3NextForCausalLM")[0].float()
        ids = torch.randint(3, 64, (2, 13), generator=torch.Generator().manual_seed(0))
        want = plain(input_ids=ids, labels=ids).loss
        model = seqpar_hf.patch_model(copy.deepcopy(plain), layout)
        assert set(seqpar_hf.models.patch.state_of(model).mixers.values()) == {"sequence"}
        with fused_scan() as seen:
            got = model(input_ids=ids, labels=ids).loss
        assert abs(float(got) - float(want)) < 1e-6, (float(got), float(want))
        said = [str(w.message) for w in seen]  # the head split, proven too, takes over from the fused kernel
        assert any("its scan ran 0 times" in m and "runs split by heads instead" in m for m in said), said
        by_heads = seqpar_hf.ParallelLayout(sp_size=2, mixer_split="heads")  # asked for (faster for Mamba2 on GPU)
        heads = seqpar_hf.patch_model(copy.deepcopy(plain), by_heads)
        assert set(seqpar_hf.models.patch.state_of(heads).mixers.values()) == {"heads"}
        got = heads(input_ids=ids, labels=ids).loss
        assert abs(float(got) - float(want)) < 1e-6, (float(got), float(want))
        find, conv = scan.find, halo.depthwise_conv
        scan.find, halo.depthwise_conv = (lambda module: {}), (lambda module: None)  # not proven along the sequence
        try:
            heads = seqpar_hf.patch_model(copy.deepcopy(plain), layout)
        finally:
            scan.find, halo.depthwise_conv = find, conv
        assert set(seqpar_hf.models.patch.state_of(heads).mixers.values()) == {"heads"}

    results["scan-not-seen-and-heads"] = attempt(scan_not_seen_and_heads)

    def scan_not_seen_in_generate():  # the fused kernel in generation's prompt forward: the cache layer put back
        import copy

        from conformance.tiny import build_tiny
        from seqpar_hf.models.mixers import sequence

        plain = build_tiny("qwen3_next", "Qwen3NextForCausalLM")[0].float().eval()
        ids = torch.randint(3, 64, (2, 13), generator=torch.Generator().manual_seed(0))
        kwargs = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        want = plain.generate(input_ids=ids, **kwargs)
        model = seqpar_hf.patch_model(copy.deepcopy(plain), layout)
        with fused_scan() as seen:
            got = model.generate(input_ids=ids, **kwargs)
        assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
        mixers = [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), sequence.SequenceMixer)]
        assert mixers and not any(m.prefill or m.prompts_split for m in mixers)  # prompts now run the mixer whole
        for i in range(len(want.cache.layers)):  # the states: the whole prompt's, once (the split's put back)
            theirs = sequence.cache_states(want.cache, i)
            if not isinstance(theirs, str):
                mine = sequence.cache_states(got.cache, i)
                assert not isinstance(mine, str) and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(mine, theirs))
        said = [str(w.message) for w in seen]
        assert any("in generation's prompt forward" in m and "its scan ran 0 times" in m for m in said), said

    results["scan-not-seen-in-generate"] = attempt(scan_not_seen_in_generate)

    def custom_attention():
        from transformers import AttentionInterface

        AttentionInterface.register("my_kernel", AttentionInterface["sdpa"])
        model = build_model("marian")
        model.set_attn_implementation("my_kernel")
        seqpar_hf.patch_model(model, layout)

    results["unsupported-attention"] = attempt(custom_attention)
    checkpoints.cases(results)
    divergence.cases(results)
    timeout_case(results)

    def no_process_group():
        model = seqpar_hf.patch_model(build_model("marian"), layout)
        batch = make_batch("marian", seed=0)
        dist.barrier()
        dist.destroy_process_group()  # last case: nothing after it needs the group
        model(**batch)

    results["no-process-group"] = attempt(no_process_group)
    return results


def odd_inputs():
    """Valid corner cases: loss as the unpatched model gives it (value, or NaN exactly where it gives NaN)."""
    import copy

    layout = seqpar_hf.ParallelLayout(sp_size=2)
    out = {}

    def compare(name, family, batch, dtype=torch.float32, embeds=False):
        model = build_model(family).to(dtype)
        reference = copy.deepcopy(model)
        seqpar_hf.patch_model(model, layout)
        inputs = dict(batch)
        if embeds:  # decoder-only: the embeddings are the model's input as they are
            inputs["inputs_embeds"] = model.get_input_embeddings()(inputs.pop("input_ids")).detach()
        got = model(**inputs).loss
        want = reference(**inputs).loss
        got.backward() if torch.isfinite(got) else None
        out[name] = (got.item(), want.item())

    compare("batch-size-1", "marian", make_batch("marian", seed=1, batch=1, pad=False))
    compare("shorter-than-sp", "llama", make_batch("llama", seed=1, length=1, pad=False))
    half = make_batch("marian", seed=1, src_len=4, tgt_len=3, pad=False)
    half["attention_mask"][:, 2:] = 0  # rank 1's source shard is all padding, for every sample
    compare("shard-all-padding", "marian", half)
    labels_half = make_batch("marian", seed=2, tgt_len=8, pad=False)
    labels_half["labels"][:, 4:] = -100  # rank 1 holds no label
    compare("labels-ignored-on-one-rank", "marian", labels_half)
    none = make_batch("llama", seed=2)
    none["labels"][:] = -100
    compare("labels-ignored-everywhere", "llama", none)
    compare("bf16", "llama", make_batch("llama", seed=3), dtype=torch.bfloat16)
    compare("inputs-embeds", "llama", make_batch("llama", seed=4), embeds=True)
    full = make_batch("bart", seed=5, src_len=128, tgt_len=128, batch=1, pad=False)  # exactly the table
    compare("bart-at-position-table", "bart", full)
    out["cost"] = fingerprint_cost()
    return out
