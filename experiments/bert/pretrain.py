"""BERT pretraining (Devlin et al. 2018): MLM + NSP, or RoBERTa-style MLM only.

    python -m experiments.bert.pretrain --config=experiments/bert/configs/base.py:runlocal --workdir=/tmp/bert

Workdir layout (the fine-tuning experiments load it):
    config.json          the resolved config, with "model_config" (the ModelConfig built);
                         config.step<N>.json when a resumed run changed keys (e.g. phase 2's
                         max_seq_length given on the command line)
    vocab.txt            the WordPiece vocabulary (tokenizer "wordpiece"); tokenizer.json for
                         "byte_bpe"
    checkpoints/<step>/  Orbax TrainState (params under "params") + data-iterator state
    metrics.jsonl        train and eval records; eval ones hold masked_lm_accuracy,
                         masked_lm_loss, next_sentence_accuracy, next_sentence_loss
    data/                the generated corpus (dataset "synthetic_docs" only)

Two phases, as the paper: max_seq_length / max_predictions_per_seq until phase2_start_step,
then phase2_* (512 / 80) in the same run: step, optimizer state and schedule carry on, since
the position table is 512 long from the start. The same switch works as a second command on
the same workdir (`--config.phase2_start_step=0 --config.max_seq_length=512 ...`): the change
is recorded in config.step<N>.json and the data stream restarts at the new length.

`train_and_evaluate(config, workdir)` is importable (tests, notebooks).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import shutil
from typing import Callable, Optional

import jax
import numpy as np

from experiments import common
from experiments.bert.settings import BertSettings
from tfm.data import documents, pretraining, sources, streaming, synthetic, tokenizers
from tfm.models import EncoderModel
from tfm.train import MLMTask, flops_per_token
from tfm.train.hooks import MetricsLog
from tfm.train.trainer import train_and_evaluate as run_training

GENERATED = {sources.resolve("synthetic_topics"): synthetic.prepare_topical_documents,
             sources.resolve("synthetic_docs"): synthetic.prepare_documents}
METRICS = ("masked_lm_accuracy", "masked_lm_loss", "next_sentence_accuracy", "next_sentence_loss")


def corpus(settings: BertSettings, workdir: str) -> documents.Corpus:
    """The dataset and text_dirs as one chunked corpus, read lazily (nothing is loaded here;
    a generated dataset is written first)."""
    parts = []
    if settings.dataset:
        data_dir = settings.data_dir
        prepare = GENERATED.get(sources.resolve(settings.dataset))
        if prepare:
            data_dir = data_dir or os.path.join(workdir, "data")
            common.on_first_process(lambda: prepare(data_dir, train=settings.synthetic_documents,
                                                    validation=1, test=1))
        source = sources.load(settings.dataset, "train", data_dir=data_dir)
        parts.append(documents.TfdsDocuments(source, settings.chunk_documents))
    directories = [d.strip() for d in settings.text_dirs.split(",") if d.strip()]
    if directories:
        parts.append(documents.TextDocuments(directories, settings.chunk_bytes))
    return documents.Corpus(parts)


def tokenizer(settings: BertSettings, workdir: str, docs: documents.Corpus, exclude: frozenset = frozenset()):
    """The WordPiece (or byte-level BPE) vocabulary: settings.vocab_path, else the workdir's,
    else trained by process 0 on `vocab_documents` training documents (`documents.sample`, not
    those in `exclude`) and read back by every process (WordPiece training breaks ties in
    hash order: two trainings of one sample differ); always left in the workdir (vocab.txt)."""
    if settings.tokenizer not in ("wordpiece", "byte_bpe"):
        raise ValueError(f"tokenizer must be 'wordpiece' or 'byte_bpe', got {settings.tokenizer!r}")
    wordpiece = settings.tokenizer == "wordpiece"
    cls = tokenizers.WordPieceTokenizer if wordpiece else tokenizers.ByteBPETokenizer
    train = tokenizers.train_wordpiece if wordpiece else tokenizers.train_byte_bpe
    name = "vocab.txt" if wordpiece else "tokenizer.json"
    path = os.path.join(workdir, name)
    os.makedirs(workdir, exist_ok=True)
    if settings.vocab_path:
        given = settings.vocab_path
        given = os.path.join(given, name) if os.path.isdir(given) else given
        tok = cls.load(given)
        if jax.process_index() == 0 and not (os.path.exists(path) and os.path.samefile(given, path)):
            shutil.copyfile(given, path)
        return tok

    def train_once():
        if not os.path.exists(path):
            texts = (s for d in documents.sample(docs, settings.vocab_documents, exclude=exclude) for s in d)
            train(texts, settings.vocab_size, path=path)

    common.on_first_process(train_once)
    if not os.path.exists(path):
        raise ValueError(f"process {jax.process_index()} finds no {path}, which process 0 trained: the "
                         "workdir must be one filesystem every host sees (e.g. a gcsfuse mount)")
    return cls.load(path)


@dataclasses.dataclass(frozen=True)
class Phase:
    max_seq_length: int
    max_predictions: int
    batch_size: int


def phases(settings: BertSettings, batch_size: int) -> tuple[Phase, Optional[Phase]]:
    first = Phase(settings.max_seq_length, settings.max_predictions_per_seq, batch_size)
    if not settings.phase2_start_step:
        return first, None
    return first, Phase(settings.phase2_max_seq_length, settings.phase2_max_predictions_per_seq,
                        settings.phase2_batch_size or batch_size)


def batch_shape(settings: BertSettings, phase: Phase) -> dict:
    """The keywords the streamed and the held-out batches of `phase` share."""
    s = settings
    return dict(batch_size=phase.batch_size, max_seq_length=phase.max_seq_length,
                max_predictions_per_seq=phase.max_predictions, masked_lm_prob=s.masked_lm_prob,
                short_seq_prob=s.short_seq_prob, dupe_factor=s.dupe_factor,
                whole_word_masking=s.whole_word_masking, next_sentence=s.next_sentence)


def train_stream(settings: BertSettings, phase: Phase, docs: documents.Corpus, tok, exclude: frozenset, *,
                 seed: int, process_index: int = 0, process_count: int = 1) -> streaming.PretrainingStream:
    """This host's training batches of `phase`: its chunks of `docs` (less `exclude`, the
    held-out keys), streamed (the next windows built by `data_workers` processes)."""
    return streaming.PretrainingStream(docs, tok, exclude=exclude, shuffle_chunks=settings.shuffle_chunks,
                                       seed=seed, process_index=process_index, process_count=process_count,
                                       workers=settings.data_workers, **batch_shape(settings, phase))


class PhasedBatches:
    """Phase-1 batches for the first `switch` steps, then phase-2 batches (switch None: one
    phase). Checkpointable: the state names the phase's shape and the batches drawn, so a
    restore into a run with another shape (phase 2 as a second command) starts that
    phase's stream afresh instead of replaying the wrong one."""

    def __init__(self, make: Callable[[Phase], object], first: Phase, second: Optional[Phase],
                 switch: Optional[int]):
        self.make, self.first, self.second, self.switch = make, first, second, switch
        self.drawn, self.inner, self.inner_phase = 0, None, None

    def phase_at(self, step: int) -> Phase:
        """The phase of the batch trained at 0-based `step`."""
        return self.second if self.second is not None and step >= self.switch else self.first

    def _iterator(self):
        phase = self.phase_at(self.drawn)
        if phase != self.inner_phase:
            self.inner, self.inner_phase = iter(self.make(phase)), phase
        return self.inner

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self._iterator())
        self.drawn += 1
        return batch

    def get_state(self) -> dict:
        return {"drawn": self.drawn, "phase": dataclasses.asdict(self.inner_phase),
                "inner": self.inner.get_state()}

    def set_state(self, state: dict) -> None:
        self.drawn = int(state["drawn"])
        it = self._iterator()
        if Phase(**state["phase"]) == self.inner_phase:
            it.set_state(state["inner"])


class PhaseTokens(MetricsLog):
    """MetricsLog whose tokens per step follow the phase (4x more tokens at 512 than 128)."""

    def __init__(self, log: MetricsLog, tokens_at: Callable[[int], int]):
        self.__dict__.update(log.__dict__)
        self.tokens_at = tokens_at

    def after_step(self, run, step, metrics):
        self.tokens_per_step = self.tokens_at(step - 1)
        super().after_step(run, step, metrics)


def baseline_accuracy(batches) -> float:
    """Accuracy of always predicting the most frequent masked token of `batches`."""
    counts = collections.Counter()
    for b in batches:
        counts.update(b["mlm_ids"][b["mlm_weights"] > 0].tolist())
    return max(counts.values()) / sum(counts.values())


def _check_model(mcfg, settings: BertSettings, longest: int) -> None:
    if mcfg.max_len < longest:
        raise ValueError(f"model max_len {mcfg.max_len} < the longest phase's max_seq_length {longest}; "
                         "the position table must cover phase 2 from the start")
    if settings.next_sentence != ("nsp" in mcfg.heads):
        raise ValueError(f"next_sentence={settings.next_sentence} needs model heads "
                         f"{'with' if settings.next_sentence else 'without'} 'nsp', got {mcfg.heads}")


def blueprint(config, num_devices: int) -> common.Blueprint:
    """What `train_and_evaluate` trains, without data: the vocabulary is config.vocab_size; one
    batch shape per phase."""
    exp = common.resolve(config, BertSettings, MLMTask)
    s = exp.settings
    mcfg = exp.model(s.vocab_size)
    first, second = phases(s, exp.train.batch_size)
    _check_model(mcfg, s, max(first.max_seq_length, second.max_seq_length if second else 0))
    batches = {f"phase {i + 1} ({p.max_seq_length} tokens)": pretraining.pretraining_batch_spec(
        p.batch_size, p.max_seq_length, p.max_predictions, s.next_sentence)
        for i, p in enumerate(filter(None, (first, second)))}
    return common.Blueprint(EncoderModel(mcfg), exp.task, exp.train, batches)


def train_and_evaluate(config, workdir: str, mesh: Optional[jax.sharding.Mesh] = None) -> dict:
    """Pretrains per `config` in `workdir` (resuming if checkpoints exist); returns the final
    held-out metrics (METRICS), the most-frequent-token baseline and the histories. `mesh`:
    default from config.mesh over all devices."""
    exp = common.resolve(config, BertSettings, MLMTask)
    s, tcfg = exp.settings, exp.train
    if s.phase2_start_step and not 0 < s.phase2_start_step < tcfg.num_train_steps:
        raise ValueError(f"phase2_start_step={s.phase2_start_step} must lie inside the run "
                         f"(0 < step < num_train_steps={tcfg.num_train_steps}), or be 0 for one phase")
    docs = corpus(s, workdir)
    eval_keys, eval_docs = documents.hold_out(docs, s.eval_documents, seed=tcfg.seed)  # never trained on
    tok = tokenizer(s, workdir, docs, eval_keys)
    mcfg = exp.model(tok.vocab_size)
    first, second = phases(s, tcfg.batch_size)
    _check_model(mcfg, s, max(first.max_seq_length, second.max_seq_length if second else 0))
    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())

    def make(phase: Phase):
        return train_stream(s, phase, docs, tok, eval_keys, seed=tcfg.seed, **shard)

    batches = PhasedBatches(make, first, second, s.phase2_start_step or None)
    eval_sets = {}

    def eval_batches(phase: Phase) -> list:
        if phase not in eval_sets:  # fixed masks: the same examples scored at every evaluation
            ds = pretraining.pretraining_dataset(eval_docs, tok, shuffle=False, num_epochs=1,
                                                 seed=tcfg.seed + 1, **batch_shape(s, phase), **shard)
            eval_sets[phase] = [b for _, b in zip(range(s.eval_batches), ds)]
            if not eval_sets[phase]:
                raise ValueError(f"the {s.eval_documents} held-out documents give no full batch of "
                                 f"{phase.batch_size}; raise eval_documents or lower batch_size")
        return eval_sets[phase]

    eval_batches(second or first)  # a held-out split too small fails now, not after training

    def evaluate(trainer, params, step):
        m = trainer.evaluate(params, eval_batches(batches.phase_at(max(step - 1, 0))))
        out = {"masked_lm_accuracy": m.get("mlm_accuracy", m["accuracy"]),
               "masked_lm_loss": m.get("mlm_loss", m["loss"])}
        if s.next_sentence:  # batch means weighted by masked tokens; batches are full, so ~equal
            out.update(next_sentence_accuracy=m["nsp_accuracy"], next_sentence_loss=m["nsp_loss"])
        return out

    def tokens_at(step: int) -> int:
        phase = batches.phase_at(step)
        return phase.batch_size * phase.max_seq_length

    def hooks(defaults):
        return [PhaseTokens(h, tokens_at) if isinstance(h, MetricsLog) else h for h in defaults]

    def fpt(flop_params):
        return flops_per_token(flop_params, mcfg.num_layers, mcfg.d_model, first.max_seq_length)

    result = run_training(tcfg, workdir, model=EncoderModel(mcfg), task=exp.task, train_data=batches,
                          eval_extra=evaluate, hooks=hooks, flops_per_token=fpt, mesh=mesh,
                          config_dict=exp.record(mcfg))
    out = {"step": int(result.state.step), "preempted": result.preempted, "history": result.history,
           "eval_history": result.eval_history}
    if result.preempted:
        return out
    last = result.eval_history[-1] if result.eval_history else {}
    out.update({k: last[k] for k in METRICS if k in last})
    out["baseline_masked_lm_accuracy"] = baseline_accuracy(eval_batches(batches.phase_at(out["step"] - 1)))
    return out


def report(result: dict) -> None:
    if jax.process_index() != 0:
        return
    print(f"held-out after {result['step']} steps: " +
          ", ".join(f"{k}={result[k]:.4f}" for k in METRICS if k in result))
    print(f"most-frequent-token baseline: masked_lm_accuracy={result['baseline_masked_lm_accuracy']:.4f}")


if __name__ == "__main__":
    common.main(train_and_evaluate, report)
