"""Data for the English->French translation demo (Tatoeba sentence pairs, see data/README.md).

Pipeline, all run by `prepare` (which caches its result on disk):

    load_pairs -> split_by_source -> add_word_tokens (NLTK, per sentence) -> train_tokenizer (BPE, train split)
    -> build_tokenized_splits (optionally n sentences per document, subword ids)

Model outputs are turned back into text for BLEU with `decode_french` (= subword decode + `detokenize_fr`) and
scored against the `fr_refs` column with metrics/sacrebleu_local.
"""

from __future__ import annotations

import csv
import functools
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import datasets
import nltk
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

DEFAULT_DATA_PATH = Path(__file__).resolve().parent.parent / "data" / "tatoeba-eng-fra.tsv.gz"

# Ids 0, 1, 2 in this order: pad_token_id=0, eos_token_id=1 (Marian also starts decoding from pad).
PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
# Between the sentences of a document, on both sides (documents built with `separator=True`): the decoder
# can count the sentences it has written and find the next one in the source, instead of merging or skipping
# sentences mid-document (document-level NMT's sentence boundary token, e.g. <BRK> in Junczys-Dowmunt 2019).
# A special token added after the BPE is trained (the last id): decoding with skip_special_tokens drops it.
SEP = "<sep>"


def marker(k: int) -> str:
    """The numbered marker before sentence k (1-based) of a document (documents built with `markers=True`).
    Unlike one SEP, marker k in the output can match marker k in the source exactly (same embedding), so
    cross-attention finds the source sentence the decoder is writing without counting boundaries over
    hundreds of tokens: an anchor per sentence. Special tokens (the last ids): decoding drops them."""
    return f"<s{k}>"


# BPE marks the end of a word so that decoding can put the spaces back exactly.
_END_OF_WORD = "</w>"

# Bump when preprocessing changes, so old cache entries are not reused.
_CACHE_FORMAT = 3  # 2: pack_sentences renamed document_sentences; 3: BPE ids numbered canonically

# French text in the file puts a no-break space (U+00A0), a narrow no-break space (U+202F) or, rarely, a thin
# space (U+2009) before ! ? : ; and inside « ». A model cannot tell them apart from a space: make them spaces.
_SPACES = str.maketrans({"\u00a0": " ", "\u202f": " ", "\u2009": " "})

# NLTK tokens -> French text. Measured on all 167,130 French sides: detokenize_fr(tokenize_fr(x)) equals the
# space-normalised x for 99.6% of lines (corpus BLEU 99.98). What is left is the file's own inconsistency
# ("Quoi?" vs the more common "Quoi ?"), so the spaces before ? ! : ; and around « » are kept (French style).
_DETOKENIZE_FR = (
    (re.compile(r" ([.,)\]}%]|\.\.\.)(?= |$)"), r"\1"),  # closing punctuation sticks to the word before
    (re.compile(r"([(\[{]) "), r"\1"),  # opening brackets stick to the word after
    (re.compile(r"``\s?"), '"'),  # NLTK writes an opening " as `` ...
    (re.compile(r"\s?''"), '"'),  # ... and a closing " as ''
    (re.compile(r"(\w) ’ (\w)"), r"\1’\2"),  # NLTK splits the typographic apostrophe: l ’ homme
    (re.compile(r"(\w) ('\w+|n't)\b"), r"\1\2"),  # and English-style clitics: Tom 's
)


def load_pairs(path: str | os.PathLike = DEFAULT_DATA_PATH) -> list[tuple[str, str]]:
    """Read (english, french) pairs, in file order, from the gzipped `english<TAB>french<TAB>` file.

    Plain gzip + csv reads all 167k lines in about 0.2 s; the `datasets` csv builder takes about 3 s (pandas
    plus an Arrow cache) and needs keep_default_na=False so that text like "NA" stays text.
    """
    pairs = []
    # QUOTE_NONE: quotes in sentences (e.g. "Tom") are text, not csv quoting.
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        for line_number, row in enumerate(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE), start=1):
            if len(row) != 3 or not row[0] or not row[1]:
                raise ValueError(f"{path}:{line_number}: expected 'english<TAB>french<TAB>', got {row!r}")
            pairs.append((row[0], row[1]))
    if not pairs:
        raise ValueError(f"{path}: no sentence pairs")
    return pairs


def split_by_source(
    pairs: Sequence[tuple[str, str]],
    seed: int = 0,
    valid_fraction: float = 0.01,
    test_fraction: float = 0.02,
) -> dict[str, list[dict]]:
    """Split pairs into train/validation/test by distinct English sentence.

    All translations of one English sentence land in the same split, so no validation/test source is seen in
    training. Returns:
        train:            one item per pair,       {"en": str, "fr": str}, in a seeded random order
        validation, test: one item per English,    {"en": str, "fr": first French, "fr_refs": all French in
                                                    file order}, in a seeded random order
    The result depends only on `pairs` and `seed` (no set/hash ordering), so it is the same on every run.
    """
    for name, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    if valid_fraction + test_fraction >= 1.0:
        raise ValueError(f"valid_fraction + test_fraction must be < 1, got {valid_fraction} + {test_fraction}")

    translations: dict[str, list[str]] = {}  # insertion (file) order, so independent of PYTHONHASHSEED
    for en, fr in pairs:
        translations.setdefault(en, []).append(fr)
    sources = list(translations)
    rng = random.Random(seed)
    rng.shuffle(sources)

    n_test = round(len(sources) * test_fraction)
    n_valid = round(len(sources) * valid_fraction)
    held_out = {"validation": sources[n_test : n_test + n_valid], "test": sources[:n_test]}
    train_sources = set(sources[n_test + n_valid :])  # membership only: never iterated

    # The file runs from short to long sentences and lists translations of one source together: shuffle so
    # that packed training documents mix lengths and sources.
    train = [{"en": en, "fr": fr} for en, fr in pairs if en in train_sources]
    rng.shuffle(train)
    splits = {"train": train}
    for name, split_sources in held_out.items():
        splits[name] = [
            {"en": en, "fr": translations[en][0], "fr_refs": list(translations[en])} for en in split_sources
        ]
    return splits


def normalize_spaces(text: str) -> str:
    """Replace the no-break and thin spaces of French punctuation with plain spaces."""
    return text.translate(_SPACES)


def tokenize_en(text: str, lowercase: bool = False) -> str:
    """English sentence -> NLTK word tokens joined by single spaces (lowercased first if asked)."""
    text = normalize_spaces(text)
    # preserve_line=True skips the Punkt sentence splitter, so no NLTK data is needed (and `language` is unused).
    return " ".join(nltk.word_tokenize(text.lower() if lowercase else text, language="english", preserve_line=True))


def tokenize_fr(text: str, lowercase: bool = False) -> str:
    """French sentence -> NLTK word tokens joined by single spaces (lowercased first if asked)."""
    text = normalize_spaces(text)
    return " ".join(nltk.word_tokenize(text.lower() if lowercase else text, language="french", preserve_line=True))


def detokenize_fr(text: str) -> str:
    """Space-joined French tokens (from `tokenize_fr` or a model) -> French text for BLEU."""
    for pattern, replacement in _DETOKENIZE_FR:
        text = pattern.sub(replacement, text)
    return text


def _map_unique(fn: Callable[[str], str], texts: Sequence[str], num_proc: int) -> list[str]:
    """[fn(t) for t in texts], computing each distinct text once, over `num_proc` processes."""
    unique = list(dict.fromkeys(texts))
    if num_proc > 1 and len(unique) >= 10_000:  # below that, starting processes costs more than it saves
        with ProcessPoolExecutor(max_workers=num_proc) as pool:
            results = list(pool.map(fn, unique, chunksize=2_000))
    else:
        results = [fn(text) for text in unique]
    table = dict(zip(unique, results))
    return [table[text] for text in texts]


def add_word_tokens(items: Sequence[dict], num_proc: int = 1, lowercase: bool = False) -> list[dict]:
    """Copies of `items` with "en_tok" / "fr_tok": the NLTK-tokenized "en" / "fr" (lowercased if asked).

    Tokenize before joining sentences into documents: NLTK only splits a sentence-final period at the very
    end of its input. NLTK is the slow step (~0.1 ms a sentence), hence distinct texts only and optional
    processes (<= 2 here).
    """
    _require_at_least("num_proc", num_proc, 1)
    en_tok = _map_unique(functools.partial(tokenize_en, lowercase=lowercase), [item["en"] for item in items], num_proc)
    fr_tok = _map_unique(functools.partial(tokenize_fr, lowercase=lowercase), [item["fr"] for item in items], num_proc)
    return [{**item, "en_tok": en, "fr_tok": fr} for item, en, fr in zip(items, en_tok, fr_tok)]


def _canonical_ids(backend: Tokenizer) -> Tokenizer:
    """The same ids for the same data in every process: tokenizers' BPE trainer numbers the initial alphabet
    (single characters, with and without "</w>") in hash-map order, which differs between processes, so two
    nodes building the same cache entry would feed their ranks different ids for the same text. Renumbered:
    the special tokens keep 0-2, then the alphabet sorted, then each merge's result in merge order."""
    state = json.loads(backend.to_str())
    vocab, merges = state["model"]["vocab"], state["model"]["merges"]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "", 1) for m in merges]
    merged_set, specials = (
        set(merged),
        [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t in SPECIAL_TOKENS],
    )
    alphabet = sorted(t for t in vocab if t not in merged_set and t not in SPECIAL_TOKENS)
    order = specials + alphabet + list(dict.fromkeys(t for t in merged if t in vocab))
    assert sorted(order) == sorted(vocab), "BPE vocabulary is not its alphabet plus its merges"
    state["model"]["vocab"] = {token: i for i, token in enumerate(order)}
    return Tokenizer.from_str(json.dumps(state))


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """One BPE vocabulary shared by English and French, trained on NLTK-tokenized (space-joined) text.

    BPE rather than Unigram: at 8k it gives 8.2 / 8.7 subwords per English / French sentence against
    Unigram's 11.5 / 10.9, and trains in ~3 s instead of ~12 s.
    `decode(encode(x), skip_special_tokens=True) == x` for space-joined tokens: words are split on spaces and
    their last subword carries "</w>", which the decoder turns back into a space.
    Every encoding ends with "</s>". Ids: <pad>=0, </s>=1, <unk>=2.
    """
    _require_at_least("vocab_size", vocab_size, len(SPECIAL_TOKENS) + 1)
    backend = Tokenizer(models.BPE(unk_token=UNK, end_of_word_suffix=_END_OF_WORD, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.BPEDecoder(suffix=_END_OF_WORD)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        end_of_word_suffix=_END_OF_WORD,
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    backend = _canonical_ids(backend)
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", special_tokens=[(EOS, backend.token_to_id(EOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        # transformers' clean-up would glue " ." and " n't" to the word before and break exact decoding.
        clean_up_tokenization_spaces=False,
    )


def tokenizer_digest(tokenizer: PreTrainedTokenizerFast) -> str:
    """16 hex digits of the sha256 of what maps text to ids: the BPE vocabulary and merges, the added tokens,
    the normalizer, pre-tokenizer and post-processor (not the truncation or padding settings)."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    kept = {k: state.get(k) for k in ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def check_same_tokenizer(tokenizer: PreTrainedTokenizerFast, device) -> None:
    """Raise the same ValueError on every rank unless every rank of the job holds the same tokenizer.

    `main_process_first` builds one cache per node, and tokenizers' BPE trainer breaks ties between equally
    frequent merges by ids it numbers in hash-map order (random per process), so two nodes can train
    different merges from the same data (seen on small data; `_canonical_ids` only renumbers): their ranks
    would then train one model on two encodings of the text, silently. One all-gather of 48 bytes a rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from seqpar_hf.parallel.agree import same_on_every_rank

    same_on_every_rank(
        {"tokenizer sha256": tokenizer_digest(tokenizer)},
        dist.group.WORLD,
        device,
        "the tokenizer",
        "Nodes that each built --data_cache_dir can train different BPE merges: build the cache on "
        "one node (any run of the recipe with the same data flags builds it first) and copy it to "
        "the others, or put --data_cache_dir on a filesystem every node shares.",
    )


def document_sizes(count: int, n: int, mixed_seed: int | None = None) -> list[int]:
    """Sentences per document for `count` items: `n` each (the last one fewer), or with `mixed_seed` a seeded
    draw from 1..n per document, so that a model trained on them sees every length up to n."""
    sizes, total, rng = [], 0, random.Random(mixed_seed)
    while total < count:
        sizes.append(min(n if mixed_seed is None else rng.randint(1, n), count - total))
        total += sizes[-1]
    return sizes


def join_documents(
    items: Sequence[dict], n: int, mixed_seed: int | None = None, separator: bool = False, markers: bool = False
) -> list[dict]:
    """Join every `n` consecutive items into one document (the last one may hold fewer; with `mixed_seed`,
    documents of 1..n items, see `document_sizes`); n=1 is the identity. Document-level translation: one
    long sequence per document, attention across its sentences.

    String fields ("en", "fr", "en_tok", ...) are joined with a space. "fr_refs" (held-out items) becomes a list
    as long as the longest reference list in the group: reference k joins each sentence's k-th reference, or
    its first where it has fewer. So every reference is a full translation of the document and every
    translation of every sentence appears in one of them (multi-reference BLEU takes the best per n-gram).
    With `separator`, the word-tokenized fields ("en_tok", "fr_tok": what the model reads and writes) are
    joined with SEP between sentences; with `markers`, each sentence of them starts with its numbered marker
    (`marker(k)`); the text and the references keep plain spaces.
    """
    if separator and markers:
        raise ValueError("separator and markers both mark sentence boundaries: choose one")
    _require_at_least("n", n, 1)
    if n == 1:
        return list(items)
    packed, start = [], 0
    for size in document_sizes(len(items), n, mixed_seed):
        group, start = items[start : start + size], start + size
        document = {}
        for key, value in group[0].items():
            if key == "fr_refs":
                n_refs = max(len(item["fr_refs"]) for item in group)
                document[key] = [
                    " ".join(item["fr_refs"][k] if k < len(item["fr_refs"]) else item["fr_refs"][0] for item in group)
                    for k in range(n_refs)
                ]
            elif isinstance(value, str) and markers and key.endswith("_tok"):
                document[key] = " ".join(f"{marker(k + 1)} {item[key]}" for k, item in enumerate(group))
            elif isinstance(value, str):
                glue = f" {SEP} " if separator and key.endswith("_tok") else " "
                document[key] = glue.join(item[key] for item in group)
            else:
                raise TypeError(f"cannot pack field {key!r} of type {type(value).__name__}")
        packed.append(document)
    return packed


SENTENCE_MAX_LENGTH = 80  # tokens per side of a single pair (the recipe's sentence-level truncation)


def build_tokenized_splits(
    tokenizer: PreTrainedTokenizerFast,
    splits: dict[str, Sequence[dict]],
    max_source_length: int,
    max_target_length: int,
    document_sentences: int = 1,
    num_proc: int = 1,
    lowercase: bool = False,
    mixed_seed: int | None = None,
    separator: bool = False,
    markers: bool = False,
) -> datasets.DatasetDict:
    """Encode each split (items from `split_by_source`, optionally already through `add_word_tokens`),
    optionally joining `document_sentences` pairs into one document (training documents of 1 to
    `document_sentences` pairs with `mixed_seed`; held-out ones always of `document_sentences`; with `separator`,
    SEP between their sentences: the tokenizer must have it, see `add_separator`; with `markers`, numbered
    markers, see `add_markers`). With documents, also the split "train_sentences": the training pairs one per
    row, truncated to SENTENCE_MAX_LENGTH (with `markers`, each starting with a seeded marker of 1..N on both
    sides, so the warm start teaches the model to copy a marker and translate the sentence after it).

    Columns, one row per document (each id list ends with </s>, truncated to the max length):
        input_ids, attention_mask: English ids [<= max_source_length]
        labels:                    French ids  [<= max_target_length]
        en, fr_refs:               held-out splits only: English text, and French references
                                   (spaces normalised) to score `decode_french` output against
    """
    # At least one token and </s>.
    _require_at_least("max_source_length", max_source_length, 2)
    _require_at_least("max_target_length", max_target_length, 2)
    columns = {}
    for name, items in splits.items():
        if items and "en_tok" not in items[0]:
            items = add_word_tokens(items, num_proc, lowercase)
        documents = join_documents(
            items, document_sentences, mixed_seed if name == "train" else None, separator, markers
        )
        source_ids = _encode(tokenizer, [d["en_tok"] for d in documents], max_source_length)
        split = {
            "input_ids": source_ids,
            "attention_mask": [[1] * len(ids) for ids in source_ids],  # unpadded: the collator pads
            "labels": _encode(tokenizer, [d["fr_tok"] for d in documents], max_target_length),
        }
        if documents and "fr_refs" in documents[0]:
            split["en"] = [d["en"] for d in documents]
            case = str.lower if lowercase else (lambda text: text)
            split["fr_refs"] = [[case(normalize_spaces(ref)) for ref in d["fr_refs"]] for d in documents]
        columns[name] = datasets.Dataset.from_dict(split)
        if name == "train" and document_sentences > 1:
            # the same training pairs one per row, for a sentence-level warm start (same tokenizer, same split)
            rng = random.Random(len(items))
            starts = [f"{marker(rng.randint(1, document_sentences))} " if markers else "" for _ in items]
            columns["train_sentences"] = datasets.Dataset.from_dict(
                {
                    "input_ids": (
                        ids := _encode(tokenizer, [m + d["en_tok"] for m, d in zip(starts, items)], SENTENCE_MAX_LENGTH)
                    ),
                    "attention_mask": [[1] * len(x) for x in ids],
                    "labels": _encode(tokenizer, [m + d["fr_tok"] for m, d in zip(starts, items)], SENTENCE_MAX_LENGTH),
                }
            )
    return datasets.DatasetDict(columns)


def add_separator(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """Adds SEP as a special token (the next id after the vocabulary), so that the BPE never splits it and
    decoding with skip_special_tokens leaves it out."""
    tokenizer.add_special_tokens({"additional_special_tokens": [SEP]})
    return tokenizer


def add_markers(tokenizer: PreTrainedTokenizerFast, n: int) -> PreTrainedTokenizerFast:
    """Adds marker(1) .. marker(n) as special tokens (the next ids after the vocabulary), never split by the BPE
    and dropped by decoding with skip_special_tokens."""
    tokenizer.add_special_tokens({"additional_special_tokens": [marker(k) for k in range(1, n + 1)]})
    return tokenizer


def _encode(tokenizer: PreTrainedTokenizerFast, texts: list[str], max_length: int) -> list[list[int]]:
    if not texts:  # the tokenizer fails on an empty batch (e.g. valid_fraction=0)
        return []
    return tokenizer(texts, max_length=max_length, truncation=True)["input_ids"]


def decode_french(tokenizer: PreTrainedTokenizerFast, ids: Sequence[Sequence[int]]) -> list[str]:
    """Generated (or label) ids [batch, length] -> French text to score against `fr_refs`. -100 is skipped."""
    ids = [[i for i in row if i >= 0] for row in ids]  # label padding
    return [detokenize_fr(text) for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


def _require_at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare(
    cache_dir: str | os.PathLike,
    vocab_size: int = 8000,
    seed: int = 0,
    document_sentences: int = 1,
    max_source_length: int = 256,
    max_target_length: int = 256,
    data_path: str | os.PathLike = DEFAULT_DATA_PATH,
    valid_fraction: float = 0.01,
    test_fraction: float = 0.02,
    max_pairs: int | None = None,
    num_proc: int = 2,
    lowercase: bool = False,
    mixed_documents: bool = False,
    sentence_separator: bool = False,
    sentence_markers: bool = False,
) -> tuple[PreTrainedTokenizerFast, datasets.DatasetDict]:
    """Tokenizer and tokenized splits for the recipe, cached under `cache_dir`.

    The cache entry is named by a hash of every argument that changes the result (all but cache_dir and
    num_proc), the data file's sha256 and the preprocessing version. `max_pairs` keeps only the first pairs of
    the file (its shortest sentences), for tests. Ranks of a distributed job may race here: each builds, the
    first to finish wins; call it on one rank first to build once.
    """
    # Fail before minutes of work, not after.
    _require_at_least("vocab_size", vocab_size, len(SPECIAL_TOKENS) + 1)
    _require_at_least("document_sentences", document_sentences, 1)
    _require_at_least("max_source_length", max_source_length, 2)
    _require_at_least("max_target_length", max_target_length, 2)
    _require_at_least("num_proc", num_proc, 1)
    settings = {
        "format": _CACHE_FORMAT,
        "data_sha256": file_sha256(data_path),
        "vocab_size": vocab_size,
        "seed": seed,
        "document_sentences": document_sentences,
        "max_source_length": max_source_length,
        "max_target_length": max_target_length,
        "valid_fraction": valid_fraction,
        "test_fraction": test_fraction,
        "max_pairs": max_pairs,
    }
    if lowercase:  # only when set, so cased entries keep their key
        settings["lowercase"] = True
    if mixed_documents and document_sentences > 1:  # training documents of 1..document_sentences pairs
        settings["mixed_documents"] = True
    if document_sentences > 1:  # documents come with their training pairs one per row ("train_sentences")
        settings["train_sentences"] = True
    if sentence_separator and document_sentences > 1:  # SEP between a document's sentences
        settings["sentence_separator"] = True
    if sentence_markers and document_sentences > 1:  # a numbered marker before each sentence of a document
        settings["sentence_markers"] = True
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    entry = Path(cache_dir) / f"translation-{key}"
    if not (entry / "settings.json").is_file():  # written last: its presence means the entry is complete
        _build_cache_entry(entry, settings, data_path, num_proc)
    return AutoTokenizer.from_pretrained(entry / "tokenizer"), datasets.load_from_disk(entry / "dataset")


def _build_cache_entry(entry: Path, settings: dict, data_path: str | os.PathLike, num_proc: int) -> None:
    pairs = load_pairs(data_path)
    if settings["max_pairs"] is not None:
        pairs = pairs[: settings["max_pairs"]]
    splits = split_by_source(pairs, settings["seed"], settings["valid_fraction"], settings["test_fraction"])
    lowercase = settings.get("lowercase", False)
    splits = {name: add_word_tokens(items, num_proc, lowercase) for name, items in splits.items()}
    tokenizer = train_tokenizer(
        (text for item in splits["train"] for text in (item["en_tok"], item["fr_tok"])), settings["vocab_size"]
    )

    if settings.get("sentence_separator"):
        add_separator(tokenizer)
    if settings.get("sentence_markers"):
        add_markers(tokenizer, settings["document_sentences"])

    # Build in a scratch folder next to the entry and rename it into place, so a crash leaves no half entry.
    entry.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        # Save before encoding: encoding with truncation leaves max_length in the tokenizer's saved settings.
        tokenizer.save_pretrained(scratch / "tokenizer")
        tokenized = build_tokenized_splits(
            tokenizer,
            splits,
            settings["max_source_length"],
            settings["max_target_length"],
            settings["document_sentences"],
            lowercase=lowercase,
            mixed_seed=settings["seed"] if settings.get("mixed_documents") else None,
            separator=settings.get("sentence_separator", False),
            markers=settings.get("sentence_markers", False),
        )
        tokenized.save_to_disk(scratch / "dataset")
        (scratch / "settings.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
        try:
            os.replace(scratch, entry)
        except OSError:
            if not (entry / "settings.json").is_file():  # not "another process finished first"
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
