"""Documents trained as their sentences (`--document_training sentences`, the one-process default).

Where every layer attends within each sentence (`--sentence_local_layers` at every layer) a document's loss is a sum
of its sentences' terms, each computed from the sentence's own tokens alone, at positions its own marker gives:

    source    <sk> w w w            (the last sentence's </s> with it)
    decoder   <sk> y y y            ([start, <s1>, y ...] for the first sentence)
    labels    y y y <s(k+1)>        (</s> after the last sentence)

So each sentence can be a training example of its own, in exactly that form, and the sentences of every document
packed into rows of 128 tokens as the sentence model's are (`Seq2SeqPackingCollator`, the decoder inputs given per
pair; `SentencePositions` places and groups each pair of a packed row by its own marker): the same loss terms and
gradients as the whole documents (tests/test_sentence_positions.py), without a 300-token row's attention masked down
to its 10-token sentences, and sampled across documents (a step's 96 sentences from all over the data, not 3 runs of
32 consecutive pairs, which the data's order makes alike). The document the model translates is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence


def _starts(ids: Sequence[int], markers: set[int], what: str) -> list[int]:
    starts = [i for i, t in enumerate(ids) if t in markers]
    if not starts:
        raise ValueError(f"a document's {what} has no sentence marker")
    return starts


def sentence_examples(
    source: Sequence[int], labels: Sequence[int], marker_ids: Sequence[int], start_id: int
) -> list[dict[str, list[int]]]:
    """The sentences of one document (its source and label ids, each sentence after its marker) as examples:
    input_ids, decoder_input_ids and labels of each, as the whole document's forward computes them (above)."""
    markers = set(marker_ids)
    decoder = [start_id, *labels[:-1]]  # the document's decoder inputs: its labels behind the start token
    src, dec = _starts(source, markers, "source"), _starts(decoder, markers, "target")
    if src[0] != 0:
        raise ValueError("a document's source must start with its first sentence marker")
    if len(src) != len(dec):
        raise ValueError(f"a document with {len(src)} source sentences and {len(dec)} target sentences")
    dec[0] = 0  # the start token before the first marker is the first sentence's
    examples = []
    for (a, b), (c, d) in zip(zip(src, [*src[1:], len(source)]), zip(dec, [*dec[1:], len(decoder)])):
        examples.append(
            {"input_ids": list(source[a:b]), "decoder_input_ids": decoder[c:d], "labels": list(labels[c:d])}
        )
    return examples


def documents_as_sentences(documents, marker_ids: Sequence[int], start_id: int):
    """A datasets.Dataset of the sentence examples of every document of `documents` (input_ids, labels), in order."""
    import datasets

    columns: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "decoder_input_ids": [], "labels": []}
    for source, labels in zip(documents["input_ids"], documents["labels"]):
        for example in sentence_examples(source, labels, marker_ids, start_id):
            for key, value in example.items():
                columns[key].append(value)
            columns["attention_mask"].append([1] * len(example["input_ids"]))
    return datasets.Dataset.from_dict(columns)
