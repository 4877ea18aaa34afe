"""Task scores (LongBench normalization) and small statistics helpers (fidelity to full prefill is
``gate.first_token_fidelity``)."""
from __future__ import annotations

import math
import re
import statistics
import string
from collections import Counter
from collections.abc import Sequence


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation) | set("‘’“”…–—")


def normalize_answer(s: str) -> str:
    """LongBench / SQuAD normalization: lowercase, drop punctuation and articles, squeeze spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def f1_score(prediction: str, ground_truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def string_match(prediction: str, values: Sequence[str]) -> float:
    """RULER's string_match_all: the share of reference values found in the prediction (normalized)."""
    if not values:
        return float("nan")
    pred = f" {normalize_answer(prediction)} "
    return sum(f" {normalize_answer(v)} " in pred for v in values) / len(values)


def _lcs(a: list[str], b: list[str]) -> int:
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


_SCORER = None


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure; uses ``rouge-score`` (extra ``bench``) and falls back to the same formula."""
    global _SCORER
    try:
        if _SCORER is None:
            from rouge_score import rouge_scorer

            _SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
        return float(_SCORER.score(reference, prediction)["rougeL"].fmeasure)
    except ImportError:
        tok = lambda s: re.sub(r"[^a-z0-9]+", " ", s.lower()).split()   # rouge-score's default tokenizer
        p, r = tok(prediction), tok(reference)
        lcs = _lcs(p, r)
        if lcs == 0:
            return 0.0
        prec, rec = lcs / len(p), lcs / len(r)
        return 2 * prec * rec / (prec + rec)


def task_scores(prediction: str, answers: Sequence[str], values: Sequence[str] = ()) -> dict[str, float]:
    """Every task score of one prediction: best over the accepted answers."""
    answers = list(answers) or [""]
    out = {
        "f1": max(f1_score(prediction, a) for a in answers),
        "em": max(exact_match(prediction, a) for a in answers),
        "rougeL": max(rouge_l(prediction, a) for a in answers),
    }
    if values:
        out["match"] = string_match(prediction, values)
    return out


def mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def geomean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else float("nan")
