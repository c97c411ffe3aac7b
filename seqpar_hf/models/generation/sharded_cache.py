"""A KV cache that stays sharded along the sequence: each rank of the SP group holds every layer's keys
and values of its slice of the prompt, plus its share of the generated tokens.

It fits transformers' `Cache` API, so `generate` runs unchanged around it:
- `get_seq_length()` is the GLOBAL length (prompt + generated tokens): generate and the mask helpers
  derive positions and sizes from it;
- every local key keeps its global sequence index and its validity per row (left padding, the padding
  that makes the prompt divisible by sp), so attention needs no knowledge of who holds which token;
  a zigzag (ring) prefill's non-contiguous keys are just other indices;
- each new token's K/V is appended on exactly one rank, round robin by its index, so the shards stay
  balanced (counting it on every rank would weigh it sp times in the merged softmax);
- beam search reorders the batch dim of the local shard;
- keys that no later query can see (outside every layer's sliding window) are dropped, so a windowed
  model's cache stays bounded as unpatched transformers' sliding-window cache is;
- a decoding step sees what the unpatched model's own cache keeps as well as what its masks allow: a
  model may build full causal masks and still decode over a `DynamicSlidingWindowLayer` (Moshi: its
  config's `sliding_window` makes every cache layer keep that many keys), so each layer's window is the
  narrower of its attention's and its unpatched cache layer's (`unpatched_windows`);
- a layer that stores no K/V and attends over another layer's (Gemma 3n's KV-shared layers) reads that
  layer's shard: found by identity, as the tensors its `update` returned this step (`reader`).
The attention over the shards is `seqpar_hf.attention.decode`; the prefill that fills them is the
ordinary sharded forward (the attention module stores its local K/V here before attending).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from ...attention.masks import Chunks

EVICT_EVERY = 64  # decoding steps between two evictions of out-of-window keys (each copies the layer's shard)


class ShardedLayer(CacheLayerMixin):
    """One layer's local keys: keys/values [b, h_kv, n, d], index [n] global sequence index, valid [b, n]."""

    is_sliding = False  # the window is applied by index in attention, not by the cache's shape
    is_croppable = False

    def __init__(self, sp_size: int, sp_rank: int, cache_window: int | None = None):
        super().__init__()
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.cache_window = cache_window  # the keys the unpatched model's cache layer keeps while decoding
        self.index: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.seen = 0  # global tokens this layer has been given (prompt + generated)
        self.query_index: torch.Tensor | None = None  # [s_q] global indices of the last update's tokens (the queries)
        self.window: int | Chunks | None = None  # a sliding window's size, or chunks, as its attention call gives it
        self.lead: torch.Tensor | None = None  # [b] each row's left padding (chunks count from its first real token)
        self.steps = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.is_initialized = key_states.device, True

    def prefill(self, keys, values, index: torch.Tensor, valid: torch.Tensor | None, length: int, lead=None):
        """The prompt's local K/V (this rank's tokens, in local order) and their global indices / validity;
        `lead` [b]: each row's left padding (None: none)."""
        self.lazy_initialization(keys, values)
        self.keys, self.values, self.index = keys, values, index
        self.valid = valid.expand(keys.shape[0], -1) if valid is not None else None
        self.lead = lead.expand(keys.shape[0]) if lead is not None else None
        self.seen = length
        self.query_index = index
        return keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        """A decoding step's new tokens [b, h_kv, s_q, d]: token t is kept on SP rank t % sp only."""
        if self.steps and self.steps % EVICT_EVERY == 0:  # here, not after attending: a KV-shared layer reads
            self.evict()  # the tensors returned below later in the same step
        s_q = key_states.shape[2]
        first = self.seen
        self.query_index = torch.arange(first, first + s_q, device=key_states.device)
        self.seen += s_q
        self.steps += 1
        mine = [i for i in range(s_q) if (first + i) % self.sp_size == self.sp_rank]
        if mine:
            if len(mine) < s_q:  # (a one-token step is kept whole or not at all)
                pick = torch.tensor(mine, device=key_states.device)
                key_states, value_states = key_states.index_select(2, pick), value_states.index_select(2, pick)
            self.keys = torch.cat([self.keys, key_states], dim=2)  # [b, h_kv, n, d] -> [b, h_kv, n + k, d]
            self.values = torch.cat([self.values, value_states], dim=2)
            self.index = torch.cat([self.index, self.query_index[mine]])
            if self.valid is not None:
                self.valid = torch.cat([self.valid, self.valid.new_ones(self.valid.shape[0], len(mine))], dim=1)
        return self.keys, self.values

    def allowed(self) -> torch.Tensor | None:
        """[b or 1, 1, s_q, n]: which local keys each of the last update's queries may see (causal, window,
        validity), built per layer and step without a host sync; None when all of them (one query sees every
        key before it: with no padding and no window, every key this rank holds)."""
        query_index, index = self.query_index, self.index
        assert query_index is not None and index is not None  # set by the prefill or update before attention
        if self.valid is None and self.window is None and query_index.numel() == 1:
            return None
        q, k = query_index[:, None], index[None, :]
        mask = k <= q
        if isinstance(self.window, Chunks):  # the same chunk, counted from each row's first real token
            lead = 0 if self.lead is None else self.lead[:, None, None]
            size = self.window.size
            same = torch.div(q - lead, size, rounding_mode="floor") == torch.div(k - lead, size, rounding_mode="floor")
            mask = mask & same
        elif self.window is not None:
            mask = mask & (q - k < self.window)
        mask = mask[None, None] if mask.dim() == 2 else mask[:, None]  # [b or 1, 1, s_q, n]
        if self.valid is not None:
            mask = mask & self.valid[:, None, None, :]  # [b, 1, s_q, n]
        return mask

    def set_window(self, window: int | Chunks | None) -> None:
        """The layer's sliding window or chunks, as its attention module passes it (None: full attention)."""
        self.window = window if window is None or isinstance(window, Chunks) else int(window)

    def evict(self) -> None:
        """Drop the keys that no later query can see: a query at index >= seen sees only keys with index
        > seen - window. After the prefill (most of a long prompt falls out of the window), and every
        EVICT_EVERY steps (one copy of the shard) at the start of `update`."""
        # keys, values and index are set together (the prefill)
        if self.window is None or self.keys is None or self.values is None or self.index is None:
            return
        reach = self.window.size if isinstance(self.window, Chunks) else self.window  # a chunk spans < size keys
        keep = self.index > self.seen - reach  # [n]
        if not bool(keep.all()):
            pick = keep.nonzero().flatten()
            self.keys, self.values = self.keys.index_select(2, pick), self.values.index_select(2, pick)
            self.index = self.index[pick]
            if self.valid is not None:
                self.valid = self.valid.index_select(1, pick)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.keys is not None:
            self._rows(beam_idx.to(self.keys.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.keys is not None:
            self._rows(torch.arange(self.keys.shape[0], device=self.keys.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.keys is not None:
            self._rows(torch.as_tensor(indices, device=self.keys.device))

    def _rows(self, rows: torch.Tensor) -> None:
        assert self.keys is not None and self.values is not None  # the callers check keys; values come with them
        self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)
        if self.valid is not None:
            self.valid = self.valid.index_select(0, rows)
        if self.lead is not None:
            self.lead = self.lead.index_select(0, rows)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a sequence-sharded KV cache cannot be cropped (its last tokens live on several "
            "ranks); assisted decoding is not supported under sequence parallelism"
        )

    def local_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


class ShardedStateLayer(LinearAttentionLayer, ShardedLayer):
    """A layer that caches a token mixer's states and attention keys alike (Zamba, Zamba2, Falcon-H1): the
    states as the unpatched cache's layer keeps them (every rank the same, or its heads'), the keys sharded."""

    is_compileable = False

    def __init__(self, sp_size: int, sp_rank: int, cache_window: int | None = None, number_of_states: int = 1):
        ShardedLayer.__init__(self, sp_size, sp_rank, cache_window)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:  # the keys' (ShardedLayer.prefill), else a state's (by keyword)
            ShardedLayer.lazy_initialization(self, *args)
            self.cumulative_length_linear = self.cumulative_length_linear.to(args[0].device)
        else:
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        ShardedLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        ShardedLayer.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        ShardedLayer.crop(self, tokens_to_remove)

    def get_seq_length(self) -> int:
        return ShardedLayer.get_seq_length(self)

    def get_max_length(self) -> int:
        return ShardedLayer.get_max_length(self)


class SequenceShardedCache(Cache):
    """This rank's shard of a decoder-only model's KV cache (see the module docstring)."""

    layers: list[ShardedLayer]  # type: ignore[assignment]  # this cache makes every layer itself (update)

    def __init__(self, sp_size: int, sp_rank: int, windows: list[int | None] | None = None, states: dict | None = None):
        super().__init__(layers=[])
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.windows = windows or []  # per layer, the unpatched cache's window (`unpatched_windows`)
        # the layers of the unpatched cache that hold a token mixer's states, not keys (`unpatched_states`):
        # the mixer fills them in the prompt's forward (the whole sequence's, or this rank's heads' states)
        if states:  # every layer made now: the mask helpers look for the first attention layer among them
            for i in range(max(len(self.windows), max(states) + 1)):
                if isinstance(states.get(i), ShardedStateLayer):
                    layer = states[i]
                    layer.sp_size, layer.sp_rank = sp_size, sp_rank
                    layer.cache_window = self.windows[i] if i < len(self.windows) else None
                    self.layers.append(layer)
                elif i in states:
                    self.layers.append(states[i])
                else:
                    self._append()
        # set while a mixer split along the sequence runs its prompt forward (`update_conv_state`)
        self.conv_tail: Callable | None = None
        # (index [n], valid [b or 1, n] | None, length, left padding [b] | None) while the prefill runs
        self._prompt: tuple[torch.Tensor, torch.Tensor | None, int, torch.Tensor | None] | None = None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        """A mixer split along the sequence in the prompt's forward (`conv_tail` set, `mixers/halo.ConvTail`): the
        layer keeps the whole prompt's last inputs and counts its tokens, as unpatched; the mixer convolves its own
        tokens (their halo added by the mixer), so they are what is returned."""
        if self.conv_tail is None:
            return super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)
        tail, length = self.conv_tail(conv_states, kwargs.get("conv_kernel_size"))
        super().update_conv_state(tail, layer_idx, state_idx, **kwargs)
        count = getattr(self.layers[layer_idx], "cumulative_length_linear", None)
        if state_idx == 0 and isinstance(count, torch.Tensor):
            count.add_(length - tail.shape[-1])
        return conv_states

    def begin_prefill(self, index: torch.Tensor, valid: torch.Tensor | None, length: int, lead=None) -> None:
        """The sharded prefill forward is about to run: its local tokens sit at these global indices."""
        self._prompt = (index, valid, length, lead)

    def end_prefill(self) -> None:
        self._prompt = None

    @property
    def prefilling(self) -> bool:
        """The prompt's sharded forward is running."""
        return self._prompt is not None

    def _append(self) -> None:
        i = len(self.layers)
        self.layers.append(ShardedLayer(self.sp_size, self.sp_rank, self.windows[i] if i < len(self.windows) else None))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self._append()
        layer = self.layers[layer_idx]
        if self._prompt is not None and layer.keys is None:
            return layer.prefill(key_states, value_states, *self._prompt)
        return layer.update(key_states, value_states)

    def layer(self, layer_idx: int) -> ShardedLayer | None:
        """Layer `layer_idx`'s own shard; None if it stores no K/V (a KV-shared layer)."""
        own = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return own if isinstance(own, ShardedLayer) and own.keys is not None else None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The global length, read off an attention layer (a mixer's state layer counts no tokens). A layer the
        prompt's forward has not reached yet has seen none (as transformers' DynamicCache says; a module that
        counts its queries from there, Llama 4's temperature tuning, must see 0)."""
        if self._prompt is not None and layer_idx >= len(self.layers):
            return 0
        sharded = [layer for layer in self.layers if isinstance(layer, ShardedLayer)]
        if layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], ShardedLayer):
            return self.layers[layer_idx].get_seq_length()
        if sharded:
            return sharded[0].get_seq_length()
        # a model without attention (Mamba): the tokens its mixers' state layers counted, as the unpatched cache
        # says (else every decoding step would look like the prompt's forward)
        counts = [layer.get_seq_length() for layer in self.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        return int(counts[0]) if counts else 0

    def fresh(self, layer_idx: int) -> bool:
        """Layer `layer_idx` holds no mixer state yet (the prompt's forward has not reached it)."""
        layer = self.layers[layer_idx] if isinstance(layer_idx, int) and 0 <= layer_idx < len(self.layers) else None
        held = getattr(layer, "has_previous_state", None)
        return isinstance(held, (dict, list)) and not any(held.values() if isinstance(held, dict) else held)

    def reader(self, layer_idx: int, key: torch.Tensor, window: int | None) -> ShardedLayer:
        """The shard that layer `layer_idx`'s attention reads in a decoding step, given its keys and window:
        its own (the window set), or for a layer that stores none, the shard whose keys `key` is (the tensor
        that layer's `update` returned this step), which must have the same window (it keeps what that
        window sees)."""
        own = self.layer(layer_idx)
        if own is not None:
            own.set_window(narrower(window, own.cache_window))
            return own
        shared = next((la for la in self.layers if isinstance(la, ShardedLayer) and la.keys is key), None)
        if shared is not None and shared.window == narrower(window, shared.cache_window):
            return shared
        why = (
            "attends over keys that are no layer's cache shard as updated this step"
            if shared is None
            else f"reads the cache of a layer with sliding window {shared.window}, with window {window}"
        )
        # the same on every rank: the model's code decides it
        raise NotImplementedError(
            f"generate under sequence parallelism: attention layer {layer_idx} stores no K/V and {why}; the "
            "sequence-sharded cache lets a layer attend over its own K/V or over another layer's with its "
            "window. Generate without SP (`with seqpar_hf.sp_disabled(model):`)"
        )

    def local_bytes(self) -> int:
        """Bytes of K/V this rank holds (the shard)."""
        return sum(layer.local_bytes() for layer in self.layers if isinstance(layer, ShardedLayer))


def narrower(a, b):
    """The narrower of two sliding windows (None: no window); chunks of C keep within a window of C."""
    if isinstance(a, Chunks) or isinstance(b, Chunks):
        chunks, other = (a, b) if isinstance(a, Chunks) else (b, a)
        if other is None or isinstance(other, Chunks) and other == chunks or int(other) >= chunks.size:
            return chunks
        raise NotImplementedError(f"chunked attention ({chunks.size}) within a narrower sliding window ({other})")
    return b if a is None else a if b is None else min(int(a), int(b))


def unpatched_states(model) -> tuple[dict, list[int]]:
    """({layer index: a fresh copy of the unpatched cache's layer} for the layers that hold a token mixer's
    states and no keys, [indices of layers that hold both], which the sharded cache does not keep)."""
    from transformers.cache_utils import CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin

    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return {}, []
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    states: dict = {}
    both: list[int] = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin) and isinstance(layer, CacheLayerMixin):
            both.append(i)
            if getattr(layer, "is_sliding", False) or type(layer).__name__ != "LinearAttentionAndFullAttentionLayer":
                continue  # a window in the same layer as the states: not held (refused at generate)
            states[i] = ShardedStateLayer(0, 0, None, layer.number_of_states)  # sizes set by the cache
            both.pop()
        elif not isinstance(layer, CacheLayerMixin):  # a mixer's state layer, or a layer that caches nothing
            states[i] = layer
    return states, both


def unpatched_windows(model) -> list[int | None]:
    """Per layer, the window of the cache transformers' `generate` would build for `model` (a
    `DynamicCache` from the decoder's config, as `_prepare_cache_for_generation` does for the cache
    implementations generate under SP accepts): the keys a decoding step can see besides its mask."""
    from transformers.cache_utils import DynamicCache

    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():  # the model supplies its own cache (none here)
        return []
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    windows = [
        getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
        for layer in cache.layers
    ]
    return [None if w is None else int(w) for w in windows]
