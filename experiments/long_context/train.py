"""Long-document classification with one attention variant (configs/tiny.py), scored on held-out
documents by where their needle lies: within the sliding window's reach of CLS or beyond it.

    python -m experiments.long_context.train --config=experiments/long_context/configs/tiny.py:window \
        --workdir=/tmp/tfm_long_window

An `EncoderModel` with a classification head reads the CLS state of generated documents
(`documents.py`) and names their needle token. The scores (held-out accuracy, on needles at
positions <= settings.near and beyond, and the parameter count) go to <workdir>/scores.json.
`train_and_evaluate(config, workdir)` is importable (compare.py, tests, notebooks).
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.long_context import documents
from experiments.long_context.settings import LongContextSettings
from tfm.data import pipeline
from tfm.models import EncoderModel
from tfm.train import ClassificationTask
from tfm.train import train_and_evaluate as train_loop

CHANCE = 1 / len(documents.NEEDLES)


def check_settings(settings: LongContextSettings, model_config) -> None:
    """The model can read the documents: positions up to length, a classifier over the needles."""
    if model_config.max_len < settings.length:
        raise ValueError(f"config.length={settings.length} exceeds model.overrides.max_len={model_config.max_len}; "
                         "raise max_len to at least the document length")
    if "classification" not in model_config.heads or model_config.num_labels != len(documents.NEEDLES):
        raise ValueError(f"model.overrides must set heads=('classification',) and num_labels={len(documents.NEEDLES)}")
    if not 0 <= settings.near < settings.length:
        raise ValueError(f"config.near={settings.near} must lie in 0 .. length - 1 = {settings.length - 1}")


class TrainBatches:
    """This process's rows of global batch `step`: document indices drawn from the training set by
    (seed, step). The state is the step, so a resumed run sees exactly the batches it would have."""

    def __init__(self, settings: LongContextSettings, batch_size: int, seed: int):
        self.settings, self.seed, self.step, self.batch_size = settings, seed, 0, batch_size
        self.rows = pipeline.host_batch_size(batch_size, jax.process_count())
        self.first = jax.process_index() * self.rows

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        drawn = np.random.default_rng([self.seed, self.step]).integers(0, self.settings.train_documents, self.batch_size)
        self.step += 1
        return documents.batch(self.seed, "train", drawn[self.first:self.first + self.rows], self.settings.length)

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])


def held_out_scores(model, params, settings: LongContextSettings, seed: int, batch_size: int) -> dict:
    """accuracy over the held-out documents, near_accuracy / far_accuracy over those whose needle
    lies at a position <= settings.near / beyond it, and how many documents each holds."""
    predict = jax.jit(lambda p, x: jnp.argmax(model.apply({"params": p}, x).logits, -1))
    hits, needles = [], []
    for start in range(0, settings.eval_documents, batch_size):
        indices = range(start, min(start + batch_size, settings.eval_documents))
        b = documents.batch(seed, "test", indices, settings.length)
        hits.append(np.asarray(predict(params, b["input_ids"])) == b["label"])
        needles.append([documents.make(seed, "test", i, settings.length).needle for i in indices])
    hits, near = np.concatenate(hits), np.concatenate(needles) <= settings.near
    return {"accuracy": float(hits.mean()), "near_accuracy": float(hits[near].mean()) if near.any() else None,
            "far_accuracy": float(hits[~near].mean()) if (~near).any() else None,
            "near_documents": int(near.sum()), "far_documents": int((~near).sum()), "chance": CHANCE}


def train_and_evaluate(config, workdir: str) -> dict:
    """Train, then score the held-out documents; returns held_out_scores plus "num_params",
    "eval_history" and "preempted"."""
    exp = common.resolve(config, LongContextSettings, ClassificationTask)
    s, tcfg = exp.settings, exp.train
    mcfg = exp.model(documents.VOCAB_SIZE)
    check_settings(s, mcfg)
    model = EncoderModel(mcfg)
    rows = pipeline.host_batch_size(tcfg.batch_size, jax.process_count())

    def eval_data():
        for start in range(0, s.eval_documents - tcfg.batch_size + 1, tcfg.batch_size):
            first = start + jax.process_index() * rows
            yield documents.batch(tcfg.seed, "test", range(first, first + rows), s.length)

    result = train_loop(tcfg, workdir, model=model, task=exp.task, train_data=TrainBatches(s, tcfg.batch_size, tcfg.seed),
                        eval_data=eval_data, config_dict=exp.record(mcfg))
    if result.preempted:  # stopped on a signal: nothing below would describe a finished run
        return {"preempted": True}
    scores = {**held_out_scores(model, result.state.params, s, tcfg.seed, tcfg.batch_size),
              "num_params": int(result.trainer.num_params), "eval_history": result.eval_history, "preempted": False}
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "scores.json"), "w") as f:
            json.dump(scores, f, indent=1)
        print(report(scores, s.near))
    return scores


def percent(x) -> str:
    """`x` as a percentage, "—" where there is none."""
    return "—" if x is None else f"{x:.1%}"


def report(scores: dict, near: int) -> str:
    """One line: held-out accuracy overall, near and far, beside chance."""
    return (f"held-out accuracy {percent(scores['accuracy'])}: needle at <= {near} {percent(scores['near_accuracy'])} "
            f"({scores['near_documents']} docs), beyond {percent(scores['far_accuracy'])} ({scores['far_documents']} docs); "
            f"chance {percent(scores['chance'])}; {scores['num_params']:,} parameters")


if __name__ == "__main__":
    common.main(train_and_evaluate)
