"""Train and evaluate the translation Transformer: `train_and_evaluate(config, workdir)`.

  python -m experiments.translation.train --config=experiments/translation/configs/base.py --workdir=DIR
"""
from __future__ import annotations

import itertools
import os
import time
from typing import Optional

import jax
import numpy as np

from experiments import common
from experiments.translation import bleu as bleu_lib
from experiments.translation.settings import TranslationSettings
from tfm import decode
from tfm.data import pipeline, sources, synthetic
from tfm.models import EncoderDecoder
from tfm.train.checkpoint import CheckpointError, Checkpointer, average_checkpoints
from tfm.train.tasks import Seq2SeqTask
from tfm.train.trainer import train_and_evaluate as run_training


def load_sources(settings, workdir):
    """(train, validation, test) sources; generates the local corpus when asked to."""
    data_dir = settings.data_dir or os.path.join(workdir, "data")
    if settings.dataset == "synthetic_translate":
        n = settings.eval_examples
        common.on_first_process(lambda: synthetic.prepare_translation(
            data_dir, train=settings.synthetic_pairs, validation=n, test=n))
    return tuple(sources.load(settings.dataset, split, data_dir=data_dir) for split in ("train", "validation", "test"))


def tokenizer(settings, workdir, train):
    """The shared SentencePiece model: the workdir's, else trained on `spm_sentences` sentences,
    both sides of a seeded sample of the training pairs read by index (`sources.sample`: the same
    on every host, no pass over the corpus)."""
    if settings.spm_sentences < 1:
        raise ValueError(f"spm_sentences={settings.spm_sentences}: the SentencePiece model needs at least one sentence")
    pairs = sources.sample(train, -(-settings.spm_sentences // 2), seed=0)
    texts = (sources.as_text(ex[k]) for ex in pairs for k in ("en", "de"))
    return common.sentencepiece(workdir, itertools.islice(texts, settings.spm_sentences), settings.vocab_size)


def batch_rows(settings, train, tok) -> dict:
    """{"batch_size": rows} for a token budget (settings.tokens_per_batch > 0), else {}."""
    if not settings.tokens_per_batch:
        return {}
    rows = pipeline.rows_for_token_budget(train, tok, tokens_per_batch=settings.tokens_per_batch,
                                          max_length=settings.max_length, multiple=jax.device_count())
    if jax.process_index() == 0:
        print(f"batch: {rows} packed rows of {settings.max_length} for ~{settings.tokens_per_batch} "
              "tokens per side per step (measured on a packed sample of the training data)")
    return {"batch_size": rows}


def train_stream(config, workdir: str, train):
    """(tokenizer, resolved experiment, this host's training batches): what the run prepares
    before its first step. It reads a bounded number of training pairs whatever the corpus size
    (the tokenizer's sample, the token budget's packed sample, then the stream itself: a lazy
    seeded permutation of record indices, every `process_count`-th for this host, read in blocks,
    built by `data_workers` processes, its position checkpointed with the model)."""
    s = common.settings_of(config, TranslationSettings)
    tok = tokenizer(s, workdir, train)
    exp = common.resolve(config, TranslationSettings, Seq2SeqTask, **batch_rows(s, train, tok))
    data = pipeline.seq2seq_dataset(train, tok, batch_size=exp.train.batch_size, max_length=s.max_length,
                                    seed=exp.train.seed, process_index=jax.process_index(),
                                    process_count=jax.process_count(), workers=s.data_workers)
    return tok, exp, data


def blueprint(config, num_devices: int) -> common.Blueprint:
    """What `train_and_evaluate` trains, without data: the vocabulary is config.vocab_size and a
    token budget gives fully packed rows (the real run measures packing on its data, which
    gives a few more rows), rounded up to a multiple of the device count."""
    s = common.settings_of(config, TranslationSettings)
    rows = {}
    if s.tokens_per_batch:
        rows = {"batch_size": -(-s.tokens_per_batch // (s.max_length * num_devices)) * num_devices}
    exp = common.resolve(config, TranslationSettings, Seq2SeqTask, **rows)
    model = EncoderDecoder(exp.model(s.vocab_size))
    return common.Blueprint(model, exp.task, exp.train,
                            {"train": pipeline.seq2seq_batch_spec(exp.train.batch_size, s.max_length)})


def translate(model, params, tok, sentences, max_len: int, *, beam_size: int, alpha: float,
              batch_size: int = 64, extra_length: int = 50) -> list[str]:
    """Translations of English sentences (beam search; greedy when beam_size is 1), each at most
    its source length + extra_length tokens (and max_len). Sentences are decoded in batches of
    similar length, so a batch stops early, and returned in their original order. A batch holds
    batch_size rows, or as many as there are sentences when fewer (no decoding of empty rows)."""
    step = jax.jit(lambda p, x, s, n: decode.translate(model, p, x, max_len, bos_id=tok.bos_id, eos_id=tok.eos_id,
                                                       inputs_segment_ids=s, beam_size=beam_size, alpha=alpha,
                                                       max_lengths=n))
    encoded = [(tok.encode(sentence) + [tok.eos_id])[:max_len] for sentence in sentences]
    order = sorted(range(len(sentences)), key=lambda i: len(encoded[i]))
    out = [None] * len(sentences)
    batch_size = max(1, min(batch_size, len(sentences)))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        ids = np.zeros((batch_size, max_len), np.int32)
        limits = np.ones((batch_size,), np.int32)
        for row, i in enumerate(chunk):
            ids[row, :len(encoded[i])] = encoded[i]
            limits[row] = min(len(encoded[i]) + extra_length, max_len)
        hyp = np.asarray(step(params, ids, (ids != 0).astype(np.int32), limits))
        for row, i in enumerate(chunk):
            out[i] = tok.decode(list(hyp[row]))
    return out


def bleu(model, params, tok, examples, max_len: int, beam_size: int, alpha: float) -> dict:
    """The paper's BLEU (bleu_moses_compound_split) and sacreBLEU with its signature, on the
    detokenized translations of `examples`; "samples" holds (source, hypothesis, reference)."""
    src = [sources.as_text(ex["en"]) for ex in examples]
    refs = [sources.as_text(ex["de"]) for ex in examples]
    hyps = translate(model, params, tok, src, max_len, beam_size=beam_size, alpha=alpha)
    return {**bleu_lib.scores(hyps, refs), "samples": list(zip(src, hyps, refs))}


def train_and_evaluate(config, workdir: str) -> dict:
    """Trains per `config` in `workdir` (resuming if checkpoints exist), evaluating loss (and
    BLEU when eval_bleu_examples > 0) on the validation split; returns the test-set BLEU."""
    s = common.settings_of(config, TranslationSettings)
    blueprint(config, jax.device_count())  # every value checked before the corpus is read or generated
    os.makedirs(workdir, exist_ok=True)
    train, validation, test = load_sources(s, workdir)
    tok, exp, data = train_stream(config, workdir, train)
    tcfg = exp.train
    model_cfg = exp.model(tok.vocab_size)
    model = EncoderDecoder(model_cfg)
    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())
    held_out = [validation[i] for i in range(min(s.eval_examples, len(validation)))]

    def eval_data():
        return pipeline.seq2seq_dataset(held_out, tok, batch_size=tcfg.batch_size, max_length=s.max_length,
                                        shuffle=False, num_epochs=1, drop_remainder=False, **shard)

    def eval_bleu(trainer, params, step):
        scores = bleu(model, params, tok, held_out[:s.eval_bleu_examples], s.decode_length, s.beam_size, s.alpha)
        return {k: scores[k] for k in (bleu_lib.PAPER_BLEU, bleu_lib.SACREBLEU)}

    result = run_training(tcfg, workdir, model=model, task=exp.task, train_data=data, eval_data=eval_data,
                          eval_extra=eval_bleu if s.eval_bleu_examples else None,
                          config_dict=exp.record(model_cfg))
    if result.preempted:  # stopped on a signal: no final evaluation of a half-trained model
        return {"preempted": True, "step": int(result.state.step), "eval_history": result.eval_history}
    test_examples = [test[i] for i in range(min(s.eval_examples, len(test)))]
    scores = checkpoint_bleu(model, result.trainer.abstract_state, workdir, s, tok, test_examples, "test",
                             keep=tcfg.keep_checkpoints)
    scores["final_loss"] = result.history[-1]["loss"] if result.history else float("nan")
    scores["eval_history"] = result.eval_history
    return scores


def checkpoint_bleu(model, abstract_state, workdir: str, settings, tok, examples, split: str, *, keep: int,
                    average_last: Optional[int] = None) -> dict:
    """BLEU on `examples` of `split` of the average of the last `average_last` (default
    settings.average_last) checkpoints in workdir ("checkpoint_steps" names them). The test set
    is named and the decoding timed."""
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=keep)
    steps = checkpointer.all_steps()
    if not steps:
        raise CheckpointError(f"no checkpoint to score in {checkpointer.directory}")
    steps = steps[-max(1, min(average_last or settings.average_last, len(steps))):]
    if len(steps) > 1:
        params = average_checkpoints(checkpointer, abstract_state, len(steps))
    else:
        params = checkpointer.restore(abstract_state, steps[0], with_data=False)[0].params
    checkpointer.close()
    start = time.perf_counter()
    scores = bleu(model, params, tok, examples, settings.decode_length, settings.beam_size, settings.alpha)
    scores["decode_seconds"] = time.perf_counter() - start
    scores["test_set"] = bleu_lib.describe_test_set(sources.resolve(settings.dataset), split, len(examples))
    scores["averaged_checkpoints"], scores["checkpoint_steps"] = len(steps), steps
    return scores


def report_line(scores) -> str:
    """Both BLEUs on the named test set, and the checkpoint (or the average of checkpoints) scored."""
    steps = scores["checkpoint_steps"]
    scored = (f"checkpoint step {steps[0]}" if len(steps) == 1 else
              f"average of the {len(steps)} checkpoints of steps {', '.join(map(str, steps))}")
    return f"{bleu_lib.report(scores, scores['test_set'])} ({scored})"


def report(scores):
    print(report_line(scores))


if __name__ == "__main__":
    common.main(train_and_evaluate, report)
