"""Fine-tuning metrics in numpy, named as GLUE and SQuAD name them.

GLUE: accuracy, binary F1 (positive class 1), Matthews correlation (CoLA), Pearson and
Spearman correlation (STS-B). SQuAD v1.1: exact match and F1 after the official
evaluation script's normalisation (lower case, punctuation and the articles a/an/the
removed, whitespace collapsed), the best over an example's ground truths, in percent.
"""
from __future__ import annotations

import collections
import re
import string
from typing import Sequence

import numpy as np


def _pair(predictions, labels) -> tuple[np.ndarray, np.ndarray]:
    p, y = np.asarray(predictions), np.asarray(labels)
    if p.shape != y.shape or p.ndim != 1 or not p.size:
        raise ValueError(f"need two equal-length non-empty vectors, got shapes {p.shape} and {y.shape}")
    return p, y


def accuracy(predictions, labels) -> float:
    p, y = _pair(predictions, labels)
    return float(np.mean(p == y))


def f1(predictions, labels) -> float:
    """Binary F1 of class 1; 0 when there are no true positives."""
    p, y = _pair(predictions, labels)
    tp = np.sum((p == 1) & (y == 1))
    predicted, actual = np.sum(p == 1), np.sum(y == 1)
    return float(2 * tp / (predicted + actual)) if tp else 0.0


def matthews_corr(predictions, labels) -> float:
    """Matthews correlation of binary labels; 0 when a row or column of the confusion matrix
    is empty (the correlation is undefined)."""
    p, y = _pair(predictions, labels)
    p, y = p == 1, y == 1
    tp, tn = float(np.sum(p & y)), float(np.sum(~p & ~y))
    fp, fn = float(np.sum(p & ~y)), float(np.sum(~p & y))
    denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return float((tp * tn - fp * fn) / denominator) if denominator else 0.0


def pearson(x, y) -> float:
    x, y = (v.astype(np.float64) for v in _pair(x, y))
    dx, dy = x - x.mean(), y - y.mean()
    return float(np.sum(dx * dy) / np.sqrt(np.sum(dx ** 2) * np.sum(dy ** 2)))


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties sharing the mean of the ranks they span."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    first = np.r_[True, sorted_x[1:] != sorted_x[:-1]]  # start of each run of equal values
    run = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    ends = np.r_[starts[1:], len(x)]
    mean_rank = (starts + ends + 1) / 2.0  # ranks start+1 .. end, averaged
    ranks = np.empty(len(x))
    ranks[order] = mean_rank[run]
    return ranks


def spearman(x, y) -> float:
    x, y = _pair(x, y)
    return pearson(_ranks(x), _ranks(y))


# ----------------------------------------------------------------------------- SQuAD v1.1


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _token_f1(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((collections.Counter(pred) & collections.Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], answers: dict[str, Sequence[str]]) -> dict[str, float]:
    """{"exact_match", "f1"} in percent over every question id of `answers` (an id without a
    prediction scores 0, as in the official script)."""
    if not answers:
        raise ValueError("squad_scores: no questions to score")
    em = f1_total = 0.0
    for qid, truths in answers.items():
        if not len(truths):
            raise ValueError(f"question {qid!r} has no ground-truth answers")
        if qid not in predictions:
            continue
        pred = predictions[qid]
        em += max(float(normalize_answer(pred) == normalize_answer(t)) for t in truths)
        f1_total += max(_token_f1(pred, t) for t in truths)
    return {"exact_match": 100.0 * em / len(answers), "f1": 100.0 * f1_total / len(answers)}
