"""Sentence-aligned positions for the document model (`--sentence_positions`): the tokens of sentence k
of a document (k counted by its numbered markers, from 0) sit at k x stride + their offset in the sentence, on both
sides, instead of their index in the whole document.

Why: with absolute sinusoidal positions this model aligns a target token with source tokens by position. In a
document the two sides drift apart (French runs longer), so sentence k starts at different positions on the two
sides and the model has to learn to align by the markers over hundreds of tokens; a sentence model never had to.
Aligned this way, the decoder writing word j of sentence k sits where word j of source sentence k sits, as in a
sentence pair, and the gap between sentences is the same on both sides.

    source   <s1> w w w  <s2> w w ...      positions 0 1 2 3   S S+1 S+2 ...
    decoder  start <s1> w w w <s2> w ...   positions 0 1 2 3 4 S+1 S+2 ...

A decoder input sits one position later than the same source token: the decoder input at position q predicts the
target token whose source counterpart is at q (as in a sentence pair, where the start token at 0 predicts the first
word, source position 0). Offsets past the stride are clamped (the stride is the position table over the document
sentences: 80 tokens with the recipe's lengths). Rows without markers keep their plain positions.

Marian takes no position ids, so the positions go in by hooks: on the model's forward (which sees the whole batch,
on every rank: the tables of the whole sequences), on its encoder (called alone by generate in one process), on each
position table (it gets the rows of the table at the indices it is given: this rank's shard of the sequence under SP,
the library's hook having run first), and generation's `generate` (the whole source, before the library shards it)
and `prepare_inputs_for_generation` (each beam's whole history: a decoding step's forward sees its last token only).
With `local_layers` N, the lower N layers of each stack attend within each sentence (the cross-attention from
target sentence k to source sentence k), the layers above over the whole document (G-Transformer's group attention):
a pre-hook on each of their attention modules hands it the whole mask (the sentences, causal for the decoder, the
source's padding), and they run plain eager attention, not a library's (seqpar_hf's takes no per-call mask and
refuses one), so they need the whole sequence: one process only.
Install them after `patch_model` (the recipe does, after its Trainer); under SP the loss, gradients and generated
tokens are one process's (tests/test_sentence_positions.py). A saved model keeps `sentence_position_stride` in its
config; `install_from_config` puts the hooks back after `from_pretrained`.
"""

from __future__ import annotations

import copy

import torch

if __package__:  # imported as recipes.sentence_positions (tests)
    from .translation_data import marker
else:  # a script's sibling
    from translation_data import marker


def _last_marker(ids: torch.Tensor, markers: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[b, T] each token's index, the sentence of the last marker at or before it (0 where none) and that marker's
    index (-1 where none)."""
    index = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    markers = markers.to(ids.device)
    slot = (ids.unsqueeze(-1) == markers).long().argmax(-1)  # which marker (0 for the other tokens)
    last = torch.where(torch.isin(ids, markers), index, torch.full_like(index, -1)).cummax(-1).values
    return index, slot.gather(-1, last.clamp(min=0)), last


def sentence_index(ids: torch.Tensor, markers: torch.Tensor) -> torch.Tensor:
    """[b, T] the sentence k (from 0) of each token: that of the last marker at or before it (<s{k+1}>); tokens
    with none before them (the decoder's start token, rows without markers) are in sentence 0."""
    _, k, last = _last_marker(ids, markers)
    return torch.where(last >= 0, k, torch.zeros_like(k))


def pair_index(given: torch.Tensor) -> torch.Tensor:
    """[b, T] the pair of each token of packed rows, from their positions that restart at 0 for every pair (the
    padding after the last pair: a pair per token, whose keys the source's mask hides and whose labels are -100)."""
    return (given == 0).long().cumsum(-1) - 1


def local_mask(queries: torch.Tensor, keys: torch.Tensor, causal: bool) -> torch.Tensor:
    """[b, 1, q, k] True where a query of sentence i may attend: keys of sentence i (and, causal, not later: the
    queries are the last q of the k keys)."""
    allowed = queries.unsqueeze(-1) == keys.unsqueeze(-2)
    if causal:
        q, k = queries.shape[-1], keys.shape[-1]
        rows = torch.arange(q, device=keys.device).unsqueeze(-1) + (k - q)
        allowed = allowed & (torch.arange(k, device=keys.device) <= rows)
    return allowed.unsqueeze(1)


def sentence_positions(
    ids: torch.Tensor, markers: torch.Tensor, stride: int, decoder: bool, given: torch.Tensor | None = None
) -> torch.Tensor:
    """[b, T] positions of the tokens `ids` [b, T]: k x stride + offset after the marker of sentence k (<s{k+1}>;
    the decoder's one later); stride 0: the offset alone (each sentence placed as a sentence pair). `given`: the
    row's own positions, restarting at 0 for each pair of a packed row (each pair placed by its own marker: a
    document's sentences packed as pairs, recipes/document_sentences.py); tokens with no marker before them in their
    pair (the decoder's start token) keep those."""
    index, k, last = _last_marker(ids, markers)
    given = index if given is None else given.expand_as(ids)
    pair_start = torch.where(given == 0, index, torch.zeros_like(index)).cummax(-1).values
    placed = last >= pair_start  # a marker before this token (or it) in its pair
    within = index - last + int(decoder)
    if stride == 0:  # every sentence from the start, as a sentence pair of the warm start
        return torch.where(placed, within, given)
    return torch.where(placed, k * stride + within.clamp(max=stride - 1), given)


class SentencePositions:
    """The hooks (see the module's docstring). `stride` x `sentences` must fit the model's position tables."""

    def __init__(self, model, marker_ids: list[int], stride: int, local_layers: int = 0):
        rows = model.config.max_position_embeddings
        if stride < 0 or stride * len(marker_ids) > rows:
            raise ValueError(
                f"--sentence_positions: {len(marker_ids)} sentences x stride {stride} = "
                f"{stride * len(marker_ids)} positions, more than the model's table of {rows}"
            )
        self.markers, self.stride = torch.tensor(marker_ids), stride
        self.current: dict[str, torch.Tensor | None] = {"encoder": None, "decoder": None}
        self.pending: torch.Tensor | None = None  # generation: this step's decoder positions
        self.inside = False  # in the model's forward, whose hook saw the whole inputs
        self.packed = False  # that forward's rows are packed pairs (placed and grouped per pair)
        self.step = False  # that forward is a decoding step: the decoder's positions are its own tokens'
        self.generating = False  # in generate, whose wrapper placed the whole source (the encoder may get a shard)
        self.groups: dict[str, torch.Tensor | None] = {"encoder": None, "decoder": None}  # sentence of each token
        self.source_mask: torch.Tensor | None = None  # [b, S] the source's padding (the local layers' keys)
        self.pending_groups: torch.Tensor | None = None  # generation: the beams' whole histories
        model.config.sentence_position_stride = stride
        backbone = model.get_encoder(), model.get_decoder()
        layers = min(len(backbone[0].layers), len(backbone[1].layers))
        if not 0 <= local_layers <= layers:
            raise ValueError(
                f"--sentence_local_layers {local_layers}: from 0 to {layers} (the layers of the shallower stack; "
                "those above attend over the whole document)"
            )
        model.config.sentence_local_layers = local_layers
        self.handles = [
            model.register_forward_pre_hook(self._model, with_kwargs=True),
            model.register_forward_hook(self._left, always_call=True),
            backbone[0].register_forward_pre_hook(self._encoder, with_kwargs=True),
            backbone[0].embed_positions.register_forward_pre_hook(self._encoder_table, with_kwargs=True),
            backbone[1].embed_positions.register_forward_pre_hook(self._decoder_table, with_kwargs=True),
        ]
        self.plain_configs: list = []  # (module, its config before): the local layers' attention runs plain eager
        for i in range(local_layers):  # G-Transformer's group attention in the lower layers
            for kind, attention in (
                ("encoder", backbone[0].layers[i].self_attn),
                ("decoder", backbone[1].layers[i].self_attn),
                ("cross", backbone[1].layers[i].encoder_attn),
            ):
                self.handles.append(attention.register_forward_pre_hook(_Local(self, kind), with_kwargs=True))
                # its own config, so that a library's attention (seqpar_hf's takes no per-call masks) is not the
                # one it runs: the mask is whole here, so these layers need the whole sequence (refused under SP).
                # Eager: a step of the ramp's pieces as fast as with no local layer, sdpa's CPU kernel 1.35x on
                # their rows of 36 tokens (python -m benchmarks.sentence_local_layers)
                self.plain_configs.append((attention, attention.config))
                attention.config = copy.copy(attention.config)
                attention.config._attn_implementation = "eager"
        model.prepare_inputs_for_generation = _Prepare(self, model.prepare_inputs_for_generation)
        model.generate = _Generate(self, model.generate)
        self.model = model

    def remove(self) -> None:
        """The model's plain positions back."""
        for handle in self.handles:
            handle.remove()
        for attention, config in self.plain_configs:
            attention.config = config
        self.model.__dict__.pop("prepare_inputs_for_generation", None)
        if isinstance(self.model.__dict__.get("generate"), _Generate):
            self.model.generate = self.model.generate.original

    def positions(self, ids: torch.Tensor, decoder: bool, given: torch.Tensor | None = None) -> torch.Tensor:
        return sentence_positions(ids, self.markers, self.stride, decoder, given)

    def _left(self, module, args, output):
        self.inside = self.packed = False  # an encoder called alone next (generate) reads whole rows

    def _model(self, module, args, kwargs):
        self.inside, self.step, self.packed = True, False, False
        if kwargs.get("position_ids") is not None or kwargs.get("decoder_position_ids") is not None:
            return self._packed(kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.current["encoder"] = self.positions(ids, decoder=False)
            self.groups["encoder"] = sentence_index(ids, self.markers)
        if ids is not None or kwargs.get("attention_mask") is not None:  # a decoding step gets the source's
            self.source_mask = kwargs.get("attention_mask")
        if self.pending is not None:
            self.current["decoder"], self.pending, self.step = self.pending, None, True
            self.groups["decoder"], self.pending_groups = self.pending_groups, None
            return None
        dec = kwargs.get("decoder_input_ids")
        if dec is None and kwargs.get("labels") is not None:
            dec = module.prepare_decoder_input_ids_from_labels(labels=kwargs["labels"])
        self.current["decoder"] = None if dec is None else self.positions(dec, decoder=True)
        self.groups["decoder"] = None if dec is None else sentence_index(dec, self.markers)
        return None

    def _packed(self, kwargs) -> None:
        """Packed rows (seqpar_hf's convention, `Seq2SeqPackingCollator`): each pair placed by its own marker from
        the positions that restart per pair, and each pair a sentence of its own for the local layers (pair i of
        the targets with pair i of the sources); the decoder inputs must be given, each pair's own."""
        ids, decoder = kwargs.get("input_ids"), kwargs.get("decoder_input_ids")
        given, decoder_given = kwargs.get("position_ids"), kwargs.get("decoder_position_ids")
        if ids is None or decoder is None or given is None or decoder_given is None:
            raise ValueError(
                "--sentence_positions: packed rows need input_ids, decoder_input_ids, position_ids and "
                "decoder_position_ids (seqpar_hf.Seq2SeqPackingCollator's rows, its decoder_start_token_id given)"
            )
        self.packed = True
        self.current["encoder"] = self.positions(ids, decoder=False, given=given)
        self.current["decoder"] = self.positions(decoder, decoder=True, given=decoder_given)
        self.groups["encoder"], self.groups["decoder"] = pair_index(given), pair_index(decoder_given)
        self.source_mask = kwargs.get("attention_mask")

    def _encoder(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and not self.inside and not self.generating:  # the encoder called alone
            self.current["encoder"] = self.positions(ids, decoder=False)
            self.groups["encoder"] = sentence_index(ids, self.markers)
            self.source_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        return None

    def _encoder_table(self, module, args, kwargs):
        return self._table("encoder", args, kwargs)

    def _decoder_table(self, module, args, kwargs):
        return self._table("decoder", args, kwargs)

    def _table(self, side: str, args, kwargs):
        table = self.current[side]
        if table is None:
            return None
        shape = (tuple(args[0]) if args else tuple(kwargs["input_ids_shape"]))[:2]
        given = kwargs.get("position_ids")
        if (side == "decoder" and self.step) or given is None or self.packed:
            # a decoding step's own tokens; an encoder given no ids: the whole sequence; packed rows: the given
            # positions restart per pair, they index no table (one process: the row is whole)
            positions = table
        else:  # the indices of this call's tokens in the whole sequence (this rank's shard under SP; padding 0)
            index = given.to(table.device).clamp(max=table.shape[1] - 1)
            positions = table[:, index] if index.dim() == 1 else table.gather(1, index)
        if tuple(positions.shape) != shape:
            raise RuntimeError(
                f"--sentence_positions: the {side}'s positions are {tuple(positions.shape)} for a forward of "
                f"{shape} tokens"
            )
        kwargs["position_ids"] = positions
        return args, kwargs


class _Prepare:
    """The model's `prepare_inputs_for_generation`, which also keeps the positions of the tokens each decoding step
    feeds, from the beams' whole histories. Hooks and this are bound objects, not closures, so a deep copy of
    the model (a plain copy for generation) gets hooks of its own."""

    def __init__(self, positions: SentencePositions, original):
        self.positions, self.original = positions, original

    def __call__(self, input_ids, *args, **kwargs):
        inputs = self.original(input_ids, *args, **kwargs)
        step = inputs.get("decoder_input_ids")
        if step is not None:
            self.positions.pending = self.positions.positions(input_ids, decoder=True)[:, -step.shape[1] :]
            self.positions.pending_groups = sentence_index(input_ids, self.positions.markers)
        return inputs


class _Local:
    """A lower layer's attention kept within each sentence (`kind`: the encoder's, the decoder's or the
    cross-attention): a whole mask (the sentences, causal for the decoder, the source's padding), and the layer's
    own where it gets one (a patched model's layers get none: its attention takes masks from the inputs)."""

    def __init__(self, positions: SentencePositions, kind: str):
        self.positions, self.kind = positions, kind

    def __call__(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        groups = self.positions.groups
        keys = groups["decoder" if self.kind == "decoder" else "encoder"]
        queries = groups["encoder" if self.kind == "encoder" else "decoder"]
        if keys is None or queries is None:
            return None  # no markers seen (a forward given embeddings): the layer as it is
        queries = queries[:, -hidden.shape[1] :]  # a decoding step's query is the history's last token
        if keys.shape[0] != hidden.shape[0]:  # generation's beams of one source
            keys = keys.repeat_interleave(hidden.shape[0] // keys.shape[0], 0)
        if queries.shape[1] != hidden.shape[1] or queries.shape[0] != hidden.shape[0]:
            raise RuntimeError(
                f"--sentence_local_layers: the {self.kind} attention has {tuple(hidden.shape[:2])} queries for "
                f"sentences of {tuple(queries.shape)} tokens (a sharded sequence: not under SP)"
            )
        allowed = local_mask(queries.to(hidden.device), keys.to(hidden.device), causal=self.kind == "decoder")
        padding = self.positions.source_mask
        if self.kind != "decoder" and padding is not None:  # the source's padding keys, whatever mask is given
            if padding.shape[0] != hidden.shape[0]:
                padding = padding.repeat_interleave(hidden.shape[0] // padding.shape[0], 0)
            allowed = allowed & padding.bool().to(hidden.device)[:, None, None, :]
        given = kwargs.get("attention_mask")
        if given is not None:
            allowed = allowed & (given if given.dtype == torch.bool else given == 0)
        # additive, as eager attention takes it (float32: the scores of bf16 queries promote to it)
        kwargs["attention_mask"] = torch.zeros(allowed.shape, device=hidden.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min
        )
        return args, kwargs


class _Generate:
    """The model's `generate` (under SP the library's), which places the whole source first: under SP the encoder
    runs on this rank's shard, and its position table gets the shard's indices in the whole source."""

    def __init__(self, positions: SentencePositions, original):
        self.positions, self.original = positions, original

    def __call__(self, *args, **kwargs):
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        p = self.positions
        p.current["encoder"] = None if ids is None else p.positions(ids, decoder=False)
        p.groups["encoder"] = None if ids is None else sentence_index(ids, p.markers)
        p.source_mask = kwargs.get("attention_mask")
        p.generating = ids is not None
        try:
            return self.original(*args, **kwargs)
        finally:
            p.generating = False


def install_from_config(model, tokenizer) -> SentencePositions | None:
    """The hooks of a saved document model trained with --sentence_positions (after `from_pretrained`)."""
    stride = getattr(model.config, "sentence_position_stride", None)
    if stride is None:
        return None
    ids, k = [], 1
    while tokenizer.convert_tokens_to_ids(marker(k)) not in (None, tokenizer.unk_token_id):
        ids.append(tokenizer.convert_tokens_to_ids(marker(k)))
        k += 1
    return SentencePositions(model, ids, stride, getattr(model.config, "sentence_local_layers", 0))
