"""SQuAD v1.1 for BERT fine-tuning: TFDS `squad/v1.1` (id, title, context, question,
answers {text, answer_start}), sliding windows over the context, and answers read back from
the original text through the tokenizer's character offsets.

Each feature is [CLS] question [SEP] context window [SEP] (question cut to max_query_length,
windows of the rest of max_seq_length, each starting doc_stride tokens after the previous,
as Devlin et al.'s run_squad). Training labels the answer's first and last context token, or
[CLS] (position 0) where the window does not hold the whole answer. Prediction takes the
n_best_size highest start and end logits of every window, keeps spans inside the context of
at most max_answer_length tokens whose start token has its maximal context in that window,
and answers with the best start + end logit over all windows of the question.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from experiments.bert import finetune_metrics as fm
from tfm.data import sources
from tfm.data.tokenizers import WordPieceTokenizer
from tfm.train import SpanTask


@dataclasses.dataclass(frozen=True)
class Window:
    """Where one feature's context tokens come from: feature positions [first, first + length)
    hold context tokens [start, start + length)."""
    example: int
    first: int
    start: int
    length: int
    max_context: np.ndarray  # bool [length]: the token's maximal-context window is this one


def window_spans(num_tokens: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) of each window over num_tokens context tokens."""
    spans, start = [], 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens)
        spans.append((start, length))
        if start + length == num_tokens:
            break
        start += min(length, stride)
    return spans


def max_context(spans: Sequence[tuple[int, int]], index: int) -> np.ndarray:
    """For each token of window `index`: whether no other window scores higher for it, the
    score being min(tokens left, tokens right) + 0.01 * window length (first window wins ties)."""
    start, length = spans[index]
    out = np.zeros(length, bool)
    for i, pos in enumerate(range(start, start + length)):
        best, best_score = None, None
        for j, (s, n) in enumerate(spans):
            if s <= pos < s + n:
                score = min(pos - s, s + n - 1 - pos) + 0.01 * n
                if best_score is None or score > best_score:
                    best, best_score = j, score
        out[i] = best == index
    return out


def _answers(ex) -> tuple[list[str], list[int]]:
    texts = [sources.as_text(t) for t in np.atleast_1d(ex["answers"]["text"])]
    return texts, [int(s) for s in np.atleast_1d(ex["answers"]["answer_start"])]


def features(source, tokenizer: WordPieceTokenizer, settings, *, train: bool,
             limit: int = 0) -> tuple[list[dict], list[Window], list[dict]]:
    """(features, their windows, examples {id, context, answers}) for the first `limit`
    examples (0 = all). Features hold input_ids, token_type_ids, attention_mask [T], weights,
    and with `train` start_positions, end_positions. A training example whose answer text is
    not at its answer_start is skipped (as run_squad does)."""
    T = settings.max_seq_length
    n = len(source) if not limit else min(limit, len(source))
    feats, windows, examples = [], [], []
    for i in range(n):
        if i and i % 20_000 == 0:
            print(f"  {i}/{n} questions", flush=True)
        ex = source[i]
        context, question = sources.as_text(ex["context"]), sources.as_text(ex["question"])
        texts, starts = _answers(ex)
        char_span = None
        if train:
            if not texts or context[starts[0]:starts[0] + len(texts[0])] != texts[0]:
                continue
            char_span = (starts[0], starts[0] + len(texts[0]))
        q_ids = tokenizer.encode(question)[:settings.max_query_length]
        c_ids, offsets = tokenizer.encode_with_offsets(context)
        max_tokens = T - len(q_ids) - 3
        if max_tokens < 1:
            raise ValueError(f"max_seq_length={T} leaves no room for context after a "
                             f"{len(q_ids)}-token question; raise it or lower max_query_length")
        example = len(examples)
        examples.append({"id": sources.as_text(ex["id"]), "context": context, "answers": texts,
                         "offsets": offsets})
        spans = window_spans(len(c_ids), max_tokens, settings.doc_stride)
        for k, (start, length) in enumerate(spans):
            ids = [tokenizer.cls_id] + q_ids + [tokenizer.sep_id] + c_ids[start:start + length] + [tokenizer.sep_id]
            first = len(q_ids) + 2
            pad = T - len(ids)
            f = {"input_ids": np.asarray(ids + [0] * pad, np.int32),
                 "token_type_ids": np.asarray([0] * first + [1] * (length + 1) + [0] * pad, np.int32),
                 "attention_mask": np.asarray([1] * len(ids) + [0] * pad, np.int32),
                 "weights": np.float32(1.0)}
            if train:
                f["start_positions"], f["end_positions"] = _label(offsets, char_span, start, length, first)
            feats.append(f)
            windows.append(Window(example, first, start, length, max_context(spans, k)))
    return feats, windows, examples


def _label(offsets, char_span, start: int, length: int, first: int) -> tuple[np.int32, np.int32]:
    """Feature positions of the answer's first and last token, or (0, 0) when the window
    [start, start + length) does not hold them both."""
    begin, end = char_span
    inside = [t for t, (s, e) in enumerate(offsets) if s < end and e > begin]
    if not inside or inside[0] < start or inside[-1] >= start + length:
        return np.int32(0), np.int32(0)
    return np.int32(inside[0] - start + first), np.int32(inside[-1] - start + first)


def best_answers(start_logits: np.ndarray, end_logits: np.ndarray, windows: Sequence[Window],
                 examples: Sequence[dict], n_best_size: int, max_answer_length: int) -> dict[str, str]:
    """{question id: answer text} from each feature's logits [F, T] (module doc); "" where no
    valid span exists."""
    best: dict[int, tuple[float, str]] = {}
    for s_logits, e_logits, w in zip(start_logits, end_logits, windows):
        ex = examples[w.example]
        top_s = np.argsort(-s_logits, kind="stable")[:n_best_size]
        top_e = np.argsort(-e_logits, kind="stable")[:n_best_size]
        for s in top_s:
            for e in top_e:
                i, j = s - w.first, e - w.first  # positions in the window's context
                if not (0 <= i < w.length and 0 <= j < w.length) or j < i or j - i + 1 > max_answer_length:
                    continue
                if not w.max_context[i]:
                    continue
                score = float(s_logits[s] + e_logits[e])
                if w.example not in best or score > best[w.example][0]:
                    offsets = ex["offsets"]
                    best[w.example] = (score, ex["context"][offsets[w.start + i][0]:offsets[w.start + j][1]])
    return {ex["id"]: best.get(k, (0.0, ""))[1] for k, ex in enumerate(examples)}


class Squad:
    """SQuAD v1.1 data and dev evaluation (EM and F1) for `experiments.bert.finetune`."""

    task_cls = SpanTask
    heads = ("span",)
    num_labels = 2  # unused by the span head
    score_name = "squad_f1"

    def __init__(self, name: str, settings, tokenizer: WordPieceTokenizer):
        if sources.resolve(name) != "squad/v1.1":
            raise ValueError(f"SQuAD fine-tuning reads squad/v1.1, not {name!r}")
        self.settings = settings
        load = lambda split: sources.load("squad/v1.1", split, data_dir=settings.data_dir)
        print("tokenizing squad/v1.1 (train and validation)", flush=True)
        self.train = features(load("train"), tokenizer, settings, train=True,
                              limit=settings.max_train_examples)[0]
        if not self.train:
            raise ValueError("no SQuAD training example has its answer text at its answer_start")
        self.dev, self.windows, self.examples = features(load("validation"), tokenizer, settings, train=False,
                                                         limit=settings.max_eval_examples)

    def evaluate(self, predict: Callable[[list, tuple], dict]) -> dict[str, float]:
        out = predict(self.dev, ("start_logits", "end_logits"))
        answers = best_answers(out["start_logits"], out["end_logits"], self.windows, self.examples,
                               self.settings.n_best_size, self.settings.max_answer_length)
        result = fm.squad_scores(answers, {ex["id"]: ex["answers"] for ex in self.examples})
        return {"squad_exact_match": result["exact_match"], "squad_f1": result["f1"]}
