"""Tier 1 (no process group): the pieces of generation under SP. The decode-step attention over keys split
into shards and merged by log-sum-exp equals one softmax over all of them; the sequence-sharded cache keeps
global indices, appends round robin, evicts what a sliding window can no longer see and reorders beams;
the Trainer's --sp_generate choice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from seqpar_hf.attention import decode, kernels
from seqpar_hf.models.generation.sharded_cache import SequenceShardedCache
from seqpar_hf.training.generation import use_sp

from .helpers.models import relative_error


def _merged(q, k, v, allowed, shards):
    """Attention over `shards` key blocks merged in order, as merge_over_group does across ranks."""
    out = lse = None
    for cols in shards:
        o, s = decode.local_attention(
            q, k[:, :, cols], v[:, :, cols], None if allowed is None else allowed[..., cols], q.shape[-1] ** -0.5
        )
        out, lse = (o, s) if out is None else kernels.merge(out, lse, o, s)
    return out


@pytest.mark.parametrize("heads,kv_heads,d_v", [(4, 4, 8), (4, 2, 8), (6, 1, 8), (4, 2, 5)])  # d_v: latent attention
def test_sharded_keys_merged_by_lse_equal_one_softmax(heads, kv_heads, d_v):
    g = torch.Generator().manual_seed(0)
    b, s_q, n, d = 3, 2, 13, 8
    q, k, v = (
        torch.randn(b, heads, s_q, d, generator=g),
        torch.randn(b, kv_heads, n, d, generator=g),
        torch.randn(b, kv_heads, n, d_v, generator=g),
    )
    allowed = torch.rand(b, 1, s_q, n, generator=g) > 0.3
    allowed[1, :, :, :7] = False  # row 1: the first shards see no key of it
    allowed[:, :, :, 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    shards = [slice(0, 4), slice(4, 7), slice(7, 13)]  # uneven shards, one all-masked for row 1
    assert relative_error(_merged(q, k, v, allowed, shards), want) < 1e-6
    assert relative_error(decode.attention(q, k, v, allowed, d**-0.5, None), want) < 1e-6  # a group of one


def test_sharded_cache_indices_round_robin_eviction_and_beams():
    cache = SequenceShardedCache(sp_size=2, sp_rank=1)
    b, h, d = 2, 1, 4
    prompt_index = torch.tensor([3, 4, 5])  # this rank's slice of a 6-token prompt
    valid = torch.tensor([[False, True, True], [True, True, True]])
    cache.begin_prefill(prompt_index, valid, length=6)
    k = torch.arange(b * 3, dtype=torch.float).view(b, h, 3, 1).expand(b, h, 3, d)
    cache.update(k, k, layer_idx=0)
    cache.end_prefill()
    assert cache.get_seq_length() == 6
    for step in range(4):  # tokens 6, 7, 8, 9: rank 1 keeps 7 and 9
        new = torch.full((b, h, 1, d), 100.0 + step)
        cache.update(new, new, layer_idx=0)
    layer = cache.layer(0)
    assert cache.get_seq_length() == 10 and layer.index.tolist() == [3, 4, 5, 7, 9]
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 101, 103]
    allowed = layer.allowed()  # the last query (index 9): every valid local key
    assert allowed.shape == (b, 1, 1, 5) and allowed[0, 0, 0].tolist() == [False, True, True, True, True]
    layer.set_window(3)  # a query at 9 sees 7, 8, 9
    assert layer.allowed()[1, 0, 0].tolist() == [False, False, False, True, True]
    layer.evict()  # later queries (>= 10) see keys > 7 only
    assert layer.index.tolist() == [9] and layer.valid.shape == (b, 1)
    cache.reorder_cache(torch.tensor([1, 1]))
    assert layer.keys.shape == (b, h, 1, d) and torch.equal(layer.keys[0], layer.keys[1])


def test_sp_generate_choice():
    layout = SimpleNamespace(enabled=True, sizes=SimpleNamespace(tp_size=1))
    short, long = {"input_ids": torch.zeros(2, 10)}, {"input_ids": torch.zeros(2, 2048)}
    assert use_sp(layout, "always", 1024, short) and not use_sp(layout, "never", 1024, long)
    assert use_sp(layout, "auto", 1024, long) and not use_sp(layout, "auto", 1024, short)
    assert not use_sp(SimpleNamespace(enabled=False, sizes=layout.sizes), "always", 1024, long)  # sp_size 1
    assert not use_sp(SimpleNamespace(enabled=True, sizes=SimpleNamespace(tp_size=2)), "auto", 1024, long)


def test_sp_generate_argument_is_validated(tmp_path):
    from seqpar_hf import SequenceParallelArguments

    with pytest.raises(ValueError, match="sp_generate='sometimes': choose one of auto, always, never"):
        SequenceParallelArguments(output_dir=str(tmp_path), sp_generate="sometimes", use_cpu=True, report_to=[])


# sp_size=1 (enabled False) and sp_disabled (plain_depth) too: a TP model's forwards stay tensor-parallel, and
# one decoding step failed in them (rank 0 a rotary shape error, rank 1 a gloo abort)
@pytest.mark.parametrize("enabled,plain_depth", [(True, 0), (False, 0), (True, 1)])
def test_generate_on_a_tensor_parallel_model_is_refused(enabled, plain_depth):
    from seqpar_hf.models.generation.generate import GenerateSP

    layout = SimpleNamespace(enabled=enabled, sizes=SimpleNamespace(tp_size=2))
    state = SimpleNamespace(detached=False, decoding=None, plain_depth=plain_depth, layout=layout)

    def original(input_ids=None):  # never reached
        raise AssertionError

    with pytest.raises(NotImplementedError, match="tensor-parallel model.*plain_copy"):
        GenerateSP(state, original)(input_ids=torch.ones(1, 3))


def test_a_kv_shared_layer_reads_the_shard_its_keys_come_from():
    """Gemma 3n: a layer that stores no K/V attends over the tensors another layer's `update` returned this
    step; the periodic eviction runs at the next update, so those tensors stay that layer's shard meanwhile."""
    from seqpar_hf.models.generation.sharded_cache import EVICT_EVERY

    cache = SequenceShardedCache(sp_size=2, sp_rank=0)
    cache.begin_prefill(torch.tensor([0, 1, 2]), None, length=6)
    prompt = torch.randn(1, 1, 3, 4)
    keys, _ = cache.update(prompt, prompt, layer_idx=0)
    cache.end_prefill()
    owner = cache.layer(0)
    assert cache.layer(1) is None and cache.reader(1, keys, None) is owner
    with pytest.raises(NotImplementedError, match="layer 1 stores no K/V and attends over keys that are no layer's"):
        cache.reader(1, keys.clone(), None)
    owner.set_window(3)
    with pytest.raises(
        NotImplementedError,
        match="layer 1 stores no K/V and reads the cache of a layer with sliding window 3, with window None",
    ):
        cache.reader(1, keys, None)
    for _ in range(EVICT_EVERY + 2):
        new = torch.randn(1, 1, 1, 4)
        keys, _ = cache.update(new, new, layer_idx=0)
        assert cache.reader(0, keys, 3) is owner and cache.reader(1, keys, 3) is owner
        assert owner.allowed() is None or owner.allowed().shape[-1] == keys.shape[2]
    assert owner.keys.shape[2] < EVICT_EVERY  # evicted on the way (a query sees 3 keys)


def _allowed_tokens(batch_id, ids):
    return [5]


def test_generation_settings_encode_canonically():
    """Every rank hashes its generate arguments: tuple keys (`sequence_bias`, also in the generation config)
    raised TypeError in json. Same arguments -> same text in every process; objects by type, not state."""
    import json

    from transformers import LogitsProcessorList, MaxTimeCriteria, StoppingCriteriaList, SuppressTokensLogitsProcessor

    from seqpar_hf.models.generation.generation_check import settings_text

    def settings(bias, start, banned=(3, 1, 2), tensor=(5, 6)):
        return {
            "sequence_bias": bias,
            "generation_config.sequence_bias": bias,
            "bad_words_ids": [[5, 6]],
            "nested": [torch.tensor(tensor)],
            "banned": set(banned),
            "dtype": torch.bfloat16,
            "logits_processor": LogitsProcessorList([SuppressTokensLogitsProcessor([5])]),
            "stopping_criteria": StoppingCriteriaList([MaxTimeCriteria(60.0, initial_timestamp=start)]),
            "prefix_allowed_tokens_fn": _allowed_tokens,
        }

    one = settings_text(settings({(11,): 5.0, (7, 8): -3.0}, 1.0))
    assert one == settings_text(settings({(7, 8): -3.0, (11,): 5.0}, 2.0, banned=(2, 1, 3)))
    assert json.loads(one)["sequence_bias"] == {"pairs": [[[11], 5.0], [[7, 8], -3.0]]}  # by the keys' text
    assert one != settings_text(settings({(11,): 4.0, (7, 8): -3.0}, 1.0))
    assert one != settings_text(settings({(11,): 5.0, (7, 8): -3.0}, 1.0, tensor=(5, 7)))


def test_decoding_sees_what_the_unpatched_cache_keeps():
    """A model whose masks are full causal but whose cache keeps a window (Moshi: config.sliding_window, no
    layer_types) decodes over that window: each layer's window is the narrower of its attention's and of
    the cache transformers' generate would build."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from seqpar_hf.models.generation.sharded_cache import narrower, unpatched_windows

    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    assert unpatched_windows(LlamaForCausalLM(LlamaConfig(**small))) == [None, None]
    assert unpatched_windows(MistralForCausalLM(MistralConfig(**small, sliding_window=5))) == [5, 5]
    assert [narrower(a, b) for a, b in [(None, None), (3, None), (None, 4), (6, 4)]] == [None, 3, 4, 4]
    cache = SequenceShardedCache(2, 0, windows=[3])
    k = torch.randn(1, 1, 4, 2)
    cache.begin_prefill(torch.tensor([0, 2, 4, 6]), None, 8)
    cache.update(k, k, 0)
    cache.end_prefill()
    assert cache.reader(0, k, None).window == 3  # the mask has no window, the cache does
    assert cache.reader(0, k, 8).window == 3 and cache.reader(0, k, 2).window == 2


def test_a_deferred_mask_sliced_whole_is_itself():
    """Gemma 4 slices its masks to `logits_to_keep` before its KV-shared layers; the sharded prompt forward
    passes 0 (every position), which leaves the deferred mask as it is; any other slice is refused."""
    from seqpar_hf.models.generation.decoding import DeferredMask

    mask = DeferredMask((), {})
    assert mask[:, :, slice(-0, None), :] is mask and mask[...] is mask
    with pytest.raises(NotImplementedError, match="slices its attention mask"):
        mask[:, :, slice(-1, None), :]
