"""Tests for recipes/translation_data.py and metrics/sacrebleu_local (translation demo data). CPU only, ~20 s."""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / evaluate read it

import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import evaluate
import nltk
import pytest
import sacrebleu
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recipes import translation_data as td  # noqa: E402 - after the repository joins sys.path

METRIC_PATH = str(REPO / "metrics" / "sacrebleu_local")


@pytest.fixture(scope="module")
def pairs():
    return td.load_pairs()


@pytest.fixture(scope="module")
def sample(pairs):
    # Every 50th pair: 3.3k pairs spread over short and long sentences.
    return pairs[::50]


def _digest(splits):
    return hashlib.sha256(json.dumps(splits, sort_keys=True).encode()).hexdigest()


def test_load_pairs(pairs):
    assert len(pairs) == 167_130
    assert pairs[0] == ("Go.", "Va !")
    assert len({en for en, _ in pairs}) == 116_830


def test_load_pairs_names_bad_line(tmp_path):
    import gzip

    path = tmp_path / "bad.tsv.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("Hi.\tSalut !\t\nno tabs here\n")
    with pytest.raises(ValueError, match="bad.tsv.gz:2"):
        td.load_pairs(path)


def test_split_has_no_english_overlap(pairs):
    splits = td.split_by_source(pairs, seed=0)
    train_en = {item["en"] for item in splits["train"]}
    valid_en = [item["en"] for item in splits["validation"]]
    test_en = [item["en"] for item in splits["test"]]
    assert len(set(valid_en)) == len(valid_en) and len(set(test_en)) == len(test_en)
    assert not train_en & set(valid_en) and not train_en & set(test_en) and not set(valid_en) & set(test_en)
    assert len(valid_en) == round(116_830 * 0.01) and len(test_en) == round(116_830 * 0.02)
    # Every pair is used exactly once.
    held_out_pairs = sum(len(item["fr_refs"]) for name in ("validation", "test") for item in splits[name])
    assert len(splits["train"]) + held_out_pairs == len(pairs)


def test_split_is_deterministic(sample):
    first = td.split_by_source(sample, seed=3)
    assert first == td.split_by_source(sample, seed=3)
    assert first != td.split_by_source(sample, seed=4)


def test_split_ignores_python_hash_seed(sample):
    # Same split in a process with a different string-hash seed.
    here = _digest(td.split_by_source(sample, seed=0))
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    code = (
        f"import sys, hashlib, json; sys.path.insert(0, {str(REPO)!r}); "
        "from recipes import translation_data as td; "
        "s = td.split_by_source(td.load_pairs()[::50], seed=0); "
        "print(hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == here


def test_split_collects_all_references(pairs):
    splits = td.split_by_source(pairs, seed=0)
    translations = {}
    for en, fr in pairs:
        translations.setdefault(en, []).append(fr)
    for name in ("validation", "test"):
        for item in splits[name]:
            assert item["fr_refs"] == translations[item["en"]]  # all of them, in file order
            assert item["fr"] == item["fr_refs"][0]
    assert max(len(item["fr_refs"]) for item in splits["test"]) > 1


def test_split_rejects_bad_fractions(sample):
    with pytest.raises(ValueError, match="test_fraction"):
        td.split_by_source(sample, test_fraction=1.5)
    with pytest.raises(ValueError, match="0.6 \\+ 0.5"):
        td.split_by_source(sample, valid_fraction=0.6, test_fraction=0.5)


def test_nbsp_normalised():
    for space in ("\u00a0", "\u202f"):
        assert td.tokenize_fr(f"Qui{space}?") == "Qui ?"
        assert td.tokenize_fr(f"Il a dit{space}: «{space}Viens{space}!{space}»") == "Il a dit : « Viens ! »"
    assert td.normalize_spaces("a\u00a0b\u202fc") == "a b c"


def test_word_tokenize_needs_no_nltk_data(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError(f"NLTK tried to fetch data: {args}")

    monkeypatch.setattr(nltk, "download", forbidden)
    monkeypatch.setattr(nltk.data, "find", forbidden)
    monkeypatch.setattr(nltk.data, "load", forbidden)
    assert td.tokenize_en('I can\'t go. He said "no".') == "I ca n't go. He said `` no '' ."
    assert td.tokenize_fr("Je n'ai pas dit ça.") == "Je n'ai pas dit ça ."


def test_detokenize_fr_round_trip(sample):
    references = [fr for _, fr in sample]
    restored = [td.detokenize_fr(td.tokenize_fr(fr)) for fr in references]
    assert sacrebleu.corpus_bleu(restored, [references]).score > 99
    exact = sum(r == td.normalize_spaces(x) for r, x in zip(restored, references)) / len(references)
    assert exact > 0.98
    assert td.detokenize_fr(td.tokenize_fr('Il a dit "oui", (pas) 50% l’homme… Qui ?')) == (
        'Il a dit "oui", (pas) 50% l’homme… Qui ?'
    )


@pytest.fixture(scope="module")
def small_tokenizer(sample):
    splits = td.split_by_source(sample, seed=0)
    texts = [text for item in splits["train"] for text in (td.tokenize_en(item["en"]), td.tokenize_fr(item["fr"]))]
    return td.train_tokenizer(texts, vocab_size=1000), texts


def test_tokenizer_round_trip_and_reload(small_tokenizer, tmp_path):
    tokenizer, texts = small_tokenizer
    assert len(tokenizer) == 1000
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    encoded = tokenizer(texts[:500])["input_ids"]
    assert all(ids[-1] == tokenizer.eos_token_id for ids in encoded)
    assert tokenizer.batch_decode(encoded, skip_special_tokens=True) == texts[:500]
    # Model output / labels -> French text: padding (0 or -100) and </s> are dropped.
    assert td.decode_french(tokenizer, [[0] + encoded[1] + [-100, -100]]) == [td.detokenize_fr(texts[1])]

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(texts[:500])["input_ids"] == encoded
    assert reloaded.batch_decode(encoded, skip_special_tokens=True) == texts[:500]


def test_join_documents():
    items = [{"en": f"e{i}", "fr": f"f{i}"} for i in range(5)]
    assert td.join_documents(items, 1) == items
    assert td.join_documents(items, 2) == [
        {"en": "e0 e1", "fr": "f0 f1"},
        {"en": "e2 e3", "fr": "f2 f3"},
        {"en": "e4", "fr": "f4"},
    ]
    held_out = [
        {"en": "A.", "fr": "a1", "fr_refs": ["a1", "a2"]},
        {"en": "B.", "fr": "b1", "fr_refs": ["b1"]},
        {"en": "C.", "fr": "c1", "fr_refs": ["c1", "c2", "c3"]},
    ]
    assert td.join_documents(held_out, 3)[0]["fr_refs"] == ["a1 b1 c1", "a2 b1 c2", "a1 b1 c3"]
    with pytest.raises(ValueError, match="got 0"):
        td.join_documents(items, 0)


def test_tokenizer_ids_do_not_depend_on_the_trainers_hash_order(small_tokenizer):
    """tokenizers' BPE trainer numbers its alphabet in hash-map order, different in each process (two builds
    of the full cache entry gave 91 of 8,000 ids differently): two nodes building the same entry would give
    their ranks different ids for the same text. The trained vocabulary is renumbered canonically, so the
    same vocabulary and merges give the same ids whatever numbering the trainer chose."""
    import json

    from tokenizers import Tokenizer

    tokenizer, texts = small_tokenizer
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    a, b = "t</w>", "e</w>"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # another process's numbering
    shuffled = Tokenizer.from_str(json.dumps(state))
    assert shuffled.encode("t e").ids == tokenizer.backend_tokenizer.encode("e t").ids  # swapped ids
    assert td._canonical_ids(shuffled).to_str() == tokenizer.backend_tokenizer.to_str()


def test_sentence_separator(small_tokenizer):
    """Documents with SEP between sentences on the model's sides; the text and references keep spaces, and
    decoding drops SEP, so document BLEU scores the same words."""
    items = [
        {"en": "A b.", "en_tok": "A b .", "fr": "C d.", "fr_tok": "C d .", "fr_refs": ["C d."]},
        {"en": "E.", "en_tok": "E .", "fr": "F.", "fr_tok": "F .", "fr_refs": ["F."]},
    ]
    (doc,) = td.join_documents(items, 2, separator=True)
    assert doc == {
        "en": "A b. E.",
        "en_tok": "A b . <sep> E .",
        "fr": "C d. F.",
        "fr_tok": "C d . <sep> F .",
        "fr_refs": ["C d. F."],
    }
    tokenizer, texts = small_tokenizer
    tokenizer = td.add_separator(copy.deepcopy(tokenizer))
    ids = tokenizer(f"{texts[0]} {td.SEP} {texts[1]}")["input_ids"]
    sep = tokenizer.convert_tokens_to_ids(td.SEP)
    assert sep == len(tokenizer) - 1 and ids.count(sep) == 1  # one token, never split by the BPE
    assert tokenizer.batch_decode([ids], skip_special_tokens=True) == [f"{texts[0]} {texts[1]}"]


def test_sentence_markers(small_tokenizer, sample):
    """Numbered markers before each sentence of a document on the model's sides (never split by the BPE,
    dropped by decoding); the warm-start sentences start with one marker of 1..N on both sides."""
    items = [
        {"en": "A b.", "en_tok": "A b .", "fr": "C d.", "fr_tok": "C d .", "fr_refs": ["C d."]},
        {"en": "E.", "en_tok": "E .", "fr": "F.", "fr_tok": "F .", "fr_refs": ["F."]},
    ]
    (doc,) = td.join_documents(items, 2, markers=True)
    assert doc == {
        "en": "A b. E.",
        "en_tok": "<s1> A b . <s2> E .",
        "fr": "C d. F.",
        "fr_tok": "<s1> C d . <s2> F .",
        "fr_refs": ["C d. F."],
    }
    with pytest.raises(ValueError, match="choose one"):
        td.join_documents(items, 2, separator=True, markers=True)
    tokenizer, texts = small_tokenizer
    tokenizer = td.add_markers(copy.deepcopy(tokenizer), 3)
    ids = tokenizer(f"{td.marker(1)} {texts[0]} {td.marker(3)} {texts[1]}")["input_ids"]
    markers = tokenizer.convert_tokens_to_ids([td.marker(k) for k in (1, 2, 3)])
    assert markers == [len(tokenizer) - 3, len(tokenizer) - 2, len(tokenizer) - 1]
    assert ids[0] == markers[0] and ids.count(markers[2]) == 1
    assert tokenizer.batch_decode([ids], skip_special_tokens=True) == [f"{texts[0]} {texts[1]}"]
    data = td.build_tokenized_splits(
        tokenizer, td.split_by_source(sample, seed=0), 200, 200, document_sentences=3, markers=True
    )
    first = data["train"][0]
    assert [i for i in first["input_ids"] if i in markers] == [i for i in first["labels"] if i in markers] == markers
    for row in data["train_sentences"].select(range(50)):
        assert row["input_ids"][0] == row["labels"][0] and row["input_ids"][0] in markers
        assert sum(i in markers for i in row["input_ids"] + row["labels"]) == 2


def test_marker_order_in_generation():
    """--sentence_markers at generation: markers only in order, one per source sentence, no end before the
    last; a source without markers leaves the scores alone."""
    import torch

    from recipes.translation_training import SentenceMarkerOrder

    m1, m2, eos = 10, 11, 1
    source = torch.tensor([[m1, 5, m2, 6, eos], [m1, 5, eos, 0, 0], [5, 6, eos, 0, 0]])
    order = SentenceMarkerOrder(source, [m1, m2], eos)
    scores = torch.zeros(6, 12)  # 2 beams per row
    written = torch.tensor([[0, 7], [0, m1], [0, m1], [0, 7], [0, 7], [0, 7]])
    out = order(written, scores)
    inf = float("-inf")
    assert out[0, m1] == 0 and out[0, m2] == inf and out[0, eos] == inf  # first the first marker
    assert out[1, m1] == inf and out[1, m2] == 0 and out[1, eos] == inf  # then the second; no end yet
    assert out[2, m1] == out[2, m2] == inf and out[2, eos] == 0  # the only sentence written: may end
    assert out[3, m1] == 0 and out[3, eos] == inf
    assert torch.equal(out[4:, :10], scores[4:, :10]) and (out[4:, 10:] == inf).all()  # no markers in the source
    assert out[:, 5].eq(0).all()  # words are the model's choice


def test_document_ramp_cuts_documents_into_renumbered_pieces():
    """--document_ramp: each document becomes pieces of whole consecutive sentences of at most T tokens a side
    (at least one sentence), each with its markers from <s1> and its </s>; together they hold every token of
    the document; whole documents once the ramp's part of the budget is spent."""
    from recipes.translation_training import DocumentRamp

    eos, m = 1, [100, 101, 102, 103, 104]  # <s1> .. <s5>
    source = [m[0], 7, 8, m[1], 9, m[2], 10, 11, m[3], 12, m[4], 13, eos]  # sentences of 3, 2, 3, 2, 3 tokens
    target = [m[0], 20, m[1], 21, 22, m[2], 23, m[3], 24, 40, 41, 42, m[4], 25, 26, eos]  # 2, 3, 2, 5, 4
    progress = [0.1]
    ramp = DocumentRamp(lambda f: f, m, eos, [(0.3, 6), (0.6, 9)], lambda: progress[0])
    rows = ramp([{"input_ids": source, "attention_mask": [1] * len(source), "labels": target}])
    assert [r["input_ids"] for r in rows] == [
        [m[0], 7, 8, m[1], 9, eos],
        [m[0], 10, 11, eos],
        [m[0], 12, eos],
        [m[0], 13, eos],
    ]
    assert [r["labels"] for r in rows] == [
        [m[0], 20, m[1], 21, 22, eos],
        [m[0], 23, eos],
        [m[0], 24, 40, 41, 42, eos],
        [m[0], 25, 26, eos],
    ]
    assert all(r["attention_mask"] == [1] * len(r["input_ids"]) for r in rows)
    progress[0] = 0.5  # 9 tokens a side: a sentence longer than the limit still makes a piece of its own
    assert [r["labels"] for r in ramp([{"input_ids": source, "attention_mask": [], "labels": target}])] == [
        [m[0], 20, m[1], 21, 22, m[2], 23, eos],
        [m[0], 24, 40, 41, 42, eos],
        [m[0], 25, 26, eos],
    ]
    progress[0] = 0.6
    whole = {"input_ids": source, "attention_mask": [1] * len(source), "labels": target}
    assert ramp([whole]) == [whole]
    with pytest.raises(ValueError, match="must start with its first sentence marker"):
        DocumentRamp(lambda f: f, m, eos, [(1.0, 6)], lambda: 0.0)([{"input_ids": [7, *source], "labels": target}])


def test_document_ramp_mix_draws_each_batchs_limit_alike_on_every_rank():
    """--document_ramp_mix: during the ramp each batch is cut at a limit drawn from the ramp's and whole alike
    (every choice occurs), the same draw on every rank (two collators, as two ranks hold, cut a batch alike);
    whole documents once the ramp's part of the budget is spent."""
    from recipes.translation_training import DocumentRamp

    eos, m = 1, [100, 101, 102, 103, 104]
    progress = [0.0]
    ranks = [DocumentRamp(lambda f: f, m, eos, [(0.3, 6), (0.6, 9)], lambda: progress[0], mix=True) for _ in range(2)]
    seen = set()
    for doc in range(40):
        source = [m[0], 7, 8 + doc, m[1], 9, m[2], 10, 11, m[3], 12, m[4], 13, eos]
        target = [m[0], 20, m[1], 21, 22, m[2], 23, m[3], 24, 40, 41, 42, m[4], 25, 26, eos]
        progress[0] = doc / 80  # below 0.6 throughout
        batch = [{"input_ids": source, "attention_mask": [1] * len(source), "labels": target}]
        rows = ranks[0](batch)
        assert rows == ranks[1](batch)
        seen.add(len(rows))
    assert seen == {4, 3, 1}  # 6 tokens a side: 4 pieces; 9: 3; whole: 1
    progress[0] = 0.6
    assert len(ranks[0](batch)) == 1


def test_build_tokenized_splits(small_tokenizer, sample):
    tokenizer, _ = small_tokenizer
    splits = td.split_by_source(sample, seed=0)
    data = td.build_tokenized_splits(
        tokenizer, splits, max_source_length=24, max_target_length=20, document_sentences=3
    )
    assert set(data) == {"train", "validation", "test", "train_sentences"}
    assert len(data["train"]) == -(-len(splits["train"]) // 3)
    assert len(data["train_sentences"]) == len(splits["train"])  # the same pairs, one per row (the warm start)
    assert data["train_sentences"][0]["input_ids"][-1] == tokenizer.eos_token_id
    assert set(data["train"].column_names) == {"input_ids", "attention_mask", "labels"}
    assert set(data["test"].column_names) == {"input_ids", "attention_mask", "labels", "en", "fr_refs"}
    for row in data["train"]:
        assert len(row["input_ids"]) <= 24 and len(row["labels"]) <= 20
        assert row["input_ids"][-1] == row["labels"][-1] == tokenizer.eos_token_id
        assert row["attention_mask"] == [1] * len(row["input_ids"])
    first = data["test"][0]
    assert first["en"] == " ".join(item["en"] for item in splits["test"][:3])


def test_metric_loads_offline_and_uses_all_references(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("network access while loading the metric")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    bleu = evaluate.load(METRIC_PATH)
    text = "Il fait très beau aujourd'hui à Paris."
    assert bleu.compute(predictions=[text], references=[[text]])["score"] == pytest.approx(100)
    result = bleu.compute(
        predictions=[text, "Je ne sais pas ce que tu veux dire."],
        references=[["Il pleut beaucoup ce matin.", text], ["Je ne sais pas ce que tu veux dire."]],
    )
    assert result["score"] == pytest.approx(100)  # the first prediction matches only its second reference
    assert "nrefs:var" in result["signature"]
    assert set(result) >= {"score", "counts", "totals", "precisions", "bp", "sys_len", "ref_len", "signature"}
    assert bleu.compute(predictions=[text], references=["Il pleut beaucoup ce matin."])["score"] < 20


def test_prepare_cache_hit(tmp_path):
    args = dict(
        vocab_size=300, seed=0, document_sentences=2, max_source_length=32, max_target_length=32, max_pairs=2000
    )
    start = time.perf_counter()
    tokenizer, data = td.prepare(tmp_path, num_proc=1, **args)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer_again, data_again = td.prepare(tmp_path, num_proc=1, **args)
    warm = time.perf_counter() - start
    assert warm < cold
    assert tokenizer_again.get_vocab() == tokenizer.get_vocab()
    for name in data:
        assert data_again[name].to_dict() == data[name].to_dict()
    assert len(list(tmp_path.iterdir())) == 1
    td.prepare(tmp_path, num_proc=1, **{**args, "seed": 1})  # another argument, another entry
    assert len(list(tmp_path.iterdir())) == 2
