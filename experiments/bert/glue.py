"""GLUE for BERT fine-tuning: the TFDS `glue/<task>` builders, [CLS] a [SEP] b [SEP] inputs,
and each task's dev metrics as GLUE names them. `synthetic_topic_pairs` (`tfm.data.synthetic`,
generated offline into <workdir>/data, features like rte's) is the same kind of task for CPU runs.

Features (those of tensorflow_datasets' glue builder): cola, sst2 "sentence"; mrpc, rte,
stsb "sentence1"/"sentence2"; qqp "question1"/"question2"; mnli "premise"/"hypothesis";
qnli "question"/"sentence"; "label" (a class, or stsb's float score) and "idx".
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional, Sequence

import numpy as np

from experiments import common
from experiments.bert import finetune_metrics as fm
from tfm.data import sources, synthetic
from tfm.data.tokenizers import WordPieceTokenizer
from tfm.train import ClassificationTask, RegressionTask


@dataclasses.dataclass(frozen=True)
class GlueTask:
    text_keys: tuple[str, ...]     # one sentence or a pair
    num_labels: int                # 1: regression (STS-B)
    metrics: tuple[str, ...]       # finetune_metrics function names, GLUE's metrics for the task
    eval_splits: tuple[tuple[str, str], ...] = (("", "validation"),)  # (metric prefix, dev split)

    @property
    def regression(self) -> bool:
        return self.num_labels == 1


_PAIR = ("sentence1", "sentence2")
TASKS = {
    "cola": GlueTask(("sentence",), 2, ("matthews_corr",)),
    "sst2": GlueTask(("sentence",), 2, ("accuracy",)),
    "mrpc": GlueTask(_PAIR, 2, ("f1", "accuracy")),
    "stsb": GlueTask(_PAIR, 1, ("pearson", "spearman")),
    "qqp": GlueTask(("question1", "question2"), 2, ("accuracy", "f1")),
    "mnli": GlueTask(("premise", "hypothesis"), 3, ("accuracy",),
                     (("m", "validation_matched"), ("mm", "validation_mismatched"))),
    "qnli": GlueTask(("question", "sentence"), 2, ("accuracy",)),
    "rte": GlueTask(_PAIR, 2, ("accuracy",)),
}


# Generated locally (no download): is the pair on one topic? (`tfm.data.synthetic.topic_pairs`)
GENERATED = {"synthetic_topic_pairs": GlueTask(_PAIR, 2, ("accuracy",))}


def task_of(name: str) -> tuple[str, GlueTask]:
    """("rte", its GlueTask) for "glue/rte" (or "rte"); ValueError naming the known tasks."""
    short = name.partition("/")[2] if name.startswith("glue/") else name
    if short not in TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; known: {['glue/' + t for t in TASKS]}")
    return short, TASKS[short]


def truncate_pair(a: list[int], b: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """Drops tokens from the end of the longer side (b on a tie) until both fit, as BERT."""
    a, b = list(a), list(b)
    while len(a) + len(b) > max_tokens:
        (a if len(a) > len(b) else b).pop()
    return a, b


def encode(tokenizer: WordPieceTokenizer, texts: Sequence[str], max_seq_length: int) -> dict[str, np.ndarray]:
    """[CLS] a [SEP] (b [SEP]) -> input_ids, token_type_ids (0 for a, 1 for b), attention_mask:
    int32 [max_seq_length], padded with 0."""
    pieces = [tokenizer.encode(t) for t in texts]
    if len(pieces) == 1:
        a, b = pieces[0][:max_seq_length - 2], None
    else:
        a, b = truncate_pair(pieces[0], pieces[1], max_seq_length - 3)
    ids = [tokenizer.cls_id] + a + [tokenizer.sep_id]
    types = [0] * len(ids)
    if b is not None:
        ids += b + [tokenizer.sep_id]
        types += [1] * (len(b) + 1)
    pad = max_seq_length - len(ids)
    return {"input_ids": np.asarray(ids + [0] * pad, np.int32),
            "token_type_ids": np.asarray(types + [0] * pad, np.int32),
            "attention_mask": np.asarray([1] * len(ids) + [0] * pad, np.int32)}


def features(source, task: GlueTask, tokenizer: WordPieceTokenizer, max_seq_length: int,
             limit: int = 0) -> list[dict]:
    """One feature dict per example (the first `limit`; 0 = all): encode() plus "label"
    (int32 class or float32 score) and "weights" 1."""
    n = len(source) if not limit else min(limit, len(source))
    out = []
    for i in range(n):
        if i and i % 50_000 == 0:
            print(f"  {i}/{n} examples", flush=True)
        ex = source[i]
        f = encode(tokenizer, [sources.as_text(ex[k]) for k in task.text_keys], max_seq_length)
        f["label"] = np.asarray(ex["label"], np.float32 if task.regression else np.int32)
        f["weights"] = np.float32(1.0)
        out.append(f)
    return out


def scores(task: GlueTask, predictions: np.ndarray, labels: np.ndarray, prefix: str) -> dict[str, float]:
    """{prefix_metric: value in percent} for the task's metrics (predictions: classes or scores)."""
    return {f"{prefix}{m}": 100.0 * getattr(fm, m)(predictions, labels) for m in task.metrics}


def data_dir_of(name: str, data_dir: Optional[str], workdir: str) -> Optional[str]:
    """The directory the task is read from: `data_dir`; for a GENERATED task, `data_dir` or
    <workdir>/data, where it is written first (once, by the first process)."""
    if name not in GENERATED:
        return data_dir
    data_dir = data_dir or os.path.join(workdir, "data")
    common.on_first_process(lambda: synthetic.prepare_topic_pairs(data_dir))
    return data_dir


class Glue:
    """One GLUE (or GENERATED) task's data and dev evaluation for `experiments.bert.finetune`."""

    def __init__(self, name: str, settings, tokenizer: WordPieceTokenizer, workdir: str = ""):
        self.name, self.task = (name, GENERATED[name]) if name in GENERATED else task_of(name)
        self.task_cls = RegressionTask if self.task.regression else ClassificationTask
        self.heads = ("regression",) if self.task.regression else ("classification",)
        self.num_labels = max(self.task.num_labels, 2)  # unused by the regression head
        full = self.name if self.name in GENERATED else f"glue/{self.name}"
        data_dir = data_dir_of(self.name, settings.data_dir, workdir)
        load = lambda split: sources.load(full, split, data_dir=data_dir)
        print(f"tokenizing {full} (train and dev)", flush=True)
        self.train = features(load("train"), self.task, tokenizer, settings.max_seq_length,
                              settings.max_train_examples)
        self.dev = [(prefix, features(load(split), self.task, tokenizer, settings.max_seq_length,
                                      settings.max_eval_examples))
                    for prefix, split in self.task.eval_splits]
        metric_names = [f"{self.name}{'_' + p if p else ''}_{m}" for p, _ in self.task.eval_splits
                        for m in self.task.metrics]
        self.score_name = f"{self.name}_score"  # the mean of the task's metrics: the sweep picks by it
        self.metric_names = metric_names

    def evaluate(self, predict: Callable[[list, tuple], dict]) -> dict[str, float]:
        """Every dev split's metrics and their mean ("<task>_score"), in percent."""
        out = {}
        for prefix, feats in self.dev:
            key = "score" if self.task.regression else "logits"
            raw = predict(feats, (key,))[key]
            predictions = raw if self.task.regression else np.argmax(raw, axis=-1)
            labels = np.asarray([f["label"] for f in feats])
            out.update(scores(self.task, predictions, labels, f"{self.name}_{prefix + '_' if prefix else ''}"))
        out[self.score_name] = float(np.mean([out[m] for m in self.metric_names]))
        return out
