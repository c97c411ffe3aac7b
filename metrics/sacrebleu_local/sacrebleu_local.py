"""Corpus BLEU (sacrebleu) with any number of references per prediction, loadable offline.

Load it by folder path, never from the Hub::

    bleu = evaluate.load("metrics/sacrebleu_local")   # the folder holds sacrebleu_local.py
    bleu.compute(predictions=["Il pleut ."], references=[["Il pleut.", "Il pleut !"]])

Unlike the Hub "sacrebleu" metric, predictions may have different numbers of references.
"""

from __future__ import annotations

import datasets
import evaluate
from sacrebleu.metrics import BLEU

_CITATION = """\
@inproceedings{post-2018-call,
    title = "A Call for Clarity in Reporting {BLEU} Scores",
    author = "Post, Matt",
    booktitle = "Proceedings of the Third Conference on Machine Translation: Research Papers",
    year = "2018",
    publisher = "Association for Computational Linguistics",
    url = "https://www.aclweb.org/anthology/W18-6319",
    pages = "186--191",
}
"""

_DESCRIPTION = """\
sacrebleu corpus BLEU over detokenized text. Each prediction has its own list of references; lists may differ
in length (missing references are padded with None, which sacrebleu skips).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of str, detokenized system outputs.
    references: list of list of str (one list per prediction, any length >= 1), or list of str.
    smooth_method: 'exp' (default), 'none', 'floor' or 'add-k'.
    smooth_value: value for 'floor' / 'add-k'; None uses sacrebleu's default.
    tokenize: sacrebleu tokenizer name; None means sacrebleu's default ('13a').
    lowercase: lowercase before scoring.
    force: do not warn about input that looks tokenized.
    use_effective_order: use effective n-gram order (for sentence-level use).
Returns:
    score (0-100), counts, totals, precisions (per n-gram order), bp, sys_len, ref_len,
    signature (sacrebleu's signature string, e.g. 'nrefs:var|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0').
Examples:
    >>> bleu = evaluate.load("metrics/sacrebleu_local")
    >>> bleu.compute(predictions=["Il pleut."], references=[["Il neige.", "Il pleut."]])["score"]
    100.0
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SacrebleuLocal(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            homepage="https://github.com/mjpost/sacrebleu",
            codebase_urls=["https://github.com/mjpost/sacrebleu"],
            reference_urls=["https://github.com/mjpost/sacrebleu"],
            # Two accepted input shapes: several references per prediction, or exactly one.
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Sequence(datasets.Value("string", id="sequence"), id="references"),
                    }
                ),
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Value("string", id="sequence"),
                    }
                ),
            ],
        )

    def _compute(
        self,
        predictions: list[str],
        references: list[list[str]] | list[str],
        smooth_method: str = "exp",
        smooth_value: float | None = None,
        tokenize: str | None = None,
        lowercase: bool = False,
        force: bool = False,
        use_effective_order: bool = False,
    ) -> dict:
        per_prediction = [[refs] if isinstance(refs, str) else list(refs) for refs in references]
        for i, refs in enumerate(per_prediction):
            if not refs:
                raise ValueError(f"prediction {i} ({predictions[i]!r}) has no references")
        # sacrebleu wants one stream per reference index, each as long as the predictions. Pad with None
        # (skipped by sacrebleu), not "": an empty reference would count as length 0 in the brevity penalty.
        n_streams = max(len(refs) for refs in per_prediction)
        streams = [[refs[k] if k < len(refs) else None for refs in per_prediction] for k in range(n_streams)]

        bleu = BLEU(
            lowercase=lowercase,
            force=force,
            tokenize=tokenize,
            smooth_method=smooth_method,
            smooth_value=smooth_value,
            effective_order=use_effective_order,
        )
        result = bleu.corpus_score(predictions, streams)
        return {
            "score": result.score,
            "counts": result.counts,
            "totals": result.totals,
            "precisions": result.precisions,
            "bp": result.bp,
            "sys_len": result.sys_len,
            "ref_len": result.ref_len,
            "signature": str(bleu.get_signature()),
        }
