"""recipes/document_baseline.py (the sentence model's baseline for document BLEU): its per-document joining of
sentence texts, references and translations matches the document mode's test documents. CPU only, a few s."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / evaluate read it

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recipes import document_baseline as db  # noqa: E402 - after the repository joins sys.path
from recipes import translation_data as td  # noqa: E402


def test_documents_match_the_document_mode():
    """On 7 held-out pairs in documents of 3 (the last of 1): the sentence test joined per document, as the
    baseline joins it, gives the document mode's English texts and references (no markers in them), and each
    sentence's position in its document."""
    nbsp = "\u00a0"
    items = [
        {
            "en": f"Sentence {i}.",
            "fr": f"Phrase {i}{nbsp}!",
            "fr_refs": [f"Phrase {i}{nbsp}!", f"Ligne {i}."][: 1 + i % 2],
        }
        for i in range(7)
    ]
    words = [w for item in items for text in (item["en"], *item["fr_refs"]) for w in (text, text.lower())]
    tokenizer = td.add_markers(td.train_tokenizer(words, vocab_size=60), 3)
    sentences = td.build_tokenized_splits(tokenizer, {"test": items}, 80, 80)["test"]
    documents = td.build_tokenized_splits(tokenizer, {"test": items}, 240, 240, document_sentences=3, markers=True)[
        "test"
    ]
    assert len(sentences) == 7 and len(documents) == 3
    assert db.join_per_document(sentences["en"], 3) == documents["en"]
    references = db.document_references(sentences["fr_refs"], 3)
    assert references == documents["fr_refs"]
    assert references[0] == ["Phrase 0 ! Phrase 1 ! Phrase 2 !", "Phrase 0 ! Ligne 1. Phrase 2 !"]
    assert not any("<s" in ref for refs in references for ref in refs)  # scored without the markers
    # a translation equal to every sentence's first reference joins into each document's first reference
    assert db.join_per_document([refs[0] for refs in sentences["fr_refs"]], 3) == [r[0] for r in references]
    assert db.sentence_positions(7, 3) == [1, 2, 3, 1, 2, 3, 1]
    assert db.position_ranges(32, 4) == [(1, 8), (9, 16), (17, 24), (25, 32)]


def test_a_generated_document_is_cut_at_its_markers():
    """recipes/document_positions.py: the tokens after marker k (up to the next marker) are sentence k's; a marker
    the model never wrote leaves its sentence empty and is counted; tokens before the first marker belong to none."""
    from recipes import document_positions as dp

    markers = [101, 102, 103]
    pieces, missing = dp.split_at_markers([0, 7, 101, 5, 6, 103, 8, 2], markers, 3)
    assert pieces == [[5, 6], [], [8, 2]] and missing == 1
    pieces, missing = dp.split_at_markers([101, 4, 102, 9], markers, 2)  # a document of 2: marker 3 unused
    assert pieces == [[4], [9]] and missing == 0


def test_source_lengths_fall_in_ranges_of_about_as_many_sentences():
    """recipes/document_positions.py --length_groups: ranges by the lengths' quantiles, every length in exactly one,
    covering all; one length repeated gives one range."""
    from recipes import document_positions as dp

    assert dp.length_ranges([3, 5, 5, 7, 9, 12], 3) == [(3, 4), (5, 8), (9, 12)]
    assert dp.length_ranges([4] * 10, 4) == [(4, 4)]
    lengths = [1 + (i * 7) % 23 for i in range(500)]
    ranges = dp.length_ranges(lengths, 4)
    assert ranges[0][0] == min(lengths) and ranges[-1][1] == max(lengths)
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))
    counts = [sum(first <= w <= last for w in lengths) for first, last in ranges]
    assert sum(counts) == len(lengths) and max(counts) < 2 * len(lengths) / 4
