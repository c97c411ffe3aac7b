"""In-rank bodies of tests/test_robustness_gloo.py: bad input fails fast with a clear error on every
rank (never a hang, never a wrong number); odd but valid input matches the unpatched model."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import seqpar_hf

from ..helpers.models import build_model, make_batch

def _attempt(fn):
    start = time.time()
    try:
        fn()
        return None, time.time() - start
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}", time.time() - start


def bad_inputs():
    rank = dist.get_rank()
    results = {}
    results["world-not-divisible"] = _attempt(lambda: seqpar_hf.ParallelLayout(sp_size=4))
    results["ring-size-not-dividing"] = _attempt(lambda: seqpar_hf.ParallelLayout(sp_size=2, mode="hybrid",
                                                                                  ring_size=3))
    results["unknown-mode"] = _attempt(lambda: seqpar_hf.ParallelLayout(sp_size=2, mode="stripes"))
    layout = seqpar_hf.ParallelLayout(sp_size=2)

    def different(batch_fn):
        model = seqpar_hf.patch_model(build_model("marian"), layout)
        return lambda: model(**batch_fn())

    def lengths():
        return make_batch("marian", seed=0, src_len=13 if rank == 0 else 11)

    def mask_on_one_rank():
        batch = make_batch("marian", seed=0)
        if rank == 1:
            batch.pop("attention_mask")
        return batch

    def token_ids():
        return make_batch("marian", seed=rank)  # same shapes, different tokens

    results["different-lengths"] = _attempt(different(lengths))
    results["mask-on-one-rank"] = _attempt(different(mask_on_one_rank))
    results["different-token-ids"] = _attempt(different(token_ids))

    def submodule_called_directly():  # what a library that skips the patched forward would do
        model = seqpar_hf.patch_model(build_model("llama"), layout)
        hidden = torch.randn(2, 6, model.config.hidden_size)
        model.model.layers[0](hidden, position_embeddings=model.model.rotary_emb(hidden, torch.arange(6)[None]))
    results["submodule-called-directly"] = _attempt(submodule_called_directly)

    def custom_attention():
        from transformers import AttentionInterface
        AttentionInterface.register("my_kernel", AttentionInterface["sdpa"])
        model = build_model("marian")
        model.set_attn_implementation("my_kernel")
        seqpar_hf.patch_model(model, layout)
    results["unsupported-attention"] = _attempt(custom_attention)

    def no_process_group():
        model = seqpar_hf.patch_model(build_model("marian"), layout)
        batch = make_batch("marian", seed=0)
        dist.barrier()
        dist.destroy_process_group()  # last case: nothing after it needs the group
        model(**batch)
    results["no-process-group"] = _attempt(no_process_group)
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
    return out

