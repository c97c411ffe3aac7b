"""Parity cases run inside spawned gloo processes: the patched model (wrapped in DDP over the whole
world, as accelerate does) against the unpatched model in the same process."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import seqpar_hf

from ..helpers.kernels import stand_in
from ..helpers.models import build_model, make_batch, relative_error, rope

# Analytically zero gradients (k_proj biases: softmax ignores a shift shared by all keys) are float
# noise of ~1e-14 in both models; they are compared against 1e-4 of the whole gradient's norm.
ZERO_GRAD_FLOOR = 1e-4


def grad_errors(patched, reference) -> tuple[float, str]:
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    total = torch.sqrt(sum(g.double().norm() ** 2 for g in grads.values())).item()
    worst, worst_name = 0.0, ""
    for name, p in patched.named_parameters():
        if name not in grads:
            assert p.grad is None or p.grad.abs().max() == 0, f"{name} has a gradient only under SP"
            continue
        assert p.grad is not None, f"{name} has no gradient under SP"
        err = relative_error(p.grad, grads[name], floor=ZERO_GRAD_FLOOR * total)
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name


def run_case(case: dict) -> dict:
    """One parity case. `case`: family, sp, mode, ring_size, model (config overrides), batch (batch
    overrides), checkpointing, head_chunks and mixer_split (the layout's), eval (compare gathered logits without labels
    instead of loss + gradients), float64 (the model in float64), kernel (names of a scan and a convolution
    dispatcher: the mixers run stand-in fused kernels, tests/helpers/kernels.py, the unpatched model too)."""
    if not case.get("kernel"):
        return _run_case(case)
    model = build_model(case["family"], seed=case.get("seed", 0), **case.get("model", {}))
    with stand_in(model, case["kernel"]) as calls:
        result = _run_case(case, calls)
    result["kernel_states"] = sum(given for _, given, _ in calls)  # the kernel ran from the states passed
    return result


def _run_case(case: dict, kernel_calls: list | None = None) -> dict:
    layout = seqpar_hf.ParallelLayout(
        sp_size=case["sp"],
        mode=case.get("mode", "ulysses"),
        ring_size=case.get("ring_size"),
        head_chunks=case.get("head_chunks", "auto"),
        mixer_split=case.get("mixer_split", "auto"),
    )
    family = case["family"]
    model = build_model(family, seed=case.get("seed", 0), **case.get("model", {}))
    if case.get("float64"):  # the ring's math path (the fused CPU kernel takes no float64)
        model = model.double()
        model.set_experts_implementation("eager")  # MoE: the grouped_mm kernel takes no float64 either
    reference = copy.deepcopy(model)
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable()
        reference.gradient_checkpointing_enable()
    batches = [make_batch(family, seed=100 + d, **case.get("batch", {})) for d in range(layout.dp_size)]
    mine = batches[layout.dp_rank]
    patch = dict(case.get("patch", {}))
    if case.get("chunk_elements"):  # small chunks: the tiled loss runs over several of them
        patch["tiled_chunk_elements"] = case["chunk_elements"]
    seqpar_hf.patch_model(model, layout, **patch)
    if case.get("deepcopy"):  # a deep copy of the patched model is a patched model on the same layout
        original, model = model, copy.deepcopy(model)
        with torch.no_grad():
            for p in original.parameters():
                p.add_(1.0)  # the copy must not share weights with the original
    if kernel_calls is not None:
        kernel_calls.clear()  # those of the proof's check: count the forwards' own
    chosen = seqpar_hf.layout_of(model)  # mode="auto": the layout chosen for this model
    result = {"name": case["name"], "rank": layout.rank, "mode": chosen.mode, "ring_size": chosen.ring_size}

    if case.get("eval"):
        model.eval(), reference.eval()
        inputs = {k: v for k, v in mine.items() if k != "labels"}
        if family in ("marian", "bart", "mbart", "pegasus", "t5"):
            inputs["decoder_input_ids"] = reference.prepare_decoder_input_ids_from_labels(mine["labels"])
        with torch.no_grad():
            out = model(**inputs)
            expected = reference(**inputs)
        logits = seqpar_hf.gather_logits(model, out.logits)
        result["logits_err"] = relative_error(logits, expected.logits)
        if "encoder_last_hidden_state" in expected:
            enc = seqpar_hf.gather_sequence(model, out.encoder_last_hidden_state, side="encoder")
            result["encoder_err"] = relative_error(enc, expected.encoder_last_hidden_state)
        return result

    ddp = DDP(model)
    if case.get("second_batch"):  # two forwards of different lengths before one backward
        extra = [make_batch(family, seed=200 + d, **case["second_batch"]) for d in range(layout.dp_size)]
        out = ddp(**mine)
        out2 = ddp(**extra[layout.dp_rank])
        (out.loss + out2.loss).backward()
        ref_losses = []
        for batch, batch2 in zip(batches, extra):
            loss = reference(**batch).loss
            ((loss + reference(**batch2).loss) / layout.dp_size).backward()
            ref_losses.append(loss.detach())
    else:
        out = ddp(**mine)
        out.loss.backward()
        ref_losses = []
        for batch in batches:  # plain data parallelism over dp_size replicas, each with its full batch
            loss = reference(**batch).loss
            (loss / layout.dp_size).backward()
            ref_losses.append(loss.detach())
    result["loss"] = out.loss.item()
    result["loss_err"] = abs(out.loss.item() - ref_losses[layout.dp_rank].item()) / abs(
        ref_losses[layout.dp_rank].item()
    )
    result["grad_err"], result["worst_param"] = grad_errors(model, reference)
    offload = model._seqpar_state.offload
    if offload is not None:  # the layer inputs really went to host memory and came back
        result["offloaded"] = (offload.moved, offload.restored)
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, out.loss.item())
    result["group_losses"] = losses[layout.sp_size * layout.dp_rank : layout.sp_size * (layout.dp_rank + 1)]
    return result


def run_cases(cases: list[dict]) -> list[dict]:
    return [run_case(c) for c in cases]


# ---------------------------------------------------------------------------------------------
# the cases, per world size

MODES = [("ulysses", None), ("ring", None)]
FUSED_DELTANET = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")  # a `kernel` case's stand-ins
FUSED_SSD = ("mamba2_chunk_scan", "causal_conv1d_fn")


# Every family beyond the first seven, each with a structural feature of its own (tests/helpers/models.py).
NEW_FAMILIES = [
    "m2m100",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "olmo2",
    "qwen3_5",
    "llama4",  # chunked attention, queries scaled by their index (temperature tuning)
    "t5",  # relative position bias; the model runs its encoder and decoder stacks itself
    "smollm3",
    "gpt_neox",
]


ROPE_TYPES = ["linear", "dynamic", "yarn", "longrope", "llama3"]


def _family_case(family: str) -> dict:
    # Gemma 2 runs eager attention only; left padding makes a padding query see no key, where eager and
    # SDPA differ in transformers itself (see tests/helpers/models.causal_batch)
    return dict(family=family, batch=dict(left_pad=False) if family == "gemma2" else {})


def _rope_case(rope_type: str) -> dict:
    # trained on 8 positions, run on 11 (dynamic: max_position_embeddings is its original length)
    return dict(
        family="llama",
        model=dict(rope_parameters=rope(rope_type), max_position_embeddings=8 if rope_type == "dynamic" else 32),
    )


def _coverage_cases(base: dict, tag: str) -> list[dict]:
    """Families, rope types, sliding windows, two forwards before one backward, deep copies."""
    cases = [dict(base, name=f"{tag}-{f}", **_family_case(f)) for f in NEW_FAMILIES]
    cases += [dict(base, name=f"{tag}-llama-rope-{r}", **_rope_case(r)) for r in ROPE_TYPES]
    cases += [
        dict(
            base,
            name=f"{tag}-phi3-longrope",
            family="phi3",
            model=dict(
                rope_parameters=rope("longrope"), max_position_embeddings=32, original_max_position_embeddings=8
            ),
        ),
        # the dry run's 25 tokens grow dynamic RoPE's frequencies; a batch at the table length neither grows nor
        # resets them, so it ran with the grown ones until the dry run restored the buffer it re-registers
        dict(
            base,
            name=f"{tag}-llama-rope-dynamic-at-table-length",
            family="llama",
            model=dict(rope_parameters=rope("dynamic"), max_position_embeddings=8),
            batch=dict(length=8, pad=False),
        ),
        dict(base, name=f"{tag}-mistral-window-4", family="mistral", model=dict(sliding_window=4)),
        # T5's bias marker made again by the recompute, and the bias table's gradient through it
        dict(base, name=f"{tag}-t5-checkpointing", family="t5", checkpointing=True),
        dict(
            base,
            name=f"{tag}-qwen2-window-4",
            family="qwen2",
            model=dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
        ),
        dict(
            base,
            name=f"{tag}-llama-checkpointing-two-forwards",
            family="llama",
            checkpointing=True,
            second_batch=dict(length=7),
        ),
        dict(
            base,
            name=f"{tag}-marian-checkpointing-two-forwards",
            family="marian",
            checkpointing=True,
            second_batch=dict(src_len=6, tgt_len=5),
        ),
        dict(base, name=f"{tag}-llama-deepcopy", family="llama", deepcopy=True),
        dict(base, name=f"{tag}-marian-deepcopy", family="marian", deepcopy=True),
    ]
    return cases


def _cases_world2():
    cases = []
    for mode, ring in MODES:
        base = dict(sp=2, mode=mode, ring_size=ring)
        tag = mode
        cases += [
            dict(base, name=f"{tag}-marian-padded-odd", family="marian"),
            dict(base, name=f"{tag}-marian-uneven-heads", family="marian", model=dict(heads=3)),
            dict(base, name=f"{tag}-marian-src-shorter-than-tgt", family="marian", batch=dict(src_len=5, tgt_len=12)),
            dict(
                base,
                name=f"{tag}-marian-length-1",
                family="marian",
                batch=dict(src_len=1, tgt_len=1, pad=False, batch=2),
            ),
            dict(base, name=f"{tag}-marian-no-padding", family="marian", batch=dict(src_len=12, tgt_len=8, pad=False)),
            dict(base, name=f"{tag}-marian-empty-source", family="marian", batch=dict(empty_source=True)),
            dict(base, name=f"{tag}-bart", family="bart"),
            dict(base, name=f"{tag}-mbart", family="mbart"),
            dict(base, name=f"{tag}-pegasus", family="pegasus"),
            dict(base, name=f"{tag}-llama-mqa", family="llama", model=dict(heads=4, kv_heads=1)),
            dict(base, name=f"{tag}-llama-uneven-gqa", family="llama", model=dict(heads=6, kv_heads=2)),
            dict(base, name=f"{tag}-llama-no-padding", family="llama", batch=dict(length=12, pad=False)),
            dict(base, name=f"{tag}-mistral", family="mistral"),
            dict(base, name=f"{tag}-qwen2", family="qwen2"),
            dict(base, name=f"{tag}-marian-checkpointing", family="marian", checkpointing=True),
            # fused kernels behind the scan and the convolution (flash-linear-attention / mamba_ssm and causal-conv1d
            # on a GPU): split along the sequence, states passed and halos prepended
            dict(base, name=f"{tag}-qwen3_5-kernel", family="qwen3_5", kernel=FUSED_DELTANET),
            dict(base, name=f"{tag}-granitemoehybrid-kernel", family="granitemoehybrid", kernel=FUSED_SSD),
            dict(base, name=f"{tag}-llama-checkpointing", family="llama", checkpointing=True),
            # attention-free: the context reaches Mamba's mixers on the shard's mask, also in the recompute of
            # each of two forwards of different lengths before one backward
            dict(
                base,
                name=f"{tag}-mamba-checkpointing-two-forwards",
                family="mamba",
                checkpointing=True,
                second_batch=dict(length=7),
            ),
            dict(base, name=f"{tag}-mamba2-checkpointing", family="mamba2", checkpointing=True),
            dict(base, name=f"{tag}-mamba2-by-heads", family="mamba2", mixer_split="heads"),
            # Jamba's layers call its Mamba without the context: the recompute sets it again (mixers/gathered.py)
            dict(
                base,
                name=f"{tag}-jamba-checkpointing-two-forwards",
                family="jamba",
                checkpointing=True,
                second_batch=dict(length=7),
            ),
            dict(base, name=f"{tag}-marian-eval", family="marian", eval=True),
            dict(base, name=f"{tag}-llama-eval", family="llama", eval=True),
        ]
        cases += _coverage_cases(base, tag)
        cases += _tiled_cases(base, tag)
    cases += [dict(sp=2, mode="ring", name=f"ring-{f}-float64", family=f, float64=True) for f in ("llama", "marian")]
    # Mixtral's router turns rounding into a few 1e-7 on its gate gradient (top-2 of 4 experts on near ties;
    # 1.1e-4 was reported once): in float64 the same case is exact to 5e-16, so it is rounding, not a bug
    mixtral = dict(sp=2, mode="ring", family="mixtral", model=dict(sliding_window=4), batch=dict(left_pad=False))
    cases += [
        dict(mixtral, name="ring-mixtral-window-right-padding"),
        dict(mixtral, name="ring-mixtral-window-right-padding-float64", float64=True, tol=1e-12),
    ]
    return cases


def _tiled_cases(base: dict, tag: str) -> list[dict]:
    """The tiled loss (forced on, 5 tokens per chunk): bias after the head (Marian, BART), soft-capping
    (Gemma 2), tied head (Llama), recompute under gradient checkpointing with two forwards."""
    tiled = dict(base, patch=dict(tiled_loss=True), chunk_elements=97 * 5)
    cases = [
        dict(tiled, name=f"{tag}-tiled-marian", family="marian"),
        dict(
            tiled,
            name=f"{tag}-tiled-llama-checkpointing-two-forwards",
            family="llama",
            checkpointing=True,
            second_batch=dict(length=7),
        ),
    ]
    if tag == "ulysses":  # what follows the head does not depend on the mode
        cases += [
            dict(tiled, name=f"{tag}-tiled-bart", family="bart"),
            dict(tiled, name=f"{tag}-tiled-llama", family="llama"),
            dict(tiled, name=f"{tag}-tiled-gemma2-softcap", **_family_case("gemma2")),
        ]
    return cases


def _cases_world4():
    cases = []
    for mode, ring in MODES + [("hybrid", 2)]:
        tag = mode
        sp4 = dict(sp=4, mode=mode, ring_size=ring)
        cases += [
            dict(sp4, name=f"{tag}-sp4-marian-uneven-heads", family="marian", model=dict(heads=6)),
            dict(sp4, name=f"{tag}-sp4-llama-kv-lt-sp", family="llama", model=dict(heads=4, kv_heads=2)),
            dict(sp4, name=f"{tag}-sp4-llama-uneven", family="llama", model=dict(heads=6, kv_heads=3)),
            dict(sp4, name=f"{tag}-sp4-marian-eval", family="marian", eval=True),
        ]
        if mode == "hybrid":  # uneven heads on the Ulysses part (3 and 5 heads over 2 ranks)
            cases += [
                dict(sp4, name=f"{tag}-sp4-marian-3-heads", family="marian", model=dict(heads=3)),
                dict(sp4, name=f"{tag}-sp4-llama-5-heads-mqa", family="llama", model=dict(heads=5, kv_heads=1)),
                dict(sp4, name=f"{tag}-sp4-gemma3-window", **_family_case("gemma3")),
                dict(sp4, name=f"{tag}-sp4-mixtral", **_family_case("mixtral")),
                dict(sp4, name=f"{tag}-sp4-m2m100", **_family_case("m2m100")),
                # 4 ranks, 2 key heads: no head split; the fused kernel split along the sequence, states passed
                dict(sp4, name=f"{tag}-sp4-qwen3_5-kernel", family="qwen3_5", kernel=FUSED_DELTANET),
                dict(sp4, name=f"{tag}-sp4-llama-rope-dynamic", **_rope_case("dynamic")),
                dict(sp4, name=f"{tag}-sp4-llama-rope-longrope", **_rope_case("longrope")),
                dict(
                    sp4,
                    name=f"{tag}-sp4-llama-checkpointing-two-forwards",
                    family="llama",
                    checkpointing=True,
                    second_batch=dict(length=7),
                ),
            ]
        if mode != "hybrid":
            cases += [
                dict(sp=2, mode=mode, ring_size=ring, name=f"{tag}-sp2xdp2-marian", family="marian"),
                dict(
                    sp=2,
                    mode=mode,
                    ring_size=ring,
                    name=f"{tag}-sp2xdp2-tiled-marian",
                    family="marian",
                    patch=dict(tiled_loss=True),
                    chunk_elements=97 * 3,
                ),
                dict(sp=2, mode=mode, ring_size=ring, name=f"{tag}-sp2xdp2-llama", family="llama"),
            ]
    return cases


def _chunked_cases(world: int) -> list[dict]:
    """The fused exchange in head chunks (one chunk is every Ulysses case above), and mode="auto"
    (`expect`: the mode and ring size it must choose)."""
    if world == 2:
        return [
            dict(
                sp=2,
                name="ulysses-llama-mqa-chunks-2-checkpointing-two-forwards",
                family="llama",
                model=dict(heads=4, kv_heads=1),
                head_chunks=2,
                checkpointing=True,
                second_batch=dict(length=7),
            ),
            dict(
                sp=2,
                name="ulysses-marian-5-heads-chunks-2",
                family="marian",
                model=dict(heads=5, d_model=40),
                head_chunks=2,
            ),
            dict(sp=2, mode="auto", name="auto-llama", family="llama", expect=("ulysses", 1)),
        ]
    return [
        dict(
            sp=4,
            mode="hybrid",
            ring_size=2,
            name="hybrid-sp4-llama-chunks-2",
            family="llama",
            model=dict(heads=8, kv_heads=2),
            head_chunks=2,
        ),
        dict(
            sp=4,
            name="ulysses-sp4-llama-10-heads-kv-lt-sp-chunks-2",
            family="llama",
            model=dict(heads=10, kv_heads=2),
            head_chunks=2,
        ),
        dict(
            sp=4,
            mode="auto",
            name="auto-sp4-llama-6-heads",
            family="llama",
            model=dict(heads=6, kv_heads=2),
            expect=("hybrid", 2),
        ),
        dict(
            sp=4,
            mode="auto",
            name="auto-sp4-llama-5-heads",
            family="llama",
            model=dict(heads=5, kv_heads=1),
            expect=("ring", 4),
        ),
    ]


def _latent_cases(world: int) -> list[dict]:
    """Multi-head latent attention with v's head width apart from q/k's (DeepSeek-V2/V3 checkpoints: 128 vs
    192; here 8 vs 12, and 16 vs 12): the fused exchange (in head chunks), the ring and the hybrid carry each."""
    if world == 2:
        return [
            dict(sp=2, name="ulysses-deepseek_v3-v-narrower-chunks-2", family="deepseek_v3", head_chunks=2),
            dict(sp=2, mode="ring", name="ring-deepseek_v2-v-wider", family="deepseek_v2", model=dict(v_head_dim=16)),
        ]
    return [
        dict(
            sp=4,
            mode="hybrid",
            ring_size=2,
            name="hybrid-sp4-deepseek_v3-6-heads-chunks-2",
            family="deepseek_v3",
            model=dict(heads=6),
            head_chunks=2,
        )
    ]


def _memory_cases(world: int) -> list[dict]:
    """Checkpointed layer inputs offloaded to host memory and the MLP over tiles of 2 tokens (seqpar_hf/memory/),
    under gradient checkpointing with two forwards before one backward; Marian has no MLP child (left whole)."""
    both = dict(patch=dict(offload_activations=True, tiled_mlp=2), checkpointing=True)
    if world == 2:
        return [
            dict(
                both,
                sp=2,
                mode=mode,
                name=f"{mode}-llama-offload-tiled-mlp-two-forwards",
                family="llama",
                second_batch=dict(length=7),
            )
            for mode in ("ulysses", "ring")
        ] + [
            dict(
                both,
                sp=2,
                mode="ring",
                name="ring-marian-offload-tiled-mlp-auto",
                family="marian",
                patch=dict(offload_activations=True, tiled_mlp="auto"),
            ),
        ]
    return [
        dict(both, sp=4, mode="hybrid", ring_size=2, name="hybrid-sp4-llama-offload-tiled-mlp", family="llama"),
        dict(both, sp=2, name="ulysses-sp2xdp2-llama-offload-tiled-mlp", family="llama"),
    ]


CASES = {
    2: _cases_world2() + _chunked_cases(2) + _latent_cases(2) + _memory_cases(2),
    4: _cases_world4() + _chunked_cases(4) + _latent_cases(4) + _memory_cases(4),
}
