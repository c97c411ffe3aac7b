"""In-rank bodies of tests/test_generation_gloo.py: `model.generate` under SP (every rank the same, full
batch) against the unpatched model in the same process; refusals; the Trainer's `--sp_generate`.
Run inside the `parity` process groups (tests/worlds.py). fp32, tiny models, a few new tokens."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MaxTimeCriteria,
    StoppingCriteriaList,
    SuppressTokensLogitsProcessor,
)

import seqpar_hf
from seqpar_hf.models.generation import sharded_cache
from seqpar_hf.models.mixers import sequence

from ..helpers.models import SEQ2SEQ, VOCAB, build_model, relative_error

# (prompt lengths of the rows, left-padded to the longest) and (source lengths, right-padded): different
# lengths per row, none divisible by 2 or 4
PROMPT_LENGTHS = (11, 7, 4)
SOURCE_LENGTHS = (13, 2, 9)


def inputs_for(family: str, seed: int, rank_offset: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed + rank_offset)
    lengths = SOURCE_LENGTHS if family in SEQ2SEQ else PROMPT_LENGTHS
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if family in SEQ2SEQ:
            mask[row, :n] = 1  # sources: right padding
        else:
            mask[row, width - n :] = 1  # prompts: left padding, as generate wants
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def _finite_error(got: tuple, want: tuple) -> float:
    """Worst relative error over steps, on the entries that are finite in the reference (processors set -inf)."""
    worst = 0.0
    for a, b in zip(got, want):
        keep = torch.isfinite(b)
        if not torch.equal(keep, torch.isfinite(a)):
            return float("inf")
        worst = max(worst, relative_error(a[keep], b[keep]))
    return worst


# Gemma 3n's KV-shared layers: layers 2 and 3 store no K/V and attend over those of layers 0 (sliding) and 1
GEMMA3N = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    sliding_window=3,
    layer_types=["sliding_attention", "full_attention"] * 2,
    num_kv_shared_layers=2,
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=8,
    laurel_rank=4,
    altup_num_inputs=2,
    activation_sparsity_pattern=[0.0] * 4,
)


def _build(family: str, **config):
    if family != "gemma3n":
        return build_model(family, **config)
    torch.manual_seed(0)
    model = transformers.Gemma3nForCausalLM(transformers.Gemma3nTextConfig(**{**GEMMA3N, **config})).float()
    model.set_attn_implementation("sdpa")
    return model


def _objects() -> dict:
    """generate arguments json cannot write: tuple keys (also in the generation config, which they update),
    a processor object, a stopping criterion whose state (its start time) differs per process."""
    return dict(
        sequence_bias={(11,): 5.0, (7, 8): -3.0},
        logits_processor=LogitsProcessorList([SuppressTokensLogitsProcessor([5, 6])]),
        stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(600.0)]),
    )


def run_case(case: dict) -> dict:
    layout = seqpar_hf.ParallelLayout(
        sp_size=case["sp"], mode=case.get("mode", "ulysses"), ring_size=case.get("ring_size")
    )
    family = case["family"]
    # the tiny encoder-decoders' default init (std 0.02) decodes the same tokens for every source
    lively = dict(init_std=0.3) if family in SEQ2SEQ else {}
    model = _build(family, **lively, **case.get("model", {})).eval()
    reference = copy.deepcopy(model)
    seqpar_hf.patch_model(model, layout)
    inputs = inputs_for(family, seed=case.get("seed", 7))
    kwargs = dict(
        max_new_tokens=case.get("new", 5),
        min_new_tokens=case.get("new", 5),
        num_beams=case.get("beams", 1),
        do_sample=case.get("sample", False),
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        **(_objects() if case.get("objects") else {}),
    )
    torch.manual_seed(11)  # sampling: the same seed on every rank, and for the reference
    every = sharded_cache.EVICT_EVERY
    sharded_cache.EVICT_EVERY = case.get("evict", every)  # short runs reach the periodic eviction
    try:
        out = model.generate(**inputs, **kwargs)
    finally:
        sharded_cache.EVICT_EVERY = every
    torch.manual_seed(11)
    want = reference.generate(**inputs, **kwargs)
    tokens = [None] * layout.sp_size
    dist.all_gather_object(tokens, out.sequences.tolist(), group=layout.sp_group)
    result = {
        "name": case["name"],
        "rank": layout.rank,
        "tokens_equal": torch.equal(out.sequences, want.sequences),
        "same_on_every_rank": all(t == tokens[0] for t in tokens),
        "scores_err": _finite_error(out.scores, want.scores),
        "logits_err": _finite_error(out.logits, want.logits),
        "length": out.sequences.shape[1],
    }
    if case.get("beams", 1) > 1:
        result["sequence_scores_err"] = relative_error(out.sequences_scores, want.sequences_scores)
    split = [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), sequence.SequenceMixer)]
    if split:  # mixers split along the sequence: the prompt's forward split too, the cache's states the unpatched's
        result["prompts_split"] = sum(f.prompts_split for f in split)
        result["prompts_expected"] = len(split)  # one prompt forward (beams expand the batch before it)
        result["states_err"] = _states_error(out.cache, want.cache)
    windowed = "sliding_window" in case.get("model", {}) or case.get("windowed")  # evicted every EVICT_EVERY steps
    if family not in SEQ2SEQ and not windowed:  # the cache stays sharded: this rank's keys are about 1/sp of them
        keys = lambda cache: sum(  # attention layers (a mixer's layer caches states, no keys)
            layer.keys.shape[2] for layer in cache.layers if getattr(layer, "keys", None) is not None
        )
        result["cache_keys"], result["reference_keys"] = keys(out.cache), keys(want.cache)
    elif family in SEQ2SEQ:
        result["cross_keys"] = out.cache.cross_attention_cache.layers[0].keys.shape[2]
        result["reference_cross_keys"] = want.cache.cross_attention_cache.layers[0].keys.shape[2]
    return result


def _states_error(got, want) -> float:
    """The largest relative error of the mixers' cached states (convolution inputs, recurrent states, token counts)
    after generation, this rank's cache against the unpatched one; inf where they differ in kind or shape."""
    worst = 0.0
    for i in range(len(want.layers)):
        theirs = sequence.cache_states(want, i)
        if isinstance(theirs, str):
            continue
        mine = sequence.cache_states(got, i)
        if isinstance(mine, str) or len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
            return float("inf")
        worst = max([worst, *(relative_error(a.double(), b.double()) for a, b in zip(mine, theirs))])
    return worst


def _cases(world: int) -> list[dict]:
    """Beam search, sampling, windows, KV-shared layers and latent attention; greedy decoding of the plain families
    at sp=2 and sp=4 (hybrid) is in the zoo sample's generate rows (tests/test_zoo_sample.py)."""
    window = dict(sliding_window=3)  # smaller than every prompt's padded length (11)
    qwen_window = dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)
    if world == 2:
        base = dict(sp=2)
        return [
            dict(base, name="ulysses-marian-beam4", family="marian", beams=4),
            dict(base, name="ring-marian-beam4", family="marian", mode="ring", beams=4),
            dict(base, name="ulysses-m2m100-beam4", family="m2m100", beams=4),
            dict(base, name="ring-pegasus-beam4", family="pegasus", mode="ring", beams=4),
            dict(base, name="ulysses-marian-sample", family="marian", sample=True),
            dict(base, name="ulysses-llama-beam4", family="llama", beams=4),
            dict(base, name="ring-llama-beam4", family="llama", mode="ring", beams=4),
            dict(base, name="ulysses-llama-sample", family="llama", sample=True),
            dict(base, name="ring-qwen2-window-greedy", family="qwen2", mode="ring", model=qwen_window),
            dict(base, name="ulysses-mistral-window-beam4", family="mistral", model=window, beams=4),
            # past the periodic eviction of out-of-window keys (every 64 steps; every 6 here, twice in 14 tokens)
            dict(base, name="ring-mistral-evicting", family="mistral", mode="ring", model=window, new=14, evict=6),
            dict(base, name="ulysses-llama-sequence-bias-and-processor-objects", family="llama", objects=True),
            # KV-shared layers read another layer's cache shard, also past the periodic eviction
            dict(base, name="ring-gemma3n-kv-shared-beam4", family="gemma3n", mode="ring", model=window, beams=4),
            dict(base, name="ulysses-gemma3n-kv-shared-evicting", family="gemma3n", model=window, new=14, evict=6),
            # latent attention: v's head width apart from q/k's, a sharded cache of the latents
            dict(base, name="ring-deepseek_v3-greedy", family="deepseek_v3", mode="ring"),
            # chunks of 4 counted past each prompt's left padding, in the prompt and in the decoding steps; queries
            # scaled by their index (temperature tuning from index 3)
            dict(base, name="ring-llama4-chunks-beam4", family="llama4", mode="ring", beams=4, new=10, windowed=True),
            dict(base, name="ulysses-t5-beam4", family="t5", beams=4),  # relative position bias in the decoding steps
            # gated DeltaNet layers: the prompt's states (convolution and recurrent) in the cache, reordered by beams
            dict(base, name="ring-qwen3_5-deltanet-beam4", family="qwen3_5", mode="ring", beams=4),
            dict(base, name="ulysses-qwen3_next-deltanet-beam4", family="qwen3_next", beams=4),
            # attention-free: the prompt's forward split along the sequence (Mamba2's SSD, Mamba's selective scan)
            dict(base, name="ring-mamba2-greedy", family="mamba2", mode="ring"),
            dict(base, name="ulysses-mamba-beam4", family="mamba", beams=4),
        ]
    base = dict(sp=4)
    return [
        dict(base, name="sp4-ulysses-marian-beam4", family="marian", beams=4),
        dict(base, name="sp4-hybrid-llama-beam4", family="llama", mode="hybrid", ring_size=2, beams=4),
        dict(base, name="sp4-ring-qwen2-beam4", family="qwen2", mode="ring", beams=4),
        dict(
            base,
            name="sp4-hybrid-qwen2-window-sample",
            family="qwen2",
            mode="hybrid",
            ring_size=2,
            model=qwen_window,
            sample=True,
        ),
        dict(base, name="sp4-ring-mistral-window-beam4", family="mistral", mode="ring", model=window, beams=4),
        dict(
            base,
            name="sp4-hybrid-gemma3-sliding-and-global-beam4",
            family="gemma3",
            mode="hybrid",
            ring_size=2,
            beams=4,
        ),
        dict(base, name="sp4-ring-mixtral-moe-greedy", family="mixtral", mode="ring"),
        # more ranks than the DeltaNet's key heads: the prompt's states passed over 4 ranks, zigzag
        dict(base, name="sp4-ring-qwen3_5-deltanet-greedy", family="qwen3_5", mode="ring"),
    ]


CASES = {2: _cases(2), 4: _cases(4)}


def _message(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def refusals() -> dict:
    """What generate under SP refuses, and how ranks that disagree are caught (every rank raises)."""
    layout = seqpar_hf.ParallelLayout(sp_size=2)
    rank = layout.sp_rank
    model = seqpar_hf.patch_model(build_model("llama").eval(), layout)
    marian = seqpar_hf.patch_model(build_model("marian").eval(), layout)
    inputs = inputs_for("llama", seed=3)
    gen = dict(max_new_tokens=3, do_sample=False)
    out = {
        "prompt_lookup": _message(lambda: model.generate(**inputs, **gen, prompt_lookup_num_tokens=2)),
        "static_cache": _message(lambda: model.generate(**inputs, **gen, cache_implementation="static")),
        "output_attentions": _message(
            lambda: model.generate(**inputs, **gen, output_attentions=True, return_dict_in_generate=True)
        ),
        "no_cache": _message(lambda: model.generate(**inputs, **gen, use_cache=False)),
        "inputs_embeds": _message(
            lambda: model.generate(
                inputs_embeds=model.get_input_embeddings()(inputs["input_ids"]),
                attention_mask=inputs["attention_mask"],
                **gen,
            )
        ),
        "position_ids": _message(lambda: model.generate(**inputs, **gen, position_ids=torch.arange(11)[None])),
        "encoder_outputs": _message(
            lambda: marian.generate(**inputs_for("marian", 3), **gen, encoder_outputs=(torch.zeros(3, 13, 24),))
        ),
        "different_inputs": _message(lambda: model.generate(**inputs_for("llama", seed=3, rank_offset=rank), **gen)),
        "different_settings": _message(lambda: marian.generate(**inputs_for("marian", 3), max_new_tokens=3 + rank)),
        "one_rank_refuses": _message(
            lambda: model.generate(**inputs, **gen, output_attentions=rank == 0, return_dict_in_generate=True)
        ),
        "different_sequence_bias": _message(lambda: model.generate(**inputs, **gen, sequence_bias={(11 + rank,): 5.0})),
        # validated before sharding, as a forward's: not an IndexError on the rank holding positions >= 128
        "source_past_positions": _message(lambda: marian.generate(input_ids=torch.randint(3, VOCAB, (2, 200)), **gen)),
    }
    torch.manual_seed(rank)  # sampling needs the same generator state on every rank
    out["different_seeds"] = _message(lambda: model.generate(**inputs, max_new_tokens=3, do_sample=True))
    model.train()
    out["training"] = _message(lambda: model.generate(**inputs, **gen))
    model.eval()
    # the per-rank path: each rank its own inputs, without SP, as the unpatched model
    mine = inputs_for("llama", seed=3, rank_offset=rank)
    plain = copy.deepcopy(model)
    seqpar_hf.unpatch_model(plain)
    with seqpar_hf.sp_disabled(model):
        out["sp_disabled_equal"] = torch.equal(model.generate(**mine, **gen), plain.generate(**mine, **gen))
    out["after_errors"] = torch.equal(model.generate(**inputs, **gen), plain.generate(**inputs, **gen))
    return out


class _Force(LogitsProcessor):
    """Makes generate take the given tokens (teacher forcing); its raw logits are the model's at them."""

    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences

    def __call__(self, input_ids, scores):
        token = self.sequences[:, input_ids.shape[1]]
        forced = torch.full_like(scores, float("-inf"))
        forced[torch.arange(len(token)), token] = 0.0
        return forced


BF16_CASES = [("llama", "ulysses"), ("qwen2", "ring"), ("marian", "ring")]


def bf16_checks(new: int = 20) -> list[dict]:
    """bf16 generation against the unpatched bf16 model, along the SAME tokens (the SP model's, teacher-forced
    into the reference): every step's logits, next to the unpatched model's own eager-vs-sdpa difference."""
    out = []
    for family, mode in BF16_CASES:
        lively = dict(init_std=0.3) if family in SEQ2SEQ else {}
        model = build_model(family, **lively).to(torch.bfloat16).eval()
        reference, eager = copy.deepcopy(model), copy.deepcopy(model)
        eager.set_attn_implementation("eager")
        seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=2, mode=mode))
        inputs = inputs_for(family, seed=7)
        kwargs = dict(
            max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True
        )
        got = model.generate(**inputs, **kwargs)
        free = reference.generate(**inputs, **kwargs).sequences
        forced = LogitsProcessorList([_Force(got.sequences)])
        want = reference.generate(**inputs, **kwargs, logits_processor=forced).logits
        other = eager.generate(**inputs, **kwargs, logits_processor=forced).logits
        out.append(
            {
                "name": f"bf16-{mode}-{family}",
                "tokens_equal": torch.equal(got.sequences, free),
                "logits_err": max(relative_error(a.float(), b.float()) for a, b in zip(got.logits, want)),
                "eager_vs_sdpa": max(relative_error(a.float(), b.float()) for a, b in zip(other, want)),
            }
        )
    return out


def trainer_checks() -> dict:
    """predict_with_generate with --sp_generate always and never: greedy equals one process row by row, and
    beam search gives the same tokens both ways."""
    from .trainer import collate, make_trainer

    result = {}
    reference = build_model("marian", heads=4, init_std=0.3).eval()  # the default init decodes one token for all
    for setting in ("always", "never"):
        trainer, _ = make_trainer(sp=2, batch=4, eval_size=7, extra=dict(sp_generate=setting))
        trainer.model.load_state_dict(reference.state_dict())
        trainer.args.predict_with_generate = True
        generated = trainer.predict(trainer.eval_dataset, max_new_tokens=5).predictions
        mismatches = 0
        for i in range(len(trainer.eval_dataset)):
            single = collate([trainer.eval_dataset[i]])
            expected = reference.generate(
                input_ids=single["input_ids"],
                attention_mask=single["attention_mask"],
                max_new_tokens=5,
                do_sample=False,
            )[0].tolist()
            got = [t for t in generated[i].tolist() if t >= 0]
            mismatches += got[: len(expected)] != expected or any(t != 0 for t in got[len(expected) :])
        beams = trainer.predict(trainer.eval_dataset, max_new_tokens=5, num_beams=2).predictions
        result[setting] = {"rows": len(generated), "mismatches": mismatches, "beam_tokens": beams.tolist()}
    return result


def all_checks(world: int) -> dict:
    out = {"cases": [run_case(c) for c in CASES[world]]}
    if world == 2:
        out["refusals"] = refusals()
        out["trainer"] = trainer_checks()
        out["bf16"] = bf16_checks()
    return out
