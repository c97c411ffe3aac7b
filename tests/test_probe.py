"""Tier 1 (no process group): the patch-time dry run (seqpar_hf/models/proof/probe.py) on tiny models of the zoo
(conformance/tiny.py). Refusals name the module, its class, why, and the fix; what the dry run proves
(backbone, attention sides and patterns, default positions, the LM head's post-processing) is what the
model computes; and the model, its RNG streams and its configs are left exactly as they were.
Multi-rank parity of each fix: the zoo sample (tests/test_zoo_sample.py, conformance/sample.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import seqpar_hf
from conformance.tiny import build_tiny
from seqpar_hf.attention.mask_patterns import chunks_follow_padding, read_function, read_tensor
from seqpar_hf.attention.masks import Chunks, MaskSpec, SeqMeta, chunked
from seqpar_hf.models.proof.inspection import inspect_model
from seqpar_hf.parallel.sharding import ShardPlan

FIX = "Train it without sequence parallelism"


def _model(model_type: str, class_name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny(model_type, class_name)[0]


@pytest.mark.parametrize(
    "model_type,class_name,expected",
    [
        ("rwkv", "RwkvForCausalLM", ["rwkv.blocks.0.attention.time_shift (ZeroPad2d)", FIX]),
        (
            "openai-gpt",
            "OpenAIGPTLMHeadModel",
            [
                "transformer.h.0.attn (Attention) computes attention itself",
                "not through transformers' AttentionInterface",
            ],
        ),
        (
            "nllb-moe",
            "NllbMoeForConditionalGeneration",
            ["(NllbMoeTop2Router) decides for each token from the batch's other tokens", "capacity", FIX],
        ),
        (
            "deepseek_v32",
            "DeepseekV32ForCausalLM",
            ["model.layers.0.self_attn (DeepseekV32Attention) passes indices=", "does not honour", FIX],
        ),
        ("minimax_m3_vl_text", "MiniMaxM3VLForCausalLM", ["(MiniMaxM3VLAttention) passes block_indices=", FIX]),
        ("inkling_text", "InklingForCausalLM", ["model.layers.0.self_attn (InklingAttention) passes position_bias="]),
        ("doge", "DogeForCausalLM", ["model.layers.0.self_attn (DogeAttention) is given a pattern other than causal"]),
        # two models in one forward: sharded as one (the model itself its backbone), its BERT decoder's positions not
        (
            "encoder-decoder",
            "EncoderDecoderModel",
            ["decoder.bert.embeddings (BertEmbeddings) mixes information along the sequence"],
        ),
        ("whisper", "WhisperForCausalLM", ["against the label at the same position (no shift)", "lm_loss=False"]),
        (
            "marian:decoder_is_causal_false",
            "MarianMTModel",
            [
                "model.decoder.layers.0.self_attn (MarianAttention) says is_causal=False but is given a causal mask",
                "Make the module's is_causal agree",
            ],
        ),
    ],
)
def test_refusal_names_the_module_why_and_the_fix(model_type, class_name, expected):
    model = _model(model_type, class_name)
    with pytest.raises(ValueError) as info:
        inspect_model(model, split=True)
    message = str(info.value)
    assert message.startswith(f"seqpar_hf cannot shard {type(model).__name__}: "), message
    for part in expected:
        assert part in message, message


def _state(model):
    return (
        {k: v.clone() for k, v in [*model.state_dict().items(), *model.named_buffers()]},
        [m.training for m in model.modules()],
        {n: dict(vars(m)) for n, m in model.named_modules()},
        torch.get_rng_state(),
        copy.deepcopy(model.config.to_dict()),
        model.config._attn_implementation,
    )


def _dynamic_rope_llama():
    from tests.helpers.models import build_model, rope

    return build_model("llama", rope_parameters=rope("dynamic"), max_position_embeddings=8)


@pytest.mark.parametrize(
    "model_type,class_name",
    [
        ("llama", "LlamaForCausalLM"),
        ("nllb-moe", "NllbMoeForConditionalGeneration"),
        ("lfm2", "Lfm2ForCausalLM"),
        ("roberta", "RobertaForCausalLM"),
        ("llama", "dynamic rope"),
    ],
)
def test_dry_run_leaves_model_rng_and_config_untouched(model_type, class_name):
    """NLLB-MoE's router stores its capacity on itself in forward; RoBERTa's buffers; refused or not.
    Dynamic RoPE re-registers its inv_freq buffer when the dry run's 25 tokens pass max_position_embeddings
    (8): the model gets its own buffer back."""
    model = _dynamic_rope_llama() if class_name == "dynamic rope" else _model(model_type, class_name)
    model.train()
    model.get_output_embeddings().eval()  # mixed modes survive
    before = _state(model)
    try:
        inspect_model(model, split=True)
    except ValueError:
        pass
    after = _state(model)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1] == after[1]
    for name, attrs in before[2].items():
        now = after[2][name]
        assert attrs.keys() == now.keys(), name
        assert all(
            now[k] is v or now[k] == v
            for k, v in attrs.items()
            if not isinstance(v, torch.Tensor) and k not in ("_forward_hooks", "_forward_pre_hooks")
        ), name
    assert torch.equal(before[3], after[3])
    assert before[4] == after[4] and before[5] == after[5]


def test_what_the_dry_run_proves():
    longcat = inspect_model(_model("longcat_flash", "LongcatFlashForCausalLM"), split=True)
    assert any(site.name.startswith("layers.0.self_attn") for site in longcat.attention)  # MLA, not "*Attention"
    qwen2_moe = inspect_model(_model("qwen2_moe", "Qwen2MoeForCausalLM"), split=True)
    assert {site.name: site.pattern for site in qwen2_moe.attention} == {  # window read off the mask function
        "layers.0.self_attn": (True, 4),
        "layers.1.self_attn": (True, None),
    }
    t5gemma = inspect_model(_model("t5gemma:no_softcap", "T5GemmaForConditionalGeneration"), split=True)
    patterns = {(s.q_side, s.kv_side, s.pattern) for s in t5gemma.attention}
    assert ("encoder", "encoder", (False, 5)) in patterns  # |i - j| <= 4: bidirectional window
    marian = inspect_model(_model("marian:decoder_is_causal_false_eager", "MarianMTModel"), split=True)
    decoder_self = [s for s in marian.attention if s.name == "decoder.layers.0.self_attn"][0]
    assert (decoder_self.q_side, decoder_self.kv_side, decoder_self.pattern) == ("decoder", "decoder", (True, None))
    assert inspect_model(_model("opt", "OPTForCausalLM"), split=True).backbone.__class__.__name__ == "OPTDecoder"
    assert (
        inspect_model(_model("mllama", "MllamaForCausalLM"), split=True).backbone.__class__.__name__
        == "MllamaTextModel"
    )
    assert inspect_model(_model("roberta", "RobertaForCausalLM"), split=True).default_positions == "padding_aware"
    assert inspect_model(_model("opt", "OPTForCausalLM"), split=True).default_positions == "mask_cumsum"
    assert inspect_model(_model("llama", "LlamaForCausalLM"), split=True).default_positions == "arange"


def _parity_at_sp1(model, batch, tol=1e-5):
    reference = copy.deepcopy(model)
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    out, expected = model(**batch), reference(**batch)
    out.loss.backward(), expected.loss.backward()
    assert abs(out.loss.item() - expected.loss.item()) <= tol * expected.loss.item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        err = ((p.grad - q.grad).norm() / q.grad.norm().clamp(min=1e-12)).item()
        assert err <= tol, (name, err)


def test_dynamic_rope_at_the_table_length_after_the_dry_run():
    """A batch exactly max_position_embeddings long neither grows nor resets dynamic RoPE's frequencies:
    it ran with the ones the dry run had grown (gradients 5e-2 off before the dry run restored them)."""
    from tests.helpers.models import make_batch

    _parity_at_sp1(_dynamic_rope_llama(), make_batch("llama", 100, length=8, pad=False))


def test_packed_rows_decided_by_behaviour():
    """Llama's mask function separates the documents of packed rows; OPT's and RoBERTa-as-decoder's are not
    given the positions, so their documents attend to each other: refused, for every kind of packed batch,
    naming the first module where documents meet. Under flash attention transformers separates documents
    in one-row batches only. With its cache on, Llama's mask function does not look for packed rows either
    (transformers separates documents only without a cache)."""
    cached = inspect_model(_model("llama", "LlamaForCausalLM"), split=True).packed_rows
    assert set(cached) == {"packed rows with use_cache on"}, cached
    assert cached["packed rows with use_cache on"].startswith(
        "LlamaForCausalLM lets model.layers.0.self_attn (LlamaAttention) attend across"
    ), cached
    kinds = {
        "one packed row",
        "one packed row with flash-attention kwargs",
        "several packed rows",
        "packed rows with use_cache on",
    }
    refused = inspect_model(_model("opt", "OPTForCausalLM")).packed_rows
    assert set(refused) == kinds
    where = "model.decoder.layers.0.self_attn (OPTAttention)"
    assert all(
        why.startswith(f"OPTForCausalLM lets {where} attend across the documents of {kind}")
        for kind, why in refused.items()
    ), refused
    # RoBERTa as an LM head: transformers 5.24 does not hand its mask function the positions, 5.25 does;
    # the probe follows whichever is installed, so this asserts what the unpatched model does
    roberta = _model("roberta", "RobertaForCausalLM")
    refused = inspect_model(roberta).packed_rows
    ids, pos = torch.arange(5, 17)[None], torch.cat([torch.arange(5), torch.arange(7)])[None]
    with torch.no_grad():
        whole = roberta(input_ids=ids, position_ids=pos, use_cache=False).logits[:, 5:]
        alone = roberta(input_ids=ids[:, 5:], position_ids=pos[:, 5:], use_cache=False).logits
    apart = bool((whole - alone).abs().max() < 1e-5)
    assert ("one packed row" not in refused) == apart, (apart, refused)
    flash = _model("llama", "LlamaForCausalLM")
    flash.config._attn_implementation = "flash_attention_2"  # the dry run never calls it: no kernel needed
    # flash attention separates a one-row batch by its positions, cache or not
    assert set(inspect_model(flash).packed_rows) == {"several packed rows"}


def test_packed_rows_with_the_cache_on_follow_the_callers_use_cache():
    """A plain loop on a model whose config.use_cache is True: the unpatched Llama lets the documents of a
    packed row attend to each other (transformers looks for packed rows only without a cache), so the
    patched one refuses, saying how to turn the cache off; with use_cache=False (the keyword or the
    config, as the Trainer and TRL set it) both keep documents apart, exactly."""
    from tests.helpers.models import build_model

    positions = torch.cat([torch.arange(6), torch.arange(7)])[None]  # [1, 13]: two documents
    batch = {"input_ids": torch.arange(3, 16)[None], "position_ids": positions, "labels": torch.arange(3, 16)[None]}
    model = build_model("llama")
    assert model.config.use_cache
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    with pytest.raises(ValueError, match=r"use_cache is on .* pass use_cache=False \(the Trainer and TRL do\)"):
        model(**batch)
    model(**batch, use_cache=False).loss.backward()  # accepted
    model = build_model("llama")
    model.config.use_cache = False
    _parity_at_sp1(model, batch)


def _gpt2(positions: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=97,
            n_positions=positions,
            n_embd=32,
            n_layer=2,
            n_head=4,
            bos_token_id=1,
            eos_token_id=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def test_a_short_position_table_gets_a_shorter_dry_run():
    """GPT-2 with 16 positions was refused (the dry run passed 25 tokens); now proven on 16, still split
    2 ways and zigzagged, and still refusing what mixes tokens (GPT's hand-written attention). Under 8
    positions no dry run fits: refused, naming the table."""
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    family = inspect_model(_gpt2(16), split=True, ring=True)
    assert set(family.packed_rows) == {"packed rows with use_cache on"} and family.default_positions == "arange"
    _parity_at_sp1(_gpt2(16), {"input_ids": torch.arange(3, 19)[None], "labels": torch.arange(3, 19)[None]})
    gpt = OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4))
    with pytest.raises(ValueError, match=r"transformer.h.0.attn \(Attention\) computes attention itself"):
        inspect_model(gpt, split=True, ring=True)
    with pytest.raises(
        ValueError,
        match=r"GPT2LMHeadModel: transformer.wpe \(Embedding\) holds 7 positions, too few "
        r"for the dry run that proves the model shards exactly",
    ):
        inspect_model(_gpt2(7), split=True)


def test_a_backbone_alone_is_proven_the_same_way():
    assert (
        inspect_model(_model("roberta", "RobertaForCausalLM").base_model, split=True).default_positions
        == "padding_aware"
    )
    assert set(inspect_model(_model("lfm2", "Lfm2ForCausalLM").base_model, split=True).mixers) == {"layers.0.conv"}


def test_composite_config_pad_id_from_text_config():
    model = _model("codegen", "CodeGenForCausalLM")  # CodeGenConfig defines no pad_token_id
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    assert seqpar_hf.is_patched(model)


def test_tiled_loss_reproduces_a_head_that_multiplies_by_logits_scaling():
    """HyperCLOVA X multiplies its logits by logits_scaling where Granite divides: checked, not guessed."""
    model = _model("hyperclovax", "HyperCLOVAXForCausalLM")
    model.config.logits_scaling = 0.25
    reference = copy.deepcopy(model)
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1), tiled_loss=True)
    batch = {"input_ids": torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"]
    out, expected = model(**batch), reference(**batch)
    assert out.logits is None  # tiled
    out.loss.backward(), expected.loss.backward()
    assert abs(out.loss.item() - expected.loss.item()) <= 1e-5 * expected.loss.item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name


def test_tiled_loss_refused_or_off_where_the_head_is_not_reproduced():
    model = _model("llama", "LlamaForCausalLM")
    forward = model.forward

    def squared_logits(labels=None, **kwargs):  # a post-processing no candidate reproduces
        out = forward(**kwargs)
        out.logits = out.logits**2
        if labels is not None:
            out.loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return out

    model.forward = squared_logits
    with pytest.raises(ValueError, match="post-processes the LM head's output.*use tiled_loss=False"):
        seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1), tiled_loss=True)
    with pytest.warns(UserWarning, match="does not tile this model"):
        seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1), tiled_loss="auto")


def test_mask_patterns_read_exactly():
    from transformers import masking_utils as m

    assert read_function(m.causal_mask_function) == (True, None)
    assert read_function(m.bidirectional_mask_function) == (False, None)
    assert read_function(m.sliding_window_causal_mask_function(131072)) == (True, 131072)  # any window size
    assert read_function(m.sliding_window_bidirectional_mask_function(3)) == (False, 4)  # |i - j| <= 3
    assert read_function(m.chunked_causal_mask_function(8192, torch.zeros(1, dtype=torch.long))) == (True, Chunks(8192))
    # a blockwise pattern that is not causal within its blocks is not chunks
    assert read_function(lambda b, h, q, kv: q // 4 == kv // 4) is None
    keys, rows = torch.ones(1, 6, dtype=torch.bool), torch.ones(1, 6, dtype=torch.bool)
    causal = torch.ones(6, 6).tril().bool()[None, None]
    assert read_tensor(causal, keys, rows) == (True, None)
    bias = torch.where(causal, torch.randn(1, 1, 6, 6), torch.finfo(torch.float32).min)
    assert read_tensor(bias, keys, rows) is None  # learned additive values: a bias, not a pattern


def test_chunks_count_from_each_rows_first_real_token():
    """Transformers counts a row's chunks past its left padding; a mask function that counts them from elsewhere
    is not what the sharded kernels compute (chunks from each document's or row's first real token)."""
    from transformers import masking_utils as m

    padding = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]])
    lead = (padding.cumsum(-1) == 0).sum(-1)
    assert read_function(m.chunked_causal_mask_function(4, lead)) == (True, Chunks(4))
    assert chunks_follow_padding(m.chunked_causal_mask_function(4, lead), 4, padding, 2)
    from_zero = m.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))
    assert not chunks_follow_padding(from_zero, 4, padding, 2)
    # and the kernels' chunks: row 1's first chunk starts at its first real token, index 3
    valid = torch.tensor([[True] * 10, [False] * 3 + [True] * 7])
    meta = chunked(SeqMeta(ShardPlan.build(10, 1, 0), valid, None), 4, 2, None)
    assert meta.doc.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]]
    packed = SeqMeta(ShardPlan.build(8, 1, 0), None, torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1]]))
    assert chunked(packed, 4, 1, None).doc.tolist() == [[0, 0, 0, 0, 1, 1, 2, 2]]  # chunks restart per document


def test_image_blocks_read_exactly_and_masked_so():
    """Gemma 3's masks (causal, or both tokens in one image's block; inside the sliding window on its local
    layers) are read off the mask function as blocks, and the kernels' masks are exactly the model's on every
    pair, at every ring block too; a pattern that is neither is refused by name."""
    from transformers import masking_utils as m

    from seqpar_hf.attention.mask_patterns import check_mask_pattern, read_blocks
    from seqpar_hf.models.forward import front_masks
    from seqpar_hf.models.generation.decoding import DeferredMask

    ids = torch.full((2, 21), -1)
    ids[0, 3:8], ids[0, 10:12], ids[1, 15:21] = 0, 1, 0  # blocks of 5 and 2 tokens; one at a row's end
    full = m.or_masks(m.causal_mask_function, m.blockwise_overlay(ids))
    sliding = m.and_masks(full, m.sliding_window_overlay(4))
    b, q, kv = torch.arange(2)[:, None, None], torch.arange(21)[None, :, None], torch.arange(21)[None, None, :]
    for fn, window in ((full, None), (sliding, 4)):
        pattern, blocks, docs = read_blocks(fn, 2, 21)
        assert pattern == (True, window) and torch.equal(blocks >= 0, ids >= 0) and docs is None
        meta = SeqMeta(ShardPlan.build(21, 2, 0), None, None, blocks)
        spec = MaskSpec(meta, meta, causal=True, window=window)
        want = fn(b, 0, q, kv)
        assert torch.equal(spec.block_mask(torch.arange(21), torch.arange(21))[:, 0], want)
        shard = torch.tensor([0, 1, 2, 19, 20])  # a zigzag rank's queries against a later block of keys
        assert torch.equal(spec.block_mask(shard, torch.arange(5, 12))[:, 0], want[:, shard][:, :, 5:12])
    # packed rows (transformers' mask when positions restart): documents read too, the window inside them
    starts = torch.zeros(2, 21, dtype=torch.long)
    starts[:, 9] = 1
    packed = m.and_masks(sliding, m.packed_sequence_mask_function(starts.cumsum(-1)))
    pattern, blocks, docs = read_blocks(packed, 2, 21)
    assert pattern == (True, 4) and docs.tolist() == [[0] * 9 + [1] * 12] * 2
    prefix = lambda b, h, q, kv: (kv <= q) | (q + kv == 7)  # a pattern of no kind here
    assert read_blocks(prefix, 1, 12) is None
    with pytest.raises(NotImplementedError, match="blocks of tokens .images. see each other both ways.*'<lambda>'"):
        front_masks.take({"full": DeferredMask((1, 12, 12, 0, 0, prefix, None), {})}, check_mask_pattern)


def test_bidirectional_window_mask():
    plan = ShardPlan.build(7, 1, 0)
    meta = SeqMeta(plan, None, None)
    mask = MaskSpec(meta, meta, causal=False, window=3).block_mask(torch.arange(7), torch.arange(7))
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    assert torch.equal(mask, (i - j).abs() < 3)


class _DepthwiseMix(torch.nn.Module):
    """Attention through the interface over each token's two copies of its hidden state (not along the
    sequence, as Inkling 2's block-attention residuals): token-local, so it runs as it is."""

    def __init__(self, config, mlp):
        super().__init__()
        self.config, self.mlp, self.is_causal, self.num_key_value_groups = config, mlp, False, 1
        self.query = torch.nn.Parameter(torch.randn(config.hidden_size) * 0.1)

    def forward(self, x):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        states = torch.stack([x, self.mlp(x)], dim=-2)  # [b, s, 2, h]: "heads" b, s; "keys" the 2 copies
        query = self.query.expand(*x.shape[:-1], 1, -1)  # [b, s, 1, h]
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        out, _ = attend(self, query, states, states, None, scaling=x.shape[-1] ** -0.5)  # [b, 1, s, h]
        return out.transpose(1, 2)[:, :, 0]


def test_token_local_attention_calls_run_as_they_are():
    model = _model("llama", "LlamaForCausalLM")
    layer = model.model.layers[0]
    layer.mlp = _DepthwiseMix(model.config, layer.mlp)
    reference = copy.deepcopy(model)
    family = inspect_model(model, split=True)
    assert [s.name for s in family.local_attention] == ["layers.0.mlp"]
    seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
    batch = {"input_ids": torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))}
    batch["labels"] = batch["input_ids"]
    out, expected = model(**batch), reference(**batch)
    assert abs(out.loss.item() - expected.loss.item()) <= 1e-5 * expected.loss.item()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one thread (a busy 2-core machine otherwise spends seconds in thread hand-offs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_decoder_inputs_from_labels_as_the_model_builds_them():
    """Florence-2 shifts its labels with its text config's start token (2), where its top-level config says 0:
    the patched loss trained on other decoder inputs (WRONG, gradients 0.87 off at sp=2). The ids its own
    forward uses are read at patch time, and the patched loss is the unpatched one."""
    from transformers import Florence2ForConditionalGeneration

    import seqpar_hf
    from conformance.tiny import build_config

    vision = dict(depths=[1], embed_dim=[8], num_heads=[1], num_groups=[1], window_size=2, projection_dim=16)
    vision.update(patch_size=[7], patch_stride=[4], patch_padding=[3], patch_prenorm=[False])
    torch.manual_seed(0)
    model = Florence2ForConditionalGeneration(build_config("florence2", {"vision_config": vision})).eval()
    assert inspect_model(model).decoder_ids == (2, 1)  # (start, pad) of its text config
    assert inspect_model(_model("marian", "MarianMTModel")).decoder_ids is None  # its own builder reproduces it
    batch = {"input_ids": torch.randint(3, 50, (2, 7)), "labels": torch.randint(3, 50, (2, 5))}
    batch["labels"][1, -2:] = -100
    with torch.no_grad():
        want = model(**batch).loss
        seqpar_hf.patch_model(model, seqpar_hf.ParallelLayout(sp_size=1))
        got = model(**batch).loss
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())


@pytest.mark.parametrize(
    "model_type,class_name,kind",
    [
        ("lfm2", "Lfm2ForCausalLM", "Lfm2ShortConv"),
        ("jamba", "JambaForCausalLM", "JambaMambaMixer"),
        ("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextGatedDeltaNet"),
    ],
)
def test_token_mixers_are_proven_to_run_whole(model_type, class_name, kind):
    """A convolution / scan the shard runs name is run on the whole sequence (models/mixers/gathered.py)
    when, so run, the shard runs agree with the full run at every token: every module of its class, and only
    those (the attention stays sharded). Without split nothing is run whole."""
    model = _model(model_type, class_name)
    family = inspect_model(model, split=True)
    backbone = family.backbone
    assert family.mixers and {type(backbone.get_submodule(n)).__name__ for n in family.mixers} == {kind}
    assert all(side == "decoder" for side in family.mixers.values())
    assert family.attention  # and the model's attention is still sharded
    assert inspect_model(model, split=False).mixers == {}


@pytest.mark.parametrize("model_type,class_name", [("mamba", "MambaForCausalLM"), ("mamba2", "Mamba2ForCausalLM")])
def test_attention_free_models_split_their_mixers_or_are_refused(model_type, class_name, monkeypatch):
    """Mamba and Mamba2 (no attention; Mamba2's backbone takes no position_ids): the shard runs name their mixers,
    and `patch_model` splits them along the sequence, proven (models/mixers/install.py). Where none could be
    split (here: the scan hidden from the proof, no head layout), every rank would run the whole model: refused,
    naming the mixer, before anything is patched."""
    from types import SimpleNamespace

    from seqpar_hf.models.mixers import heads, install, scan

    model = _model(model_type, class_name)
    family = inspect_model(model, split=True)
    assert family.mixers and not family.attention
    decided = install.decide(family, SimpleNamespace(sp_size=2))
    assert {way for way, _ in decided.values()} == {"sequence"}
    for name, (_, make) in decided.items():  # proven once for both layers, each wrapper given its own convolution
        module = family.backbone.get_submodule(name)
        assert make(SimpleNamespace(), module.forward, "decoder", None).conv is module.conv1d, name
    monkeypatch.setattr(scan, "find", lambda module, classify=None: {})
    monkeypatch.setattr(heads, "head_layout", lambda module: None)
    with pytest.raises(ValueError) as info:
        install.decide(family, SimpleNamespace(sp_size=2))
    message = str(info.value)
    assert message.startswith(f"seqpar_hf cannot shard {class_name}: ") and ".mixer (" in message, message
    assert "mixes tokens without attention" in message and "divides nothing" in message, message
