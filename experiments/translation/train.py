"""Train and evaluate the translation Transformer: `train_and_evaluate(config, workdir)`.

  python -m experiments.translation.train --config=experiments/translation/configs/base.py --workdir=DIR
"""
from __future__ import annotations

import os
import time

import jax
import numpy as np
import sacrebleu

from experiments import common
from tfm import decode
from tfm.data import pipeline, sources, synthetic
from tfm.models import EncoderDecoder, presets
from tfm.train.checkpoint import Checkpointer, average_checkpoints
from tfm.train.tasks import Seq2SeqTask
from tfm.train.trainer import train_and_evaluate as run_training


def load_data(config, workdir):
    """(train source, eval source, tokenizer); generates the local corpus when asked to."""
    data_dir = config.data_dir or os.path.join(workdir, "data")
    if config.dataset == "synthetic_translate":
        common.on_first_process(lambda: synthetic.prepare_translation(
            data_dir, train=config.synthetic_pairs, validation=config.eval_examples, test=config.eval_examples))
    train = sources.load(config.dataset, "train", data_dir=data_dir)
    evaluation = sources.load(config.dataset, "test", data_dir=data_dir)
    return train, evaluation, common.sentencepiece(workdir, sources.texts(train, ("en", "de")), config.vocab_size)


def translate(model, params, tok, sentences, max_len: int, *, beam_size: int, alpha: float,
              batch_size: int = 64) -> list[str]:
    """Translations of English sentences (beam search; greedy when beam_size is 1)."""
    step = jax.jit(lambda p, x, s: decode.translate(model, p, x, max_len, bos_id=tok.bos_id, eos_id=tok.eos_id,
                                                    inputs_segment_ids=s, beam_size=beam_size, alpha=alpha))
    out = []
    for i in range(0, len(sentences), batch_size):
        chunk = sentences[i:i + batch_size]
        ids = np.zeros((batch_size, max_len), np.int32)
        for row, sentence in enumerate(chunk):
            encoded = (tok.encode(sentence) + [tok.eos_id])[:max_len]
            ids[row, :len(encoded)] = encoded
        hyp = np.asarray(step(params, ids, (ids != 0).astype(np.int32)))
        out += [tok.decode(list(row)) for row in hyp[:len(chunk)]]
    return out


def bleu(model, params, tok, examples, max_len: int, beam_size: int, alpha: float) -> dict:
    """sacreBLEU (13a) and tokenized BLEU (the paper's convention, on whitespace tokens)."""
    src = [sources.as_text(ex["en"]) for ex in examples]
    refs = [sources.as_text(ex["de"]) for ex in examples]
    hyps = translate(model, params, tok, src, max_len, beam_size=beam_size, alpha=alpha)
    return {"sacrebleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
            "tokenized_bleu": sacrebleu.corpus_bleu(hyps, [refs], tokenize="intl").score,
            "samples": list(zip(src, hyps, refs))}


def train_and_evaluate(config, workdir: str) -> dict:
    """Trains per `config` in `workdir` (resuming if checkpoints exist); returns final metrics."""
    os.makedirs(workdir, exist_ok=True)
    train, evaluation, tok = load_data(config, workdir)
    model_cfg = getattr(presets, config.model.preset)(tok.vocab_size, **config.model.overrides)
    model = EncoderDecoder(model_cfg)
    tcfg = common.train_config(config)
    data = pipeline.seq2seq_dataset(train, tok, batch_size=config.batch_size, max_length=config.max_length,
                                    seed=config.seed, process_index=jax.process_index(),
                                    process_count=jax.process_count())
    eval_examples = [evaluation[i] for i in range(min(config.eval_examples, len(evaluation)))]
    result = run_training(tcfg, workdir, model=model, task=Seq2SeqTask(label_smoothing=config.label_smoothing),
                          train_data=data, config_dict=config.to_dict())
    params, averaged = result.state.params, 1
    if config.average_last > 1:
        checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.keep_checkpoints)
        averaged = min(config.average_last, len(checkpointer.all_steps()))
        if averaged > 1:
            params = average_checkpoints(checkpointer, result.trainer.abstract_state, averaged)
        checkpointer.close()
    start = time.perf_counter()
    scores = bleu(model, params, tok, eval_examples, config.decode_length, config.beam_size, config.alpha)
    scores["decode_seconds"] = time.perf_counter() - start
    scores["averaged_checkpoints"] = averaged
    scores["final_loss"] = result.history[-1]["loss"] if result.history else float("nan")
    return scores


def report(scores):
    print(f"BLEU: sacreBLEU {scores['sacrebleu']:.2f}, tokenized {scores['tokenized_bleu']:.2f} "
          f"(average of {scores['averaged_checkpoints']} checkpoints)")


if __name__ == "__main__":
    common.main(train_and_evaluate, report)
