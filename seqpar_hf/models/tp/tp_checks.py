"""Tensor parallelism, exact or refused before any collective: what tensor_parallel.py's plan leaves
out, checked on the structure and on what the dry run saw (models/proof/probe.py).

Before parallelising (`check`, decoder-only models, transformers' `base_model_tp_plan`):
- a plan that shards no projection (only the embeddings) is refused;
- every attention and MLP block of every layer gets its sequence gathered over the TP group, so each
  must have its linear projections sharded by the plan (a plain weight would meet a DTensor input);
- parameters with one row per head (Cohere's use_qk_norm norms, [heads, head_dim]) would need splitting
  with the heads: refused;
- per-token inputs a layer takes besides its hidden states (Gemma 3n's per-layer inputs) come from the
  embedding region, whole, and would meet the layer's sequence slice: refused.
After parallelising (`complete`):
- every replicated parameter inside the layers that neither the plan nor a norm region covers (Phi's
  qk_layernorm, Apertus' xIELU alpha, Cohere 2's ...) sees only this TP rank's heads, features or tokens:
  its gradient is summed over the TP group;
- projections whose outputs the model modifies in place (OLMo's clip_qkv clamps q/k/v) return a copy,
  as a DTensor's local view cannot be written in place.
"""

from __future__ import annotations

import fnmatch
import inspect

from torch.distributed.tensor import DTensor

from ..families import ModelFamily

SHARDING = ("colwise", "rowwise")
REPLICATED = "replicated_with_grad_allreduce"
GATHERED = ("self_attn", "mlp")  # the blocks tensor_parallel.py gathers the sequence for
LAYER_INPUTS = (
    "hidden_states",
    "position_embeddings",
    "attention_mask",
    "position_ids",
    "cache_position",
    "past_key_values",
    "cache",
    "use_cache",
    "output_attentions",
)


def _refuse(why: str, fix: str = "use tp_size=1 (Ulysses / ring work for it)"):
    raise ValueError(f"tensor parallelism: {why}. {fix}")


def plan_of(family: ModelFamily) -> dict:
    config = family.pretrained.config
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan and hasattr(config, "get_text_config"):
        plan = getattr(config.get_text_config(), "base_model_tp_plan", None)
    return dict(plan or {})


def _sharded(name: str, plan: dict) -> bool:
    return any(style in SHARDING and fnmatch.fnmatch(name, key) for key, style in plan.items())


def _replicated(name: str, plan: dict) -> bool:
    return any(style == REPLICATED and fnmatch.fnmatch(name, key) for key, style in plan.items())


def _layers(family: ModelFamily):
    """(path relative to the backbone, layer) of every layer of every stack."""
    names = {m: n for n, m in family.backbone.named_modules()}
    for stack in family.layer_stacks:
        for layer in getattr(stack, "layers", ()):
            yield names[layer], layer


def check(family: ModelFamily, layout) -> None:
    """Refuse, before anything is changed, what the TP plan would leave wrong (decoder-only models)."""
    if family.kind != "causal":
        return
    name = type(family.pretrained).__name__
    plan = plan_of(family)
    if plan and not any(style in SHARDING for style in plan.values()):
        styles = ", ".join(f"{k}: {v}" for k, v in plan.items())
        _refuse(f"{name}'s tensor-parallel plan shards no projection (only {styles})")
    heads = {h for site in family.attention for h in (site.heads, site.kv_heads)}
    for path, layer in _layers(family):
        for block in GATHERED:
            module = getattr(layer, block, None)
            if module is None:
                continue
            for pname, p in module.named_parameters():
                full = f"{path}.{block}.{pname}"
                owner = full.rsplit(".", 1)[0]
                if p.dim() >= 2 and not _sharded(owner, plan) and not _replicated(owner, plan):
                    holder = module.get_submodule(pname.rsplit(".", 1)[0]) if "." in pname else module
                    # rows that may be heads only in the attention block (an MoE router's rows are experts)
                    per_head = (
                        f", one row per attention head {tuple(p.shape)}"
                        if block == "self_attn" and p.shape[0] in heads
                        else f" {tuple(p.shape)}"
                    )
                    _refuse(
                        f"the plan does not shard {full} ({type(holder).__name__}{per_head}), a weight of a block "
                        "whose sequence is gathered over the TP group"
                    )
    for path, inputs in family.layer_inputs.items():
        if inputs:
            _refuse(
                f"{path} takes per-token inputs besides its hidden states ({', '.join(inputs)}) outside its "
                "attention and MLP blocks; they come whole from the embedding region and would meet the layer's "
                "TP slice of the sequence"
            )


class _Copy:
    """Forward hook: return a copy of the output, which the model then modifies in place."""

    def __call__(self, module, args, output):
        return output.clone()


def complete(family: ModelFamily, layout, hook) -> None:
    """After parallelising: sum over TP the gradients of replicated parameters used on this rank's share
    (`hook(group)` makes the gradient hook, tensor_parallel.AllReduceGrad), and copy projection
    outputs the model writes in place."""
    if family.kind != "causal":
        return
    plan = plan_of(family)
    for path, layer in _layers(family):
        for pname, p in layer.named_parameters():
            full = f"{path}.{pname}"
            if isinstance(p, DTensor) or _replicated(full.rsplit(".", 1)[0], plan) or not p.requires_grad:
                continue  # sharded, a norm region's DTensor, or already summed (the plan's replicated entries)
            p.register_hook(hook(layout.tp_group))
    backbone = dict(family.backbone.named_modules())
    for name in family.inplace_outputs:
        module = backbone.get(name)
        if module is not None and isinstance(getattr(module, "weight", None), DTensor):
            module.register_forward_hook(_Copy())


def layer_inputs(family: ModelFamily, recorder_calls: dict, prefix: str) -> dict:
    """{layer path: names of the per-token inputs it takes besides its hidden states and consumes outside
    its attention and MLP blocks} from the dry run's first call of each layer. An input is consumed where a
    module inside the layer takes a tensor with the same per-token fingerprint; one no module takes (used by
    the layer's own code) counts as consumed outside."""
    out = {}
    for path, layer in _layers(family):
        full = f"{prefix}.{path}" if prefix else path
        calls = recorder_calls.get(full)
        if not calls:
            continue
        params = [
            n
            for n, p in inspect.signature(layer.forward).parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        inside: dict[tuple, bool] = {}  # fingerprint values -> every module taking them sits in a gathered block
        for name, sub_calls in recorder_calls.items():
            if not name.startswith(full + ".") or not sub_calls:
                continue
            gathered = name[len(full) + 1 :].split(".")[0] in GATHERED
            for fp in sub_calls[0]["in"].values():
                key = (fp.values.shape, round(float(fp.values.double().sum()), 6))
                inside[key] = inside.get(key, True) and gathered
        extra = set()
        for key, fp in calls[0]["in"].items():
            parts = key.split(".")  # ".0.<i>..." positional, ".1.<name>..." keyword
            if len(parts) < 3:
                continue
            name = parts[2] if parts[1] == "1" else (params[int(parts[2])] if int(parts[2]) < len(params) else parts[2])
            if name == (params[0] if params else "hidden_states") or name in LAYER_INPUTS:
                continue
            if not inside.get((fp.values.shape, round(float(fp.values.double().sum()), 6)), False):
                extra.add(name)
        out[path] = sorted(extra)
    return out
