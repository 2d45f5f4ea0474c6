"""Plumbing every experiment shares: the vocabulary, the TrainConfig from an ml_collections
config, and the command-line entry point."""
from __future__ import annotations

import os
from typing import Callable, Iterable

import jax

from tfm import parallel
from tfm.data import tokenizers
from tfm.train import OptimizerConfig, TrainConfig


def sentencepiece(workdir: str, texts: Iterable[str], vocab_size: int) -> tokenizers.SentencePieceTokenizer:
    """The experiment's SentencePiece model: loaded from the workdir, or trained on `texts` (and
    saved there by process 0; training is deterministic, so every host gets the same vocabulary)."""
    path = os.path.join(workdir, f"spm_{vocab_size}.model")
    if os.path.exists(path):
        return tokenizers.SentencePieceTokenizer.load(path)
    os.makedirs(workdir, exist_ok=True)
    return tokenizers.train_sentencepiece(texts, vocab_size, path=path if jax.process_index() == 0 else None)


def on_first_process(prepare: Callable[[], object]) -> None:
    """Runs `prepare` (e.g. writing a generated dataset) on process 0 only; every process waits
    until it is done, so hosts sharing a filesystem never write the same files at once."""
    if jax.process_index() == 0:
        prepare()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("tfm: data prepared")


def train_config(config) -> TrainConfig:
    """TrainConfig from an experiment config: `optimizer` holds OptimizerConfig fields and `mesh`
    MeshConfig fields; the other names match TrainConfig's."""
    return TrainConfig(
        num_train_steps=config.num_train_steps, batch_size=config.batch_size, seed=config.get("seed", 0),
        optimizer=OptimizerConfig(**config.optimizer.to_dict()),
        label_smoothing=config.get("label_smoothing", 0.0),
        mesh=parallel.MeshConfig(**config.mesh.to_dict()), parallelism=config.parallelism,
        log_every=config.log_every, eval_every=config.eval_every, checkpoint_every=config.checkpoint_every,
        keep_checkpoints=config.get("keep_checkpoints", 3), progress_bar=config.get("progress_bar", True))


def main(train_and_evaluate: Callable, report: Callable[[object], None] = lambda result: None):
    """`--config=FILE[:arg] --workdir=DIR`: join the multi-host job, train, report."""
    from absl import app, flags, logging
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
    flags.DEFINE_string("workdir", None, "checkpoints, logs and the vocabulary go here")
    flags.mark_flags_as_required(["config", "workdir"])

    def run(argv):
        del argv
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
        parallel.initialize()  # automatic on TPU pods and SLURM; TFM_* variables elsewhere
        report(train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir))

    app.run(run)
