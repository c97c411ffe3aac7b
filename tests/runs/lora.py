"""In-rank bodies of tests/test_peft_gloo.py: PEFT LoRA with SP in every order, merge, generation,
adapter save and reload, unpatch after TRL wrapped the forward."""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed as dist

import seqpar_hf
from seqpar_hf import _compat

from ..helpers.models import build_model, make_batch, relative_error


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _ddp_average(model, layout):
    """What DDP does with the gradients of the trainable parameters: average over the world."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= layout.world_size


def _lora_grad_error(model, reference) -> float:
    got = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    want = {n: p.grad for n, p in reference.named_parameters() if "lora_" in n}
    assert got and got.keys() == want.keys()
    return max(relative_error(got[n], want[n], floor=1e-6) for n in got)


def _orders():
    from peft import get_peft_model

    layout = seqpar_hf.ParallelLayout(sp_size=2)
    results = {}
    for order in ("patch-the-peft-model", "patch-its-base-model", "patch-then-get-peft-model"):
        for checkpointing in (False, True):
            torch.manual_seed(0)
            base = build_model("llama")
            reference = get_peft_model(copy.deepcopy(base), _lora())
            if order == "patch-then-get-peft-model":
                model = get_peft_model(seqpar_hf.patch_model(base, layout), _lora())
            else:
                torch.manual_seed(0)
                model = get_peft_model(base, _lora())
                seqpar_hf.patch_model(model if order == "patch-the-peft-model" else model.get_base_model(), layout)
            reference.load_state_dict(model.state_dict())  # same LoRA init whatever the order
            if checkpointing:
                for m in (model, reference):
                    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                    m.enable_input_require_grads()
            batch = make_batch("llama", seed=3)
            loss, want = model(**batch).loss, reference(**batch).loss
            loss.backward(), want.backward()
            _ddp_average(model, layout)
            results[f"{order}-checkpointing" if checkpointing else order] = (
                relative_error(loss, want),
                _lora_grad_error(model, reference),
            )
    return results


def _merge_generate_save():
    from peft import PeftModel, get_peft_model

    layout = seqpar_hf.ParallelLayout(sp_size=2)
    out = {}
    torch.manual_seed(0)
    model = seqpar_hf.patch_model(get_peft_model(build_model("llama"), _lora()), layout)
    with torch.no_grad():  # LoRA B starts at zero: make the adapter do something
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    plain = copy.deepcopy(model)
    seqpar_hf.unpatch_model(plain)
    batch = make_batch("llama", seed=4)
    model.eval(), plain.eval()

    prompt = {"input_ids": batch["input_ids"][:1, 3:], "attention_mask": batch["attention_mask"][:1, 3:]}
    out["generate"] = torch.equal(
        model.generate(**prompt, max_new_tokens=5, do_sample=False),
        plain.generate(**prompt, max_new_tokens=5, do_sample=False),
    )

    with tempfile.TemporaryDirectory() as tmp:  # the adapter of a patched model is a plain adapter
        path = [tmp if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(path)
        if dist.get_rank() == 0:
            model.save_pretrained(path[0])
        dist.barrier()
        reloaded = PeftModel.from_pretrained(copy.deepcopy(plain.get_base_model()), path[0]).eval()
        out["reloaded"] = relative_error(reloaded(**batch).loss, plain(**batch).loss)
        dist.barrier()

    merged = model.merge_and_unload()  # the backbone stays patched: still sequence-parallel, still exact
    plain_merged = plain.merge_and_unload()
    out["merged_is_patched"] = seqpar_hf.is_patched(merged)
    merged.train(), plain_merged.train()
    for p in (*merged.parameters(), *plain_merged.parameters()):
        p.requires_grad_(True)  # PEFT leaves the base weights frozen
    loss, want = merged(**batch).loss, plain_merged(**batch).loss
    loss.backward(), want.backward()
    _ddp_average(merged, layout)
    out["merged"] = (
        relative_error(loss, want),
        max(
            relative_error(p.grad, q.grad, floor=1e-4)
            for p, q in zip(merged.parameters(), plain_merged.parameters())
            if q.grad is not None
        ),
    )
    seqpar_hf.unpatch_model(merged)
    out["unpatched_merged_is_plain"] = (
        not seqpar_hf.is_patched(merged)
        and _compat.attn_implementation(merged.config) == "sdpa"
        and "forward" not in merged.model.__dict__
    )
    return out


def _unpatch_after_trl():
    """unpatch_model removes only what patch_model added: TRL's fused forward keeps working."""
    from trl.trainer.utils import add_fused_lm_head

    layout = seqpar_hf.ParallelLayout(sp_size=2)
    model = seqpar_hf.patch_model(build_model("llama"), layout)
    add_fused_lm_head(model)  # what SFTTrainer does to the model it gets
    batch = make_batch("llama", seed=5, pad=False)
    sharded = model(**batch, fused_lm_head=True).log_probs
    seqpar_hf.unpatch_model(model)
    plain = model(**batch, fused_lm_head=True).log_probs
    return {"fused_after_unpatch": relative_error(plain, sharded), "patched": seqpar_hf.is_patched(model)}


def all_checks():  # the trl group runs only where TRL and PEFT are installed (conftest.py)
    return {"orders": _orders(), "merge": _merge_generate_save(), "trl": _unpatch_after_trl()}
