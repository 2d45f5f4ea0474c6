"""Decoder-only LM: train on lm1b or the local synthetic corpus, then sample.

    python -m experiments.lm.train --config=experiments/lm/configs/tiny.py --workdir=/tmp/lm

`train_and_evaluate(config, workdir)` is importable (tests, notebooks).
"""
from __future__ import annotations

import collections
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from experiments.lm.settings import LMSettings
from tfm import decode
from tfm.data import pipeline, sources, synthetic
from tfm.models import DecoderLM
from tfm.train import LMTask, flops_per_token
from tfm.train import train_and_evaluate as train_loop


def _split_texts(settings, split: str, data_dir: str) -> list[dict]:
    """[{"text": sentence}, ...]; the synthetic documents are split into sentences."""
    if settings.dataset == "synthetic_docs":
        common.on_first_process(lambda: synthetic.prepare_documents(data_dir))
        docs = sources.load("synthetic_docs", split, data_dir=data_dir)
        return [{"text": s} for d in sources.texts(docs) for s in d.split("\n") if s]
    return sources.load(settings.dataset, split, data_dir=settings.data_dir)  # None: the TFDS default


def load_splits(settings, data_dir: str) -> tuple[list, list]:
    """(train, held-out) examples with a "text" feature; held-out is settings.eval_split."""
    return _split_texts(settings, "train", data_dir), _split_texts(settings, settings.eval_split, data_dir)


def unigram_entropy(texts, tokenizer) -> float:
    """Entropy (nats/token) of the unigram distribution of target tokens (text + EOS)."""
    counts = collections.Counter()
    for t in texts:
        counts.update(tokenizer.encode(t) + [tokenizer.eos_id])
    p = np.array(list(counts.values()), np.float64) / sum(counts.values())
    return float(-(p * np.log(p)).sum())


def blueprint(config, num_devices: int) -> common.Blueprint:
    """What `train_and_evaluate` trains, without data: the vocabulary is config.vocab_size."""
    exp = common.resolve(config, LMSettings, LMTask)
    model = DecoderLM(exp.model(exp.settings.vocab_size))
    return common.Blueprint(model, exp.task, exp.train,
                            {"train": pipeline.lm_batch_spec(exp.train.batch_size, exp.settings.seq_len)})


def train_and_evaluate(config, workdir: str):
    """Train, evaluate and sample; returns the TrainResult with `.unigram_entropy` and
    `.samples` added."""
    exp = common.resolve(config, LMSettings, LMTask)
    s, tcfg = exp.settings, exp.train
    data_dir = s.data_dir or os.path.join(workdir, "data")
    train, valid = load_splits(s, data_dir)
    tok = common.sentencepiece(workdir, sources.texts(train), s.vocab_size)
    entropy = unigram_entropy(sources.texts(train), tok)
    mcfg = exp.model(tok.vocab_size)
    model = DecoderLM(mcfg)
    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())
    train_data = pipeline.lm_dataset(train, tok, batch_size=tcfg.batch_size, seq_len=s.seq_len,
                                     seed=tcfg.seed, **shard)

    def eval_data():
        ds = pipeline.lm_dataset(valid, tok, batch_size=tcfg.batch_size, seq_len=s.seq_len,
                                 shuffle=False, num_epochs=1, drop_remainder=False, **shard)
        return (b for _, b in zip(range(s.eval_batches), iter(ds)))

    def fpt(flop_params):
        return flops_per_token(flop_params, mcfg.num_layers, mcfg.d_model, s.seq_len)

    result = train_loop(tcfg, workdir, model=model, task=exp.task, train_data=iter(train_data),
                        eval_data=eval_data, flops_per_token=fpt, config_dict=exp.record(mcfg))
    result.unigram_entropy, result.samples = entropy, {}
    if result.preempted:  # stopped on a signal: nothing below would describe a finished run
        return result
    prompt = jnp.asarray([[tok.bos_id] + tok.encode(s.sample_prompt)], jnp.int32)
    samples = {}
    for name, kw in {"greedy": dict(greedy=True), "top_k": dict(top_k=8),
                     "top_p": dict(top_p=0.9, temperature=0.8)}.items():
        # one jitted program (eagerly, the cache's set-up and the prompt's step compile op by op)
        out = jax.jit(lambda params, prompt: decode.sample_lm(model, params, prompt, s.sample_tokens,
                                                              jax.random.PRNGKey(0), eos_id=tok.eos_id, **kw)
                      )(result.state.params, prompt)
        samples[name] = s.sample_prompt + " " + tok.decode(np.asarray(out[0]).tolist())
    if jax.process_index() == 0:
        last = result.eval_history[-1] if result.eval_history else {}
        print(f"unigram entropy of the corpus: {entropy:.3f} nats/token; "
              f"final eval loss: {last.get('loss', float('nan')):.3f} "
              f"(perplexity {math.exp(last.get('loss', float('nan'))):.2f})")
        for name, text in samples.items():
            print(f"sample ({name}): {text}")
    result.samples = samples
    return result


if __name__ == "__main__":
    common.main(train_and_evaluate)
