"""--sentence_positions (recipes/sentence_positions.py): sentence k of a document at k x stride + its offset on both
sides. The hooked model's generation must see the positions its training forward sees (a decoding step's forward
sees one token; the positions come from each beam's history), rows without markers keep their plain positions,
and a saved model gets its hooks back from its config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LogitsProcessor, MarianMTModel

from recipes import translation_data
from recipes.sentence_positions import (
    SentencePositions,
    install_from_config,
    local_mask,
    sentence_index,
    sentence_positions,
)
from recipes.translation_training import build_model

MARKERS = torch.tensor([50, 51, 52, 53])


class ForceAt(LogitsProcessor):
    """Only `token` once the rows hold `length` tokens (a marker where the tiny model would write none)."""

    def __init__(self, length: int, token: int):
        self.length, self.token = length, token

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] != self.length:
            return scores
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.token] = scores[:, self.token]
        return forced


def test_the_positions_of_sentences_on_both_sides():
    source = torch.tensor([[50, 5, 6, 7, 51, 8, 9, 52, 10, 1, 0, 0]])
    assert sentence_positions(source, MARKERS, 10, False).tolist() == [[0, 1, 2, 3, 10, 11, 12, 20, 21, 22, 23, 24]]
    # the decoder's inputs: the start token at 0, each marker one later than its source's (it predicts the first word)
    decoder = torch.tensor([[0, 50, 5, 6, 51, 8, 9, 9, 52, 10]])
    assert sentence_positions(decoder, MARKERS, 10, True).tolist() == [[0, 1, 2, 3, 11, 12, 13, 14, 21, 22]]
    # stride 0: every sentence from 0, as a sentence pair (the decoder's marker at 1, after the start token)
    assert sentence_positions(source, MARKERS, 0, False).tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]]
    assert sentence_positions(decoder, MARKERS, 0, True).tolist() == [[0, 1, 2, 3, 1, 2, 3, 4, 1, 2]]
    # offsets past the stride are clamped; rows without markers keep their index
    long = torch.tensor([[50] + [5] * 6])
    assert sentence_positions(long, MARKERS, 4, False).tolist() == [[0, 1, 2, 3, 3, 3, 3]]
    assert sentence_positions(torch.tensor([[5, 6, 7]]), MARKERS, 4, False).tolist() == [[0, 1, 2]]
    # packed rows (the warm start): each pair at its own marker's slot, from the positions that restart per pair
    packed = torch.tensor([[52, 5, 6, 1, 50, 7, 1, 8, 9, 1]])
    given = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    assert sentence_positions(packed, MARKERS, 10, False, given).tolist() == [[20, 21, 22, 23, 0, 1, 2, 0, 1, 2]]
    packed = torch.tensor([[0, 53, 5, 6, 0, 51, 7, 0, 8]])
    given = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])
    assert sentence_positions(packed, MARKERS, 10, True, given).tolist() == [[0, 31, 32, 33, 0, 11, 12, 0, 1]]


TEXTS = ["the cat sat on the mat .", "le chat est assis sur le tapis .", "I am here .", "je suis ici ."] * 4


def _tiny_document_model(layers: int = 1):
    """A `layers` + `layers`-layer recipe model with 4 markers, its tokenizer and the markers' ids, alike in every
    process."""
    tokenizer = translation_data.add_markers(translation_data.train_tokenizer(TEXTS, 60), 4)
    sizes = SimpleNamespace(d_model=16, encoder_layers=layers, decoder_layers=layers, attention_heads=2, ffn_dim=32)
    sizes.dropout = sizes.attention_dropout = 0.0
    torch.manual_seed(0)
    model = build_model(sizes, tokenizer, 4 * 20)
    return model, tokenizer, [tokenizer.convert_tokens_to_ids(translation_data.marker(k)) for k in range(1, 5)]


@pytest.fixture(
    scope="module",
    params=[(1, 0, 20), (2, 1, 20), (1, 1, 0)],
    ids=["1 layer", "2 layers, the lower local", "1 layer, local, every sentence from 0"],
)
def document_model(request):
    layers, local, stride = request.param
    model, tokenizer, markers = _tiny_document_model(layers)
    model.local_layers, model.stride = local, stride  # the hooks' settings in the tests that take them
    model.eval()
    texts = TEXTS
    source = tokenizer(
        [" ".join(f"{translation_data.marker(k + 1)} {s}" for k, s in enumerate(texts[:3])), "the cat sat ."],
        return_tensors="pt",
        padding=True,
    )
    return model, tokenizer, markers, source


def _scores(model, source, sequences):
    with torch.no_grad():
        logits = model(**source, decoder_input_ids=sequences[:, :-1]).logits
    return torch.log_softmax(logits.float(), -1).gather(2, sequences[:, 1:, None]).squeeze(-1)


def test_generation_sees_the_positions_training_sees(document_model):
    model, tokenizer, markers, source = document_model
    with torch.no_grad():
        plain = model(**source, decoder_input_ids=torch.tensor([[0, markers[0], 7, markers[1], 8]] * 2)).logits
    hooks = SentencePositions(model, markers, model.stride, model.local_layers)
    try:
        with torch.no_grad():
            aligned = model(**source, decoder_input_ids=torch.tensor([[0, markers[0], 7, markers[1], 8]] * 2)).logits
        assert not torch.allclose(aligned[0], plain[0])  # the document row's positions changed
        torch.testing.assert_close(aligned[1, :1], plain[1, :1])  # the plain sentence's did not (before a marker)

        # a prompt with two sentences begun, the third marker forced at the 7th token: greedy with the cache against
        # a full forward per token (the training path's positions)
        prompt = torch.tensor([[0, markers[0], 7, markers[1], 8]] * 2)
        third = ForceAt(6, markers[2])
        kwargs = {"forced_eos_token_id": None, "max_new_tokens": 10, "min_new_tokens": 10, "logits_processor": [third]}
        out = model.generate(**source, decoder_input_ids=prompt, num_beams=1, do_sample=False, **kwargs)
        ids = prompt
        for _ in range(10):
            with torch.no_grad():
                logits = model(**source, decoder_input_ids=ids).logits[:, -1]
            logits[:, tokenizer.eos_token_id] = float("-inf")
            ids = torch.cat([ids, third(ids, logits).argmax(-1, keepdim=True)], 1)
        assert torch.equal(out, ids) and bool((out[:, 6] == markers[2]).all())

        # beam search: each kept beam's score is what the full forward gives its tokens (the beams reorder)
        beams = model.generate(
            **source,
            decoder_input_ids=prompt,
            num_beams=3,
            length_penalty=0.0,
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )
        scores = _scores(model, source, beams.sequences)[:, prompt.shape[1] - 1 :].sum(-1)
        torch.testing.assert_close(scores, beams.sequences_scores, atol=1e-4, rtol=0)
    finally:
        hooks.remove()


def test_a_deep_copy_keeps_positions_of_its_own(document_model):
    """The trainer may generate with a copy: its hooks and generation wrapper act on the copy's state (greedy with
    the cache against a full forward per token, on the copy alone)."""
    import copy

    model, tokenizer, markers, source = document_model
    hooks = SentencePositions(model, markers, model.stride, model.local_layers)
    try:
        twin = copy.deepcopy(model)
    finally:
        hooks.remove()
    prompt = torch.tensor([[0, markers[0], 7, markers[1], 8]] * 2)
    out = twin.generate(
        **source, decoder_input_ids=prompt, forced_eos_token_id=None, max_new_tokens=6, min_new_tokens=6, num_beams=1
    )
    ids = prompt
    for _ in range(6):
        with torch.no_grad():
            logits = twin(**source, decoder_input_ids=ids).logits[:, -1]
        logits[:, tokenizer.eos_token_id] = float("-inf")
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)
    with torch.no_grad():  # and the copy's positions are the sentences' (the original's are plain again)
        aligned, plain = (m(**source, decoder_input_ids=ids).logits for m in (twin, model))
        assert not torch.allclose(aligned, plain)


def test_a_saved_model_gets_its_positions_back(document_model, tmp_path):
    model, tokenizer, markers, source = document_model

    decoder = torch.tensor([[0, markers[0], 7, markers[1], 8]] * 2)
    hooks = SentencePositions(model, markers, model.stride, model.local_layers)
    try:
        with torch.no_grad():
            expected = model(**source, decoder_input_ids=decoder).logits
        model.save_pretrained(tmp_path)
    finally:
        hooks.remove()
    loaded = MarianMTModel.from_pretrained(tmp_path).eval()
    assert loaded.config.sentence_position_stride == model.stride
    assert loaded.config.sentence_local_layers == model.local_layers
    assert install_from_config(loaded, tokenizer) is not None
    with torch.no_grad():
        torch.testing.assert_close(loaded(**source, decoder_input_ids=decoder).logits, expected)


def test_local_layers_attend_within_each_sentence():
    """--sentence_local_layers 1 of 2: the lower layer's output for a sentence does not change with the other
    sentences (the source's third sentence changed, the decoder's second); the upper layer's does."""
    model, tokenizer, markers = _tiny_document_model(2)
    model.eval()
    assert sentence_index(torch.tensor([[0, 50, 5, 51, 6, 7, 52, 1]]), MARKERS).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2]]
    assert local_mask(torch.tensor([[0, 1]]), torch.tensor([[0, 0, 1]]), causal=True).tolist() == [
        [[[True, True, False], [False, False, True]]]
    ]
    hooks = SentencePositions(model, markers, 20, 1)
    try:
        outputs = {}
        for name, module in [("encoder", model.get_encoder().layers), ("decoder", model.get_decoder().layers)]:
            for i, layer in enumerate(module):
                layer.register_forward_hook(lambda m, a, out, key=(name, i): outputs.__setitem__(key, out))
        runs = []
        for third, second in (("I am here .", 7), ("the cat sat on the mat .", 9)):
            text = " ".join(f"{translation_data.marker(k + 1)} {s}" for k, s in enumerate(TEXTS[:2] + [third]))
            source = tokenizer([text], return_tensors="pt")
            decoder = torch.tensor([[0, markers[0], 7, 8, markers[1], second, 8]])
            with torch.no_grad():
                model(**source, decoder_input_ids=decoder)
            first = int((source["input_ids"][0] == markers[2]).nonzero())  # the source's third sentence begins
            runs.append({key: (out[0] if isinstance(out, tuple) else out)[0].clone() for key, out in outputs.items()})
        torch.testing.assert_close(runs[0][("encoder", 0)][:first], runs[1][("encoder", 0)][:first])
        torch.testing.assert_close(runs[0][("decoder", 0)][:5], runs[1][("decoder", 0)][:5])  # the first sentence
        assert not torch.allclose(runs[0][("encoder", 1)][:first], runs[1][("encoder", 1)][:first])
        assert not torch.allclose(runs[0][("decoder", 1)][:4], runs[1][("decoder", 1)][:4])
        with pytest.raises(ValueError, match="--sentence_local_layers 3: from 0 to 2"):
            SentencePositions(model, markers, 20, 3)
    finally:
        hooks.remove()


def test_sentences_past_the_position_table_and_packed_rows_without_their_decoder_inputs_are_refused(document_model):
    model, _, markers, source = document_model
    hooks = SentencePositions(model, markers, 20)
    try:  # a packed row's decoder inputs and their positions are each pair's own: the hooks cannot make them
        with pytest.raises(ValueError, match=r"^--sentence_positions: packed rows need input_ids, decoder_input_ids, "):
            model(**source, decoder_input_ids=source["input_ids"][:, :3], position_ids=source["input_ids"] * 0)
    finally:
        hooks.remove()
    with pytest.raises(ValueError, match=r"--sentence_positions: 4 sentences x stride 21 = 84 positions, more than"):
        SentencePositions(model, markers, 21)


# -- under SP: the positions of the whole documents, each rank its shard ----------------------------------------------
def _sp_case(layers: int = 1):
    """The tiny document model, a batch of documents and generate's arguments, alike in every process."""
    model, tokenizer, markers = _tiny_document_model(layers)
    doc = lambda side, n: " ".join(f"{translation_data.marker(k + 1)} {TEXTS[2 * k + side]}" for k in range(n))
    source = tokenizer([doc(0, 3), doc(0, 2), "the cat sat ."], return_tensors="pt", padding=True)
    labels = tokenizer([doc(1, 3), doc(1, 2), "le chat ."], return_tensors="pt", padding=True)["input_ids"]
    labels[labels == tokenizer.pad_token_id] = -100
    shifted = model.prepare_decoder_input_ids_from_labels(labels=labels)
    batch = {**source, "labels": labels, "decoder_input_ids": shifted}
    generation = {
        **source,
        "num_beams": 2,
        "max_new_tokens": 9,
        "min_new_tokens": 9,
        "forced_eos_token_id": None,
        "logits_processor": [ForceAt(1, markers[0]), ForceAt(4, markers[1])],
    }
    return model, markers, batch, generation


def _loss_and_gradients(model, loss) -> list[float]:
    loss.backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.requires_grad and p.grad is not None]
    return torch.cat([loss.detach().reshape(1), *grads])


def _sp_rank(out_dir: str, stride: int) -> dict:
    import torch.distributed as dist

    from recipes.train_translation import RecipeTrainingArguments
    from recipes.translation_training import BudgetTrainer

    model, markers, batch, generation = _sp_case()
    args = RecipeTrainingArguments(
        output_dir=out_dir, sp_size=2, use_cpu=True, report_to=[], label_smoothing_factor=0.0
    )  # the plain model's loss
    trainer = BudgetTrainer(model=model, args=args, train_dataset=[{"input_ids": [2, 1], "labels": [3, 1]}] * 2)
    SentencePositions(model, markers, stride)  # after the patch, as the recipe does
    results = {}
    for name, split in (("sequences", None), ("rows", lambda inputs: True)):
        trainer.split_rows = split
        model.zero_grad()
        flat = _loss_and_gradients(model, trainer.compute_loss(trainer.model, dict(batch)))
        dist.all_reduce(flat)  # what the data-parallel wrapper does over the group
        results[name] = (flat / dist.get_world_size()).tolist()
    model.eval()
    results["generated"] = model.generate(**generation).tolist()
    return results


def _local_rank(out_dir: str) -> dict:
    """The recipe's one process: the Trainer's patched model (sp=1), the lower of 2 layers local."""
    from recipes.train_translation import RecipeTrainingArguments
    from recipes.translation_training import BudgetTrainer

    model, markers, batch, generation = _sp_case(2)
    args = RecipeTrainingArguments(output_dir=out_dir, sp_size=1, use_cpu=True, report_to=[], label_smoothing_factor=0)
    trainer = BudgetTrainer(model=model, args=args, train_dataset=[{"input_ids": [2, 1], "labels": [3, 1]}] * 2)
    SentencePositions(model, markers, 20, 1)
    flat = _loss_and_gradients(model, trainer.compute_loss(trainer.model, dict(batch)))
    model.eval()
    result = {"trained": flat.tolist(), "generated": model.generate(**generation).tolist()}

    def masked(module, args, kwargs):  # a mask made by a hook, on a layer the library attends (the upper one)
        kwargs["attention_mask"] = torch.ones(args[0].shape[0], 1, args[0].shape[1], args[0].shape[1], dtype=torch.bool)
        return args, kwargs

    model.get_encoder().layers[1].self_attn.register_forward_pre_hook(masked, with_kwargs=True)
    try:
        trainer.compute_loss(trainer.model, dict(batch))
    except NotImplementedError as error:
        result["refused"] = str(error)
    return result


@pytest.mark.multiprocess
def test_local_layers_train_and_generate_as_the_plain_model_under_the_trainer(tmp_path):
    """seqpar_hf's attention takes no per-call masks (it refuses one): the local layers run plain eager attention
    with their whole mask, so the Trainer's patched model in one process trains and generates as the unpatched
    model."""
    import numpy as np

    from tests.helpers.spawn import spawn

    (rank,) = spawn(_local_rank, 1, str(tmp_path))
    model, markers, batch, generation = _sp_case(2)
    hooks = SentencePositions(model, markers, 20, 1)
    expected = _loss_and_gradients(model, model(**batch).loss).numpy()
    tokens = model.eval().generate(**generation).tolist()
    hooks.remove()
    hooks = SentencePositions(model, markers, 20, 0)
    model.zero_grad()
    whole = _loss_and_gradients(model, model.train()(**batch).loss).numpy()
    hooks.remove()
    assert np.abs(whole - expected).max() > 1e-4  # the local layer matters for this batch (its gradients)
    np.testing.assert_allclose(np.array(rank["trained"]), expected, rtol=1e-4, atol=1e-6)
    assert rank["generated"] == tokens
    assert rank.get("refused", "").startswith(
        "seqpar_hf: encoder.layers.1.self_attn was given an attention mask of shape (3, 1, 22, 22) that transformers' "
        "mask functions did not build (a forward hook or the model's own code made it)"
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("stride", [20, 0], ids=["slots", "each-from-0"])
def test_sp_trains_and_generates_as_one_process(tmp_path, stride):
    """sp=2: the documents split along their sequences (and the ramp's rows split across the group) give the loss and
    gradients of one process with the same positions (each sentence at its slot, or each from 0: a shard's tokens
    get positions from sentences that began on the other rank); beam search under SP (the encoder on shards) its
    tokens."""
    import numpy as np

    from tests.helpers.spawn import spawn

    ranks = spawn(_sp_rank, 2, str(tmp_path), stride)
    model, markers, batch, generation = _sp_case()
    hooks = SentencePositions(model, markers, stride)
    expected = _loss_and_gradients(model, model(**batch).loss).numpy()
    model.eval()
    tokens = model.generate(**generation).tolist()
    hooks.remove()
    model.zero_grad()
    plain = _loss_and_gradients(model, model.train()(**batch).loss).numpy()
    assert abs(plain[0] - expected[0]) > 1e-4  # the positions matter for this batch
    for rank in ranks:
        for name in ("sequences", "rows"):
            np.testing.assert_allclose(np.array(rank[name]), expected, rtol=1e-4, atol=1e-6, err_msg=name)
        assert rank["generated"] == tokens
    assert all(tokens[i][1] == markers[0] and tokens[i][4] == markers[1] for i in range(len(tokens)))


# -- documents trained as their sentences (recipes/document_sentences.py) ---------------------------------------------
def _documents_as_sentences_rank(out_dir: str, stride: int) -> dict:
    """The recipe's one process: the Trainer's patched model (sp=1), every layer local; the documents' loss and
    gradients from whole documents and from their sentences packed (in another order) into rows of 24 tokens."""
    from recipes.document_sentences import documents_as_sentences
    from recipes.train_translation import RecipeTrainingArguments
    from recipes.translation_training import BudgetTrainer
    from seqpar_hf.training.packing import Seq2SeqPackingCollator

    model, markers, batch, _ = _sp_case(2)
    args = RecipeTrainingArguments(output_dir=out_dir, sp_size=1, use_cpu=True, report_to=[], label_smoothing_factor=0)
    trainer = BudgetTrainer(model=model, args=args, train_dataset=[{"input_ids": [2, 1], "labels": [3, 1]}] * 2)
    hooks = SentencePositions(model, markers, stride, 2)
    documents = {
        "input_ids": [row[row != 0].tolist() for row in batch["input_ids"][:2]],  # the two with markers
        "labels": [row[row != -100].tolist() for row in batch["labels"][:2]],
    }
    whole = {k: v[:2] for k, v in batch.items()}
    result = {"whole": _loss_and_gradients(model, trainer.compute_loss(trainer.model, whole)).tolist()}
    sentences = documents_as_sentences(documents, markers, model.config.decoder_start_token_id)
    features = [sentences[i] for i in reversed(range(len(sentences)))]
    packed = Seq2SeqPackingCollator(24, 0, model.config.decoder_start_token_id)(features)
    result["rows"] = packed["input_ids"].shape[0]
    model.zero_grad()
    result["sentences"] = _loss_and_gradients(model, trainer.compute_loss(trainer.model, packed)).tolist()
    result["packed after the forward"] = hooks.packed  # generate's encoder, called alone next, reads whole rows
    return result


@pytest.mark.multiprocess
@pytest.mark.parametrize("stride", [0, 20], ids=["each-from-0", "slots"])
def test_documents_train_as_their_sentences_packed(tmp_path, stride):
    """Every layer local: a document's sentences, each an example of its own (its marker, its decoder inputs from
    the document, the next marker to predict) packed into rows, give the whole documents' loss and gradients."""
    import numpy as np

    from tests.helpers.spawn import spawn

    (rank,) = spawn(_documents_as_sentences_rank, 1, str(tmp_path), stride)
    assert rank["rows"] > 1  # several sentences per row, a document's across rows
    assert rank["packed after the forward"] is False
    np.testing.assert_allclose(np.array(rank["sentences"]), np.array(rank["whole"]), rtol=1e-5, atol=1e-6)


def test_a_document_as_its_sentences():
    """Each sentence as the whole document's forward computes it: the first with the start token, the others from
    their marker; the next marker (or </s>) its last label; documents that are not marked so are refused."""
    from recipes.document_sentences import sentence_examples

    markers = [50, 51, 52]
    source, labels = [50, 5, 6, 51, 7, 52, 8, 9, 1], [50, 15, 51, 17, 18, 52, 19, 1]
    assert sentence_examples(source, labels, markers, 0) == [
        {"input_ids": [50, 5, 6], "decoder_input_ids": [0, 50, 15], "labels": [50, 15, 51]},
        {"input_ids": [51, 7], "decoder_input_ids": [51, 17, 18], "labels": [17, 18, 52]},
        {"input_ids": [52, 8, 9, 1], "decoder_input_ids": [52, 19], "labels": [19, 1]},
    ]
    with pytest.raises(ValueError, match="a document with 3 source sentences and 2 target sentences"):
        sentence_examples(source, [50, 15, 51, 17, 1], markers, 0)
    with pytest.raises(ValueError, match="a document's source must start with its first sentence marker"):
        sentence_examples([5, 50, 6, 1], [50, 15, 1], markers, 0)
    with pytest.raises(ValueError, match="a document's target has no sentence marker"):
        sentence_examples([50, 6, 1], [15, 1], markers, 0)
