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
from tfm import decode
from tfm.data import pipeline, sources, synthetic
from tfm.models import DecoderLM
from tfm.models import presets
from tfm.train import LMTask, flops_per_token
from tfm.train import train_and_evaluate as train_loop


def _split_texts(config, split: str, data_dir: str) -> list[dict]:
    """[{"text": sentence}, ...]; the synthetic documents are split into sentences."""
    if config.dataset == "synthetic_docs":
        common.on_first_process(lambda: synthetic.prepare_documents(data_dir))
        docs = sources.load("synthetic_docs", split, data_dir=data_dir)
        return [{"text": s} for d in sources.texts(docs) for s in d.split("\n") if s]
    return sources.load(config.dataset, split, data_dir=data_dir or None)


def unigram_entropy(texts, tokenizer) -> float:
    """Entropy (nats/token) of the unigram distribution of target tokens (text + EOS)."""
    counts = collections.Counter()
    for t in texts:
        counts.update(tokenizer.encode(t) + [tokenizer.eos_id])
    p = np.array(list(counts.values()), np.float64) / sum(counts.values())
    return float(-(p * np.log(p)).sum())


def model_config(config, vocab_size: int):
    overrides = dict(config.model_overrides)
    if config.model.startswith("tiny:"):
        return presets.tiny(config.model[5:], vocab_size=vocab_size,
                            max_len=max(64, config.seq_len), **overrides)
    overrides.setdefault("vocab_size", vocab_size)
    return getattr(presets, config.model)(**overrides)


def train_and_evaluate(config, workdir: str):
    """Train, evaluate and sample; returns the TrainResult with `.unigram_entropy` and
    `.samples` added."""
    data_dir = config.data_dir or os.path.join(workdir, "data")
    train, valid = _split_texts(config, "train", data_dir), _split_texts(config, "validation", data_dir)
    tok = common.sentencepiece(workdir, sources.texts(train), config.vocab_size)
    entropy = unigram_entropy(sources.texts(train), tok)
    mcfg = model_config(config, tok.vocab_size)
    model = DecoderLM(mcfg)
    shard = dict(process_index=jax.process_index(), process_count=jax.process_count())
    train_data = pipeline.lm_dataset(train, tok, batch_size=config.batch_size,
                                     seq_len=config.seq_len, seed=0, **shard)

    def eval_fn(trainer, params, step):
        ds = pipeline.lm_dataset(valid, tok, batch_size=config.batch_size, seq_len=config.seq_len,
                                 shuffle=False, num_epochs=1, **shard)
        batches = (b for _, b in zip(range(config.eval_batches), iter(ds)))
        return trainer.evaluate(params, batches)

    def fpt(num_params):
        return flops_per_token(num_params, mcfg.num_layers, mcfg.d_model, config.seq_len)

    result = train_loop(common.train_config(config), workdir, model=model, task=LMTask(),
                        train_data=iter(train_data), eval_fn=eval_fn, flops_per_token=fpt,
                        config_dict=config.to_dict())
    prompt = jnp.asarray([[tok.bos_id] + tok.encode(config.sample_prompt)], jnp.int32)
    samples = {}
    for name, kw in {"greedy": dict(greedy=True), "top_k": dict(top_k=8),
                     "top_p": dict(top_p=0.9, temperature=0.8)}.items():
        out = decode.sample_lm(model, result.state.params, prompt, config.sample_tokens,
                               jax.random.PRNGKey(0), eos_id=tok.eos_id, **kw)
        samples[name] = config.sample_prompt + " " + tok.decode(np.asarray(out[0]).tolist())
    if jax.process_index() == 0:
        last = result.eval_history[-1] if result.eval_history else {}
        print(f"unigram entropy of the corpus: {entropy:.3f} nats/token; "
              f"final eval loss: {last.get('loss', float('nan')):.3f} "
              f"(perplexity {math.exp(last.get('loss', float('nan'))):.2f})")
        for name, text in samples.items():
            print(f"sample ({name}): {text}")
    result.unigram_entropy, result.samples = entropy, samples
    return result


if __name__ == "__main__":
    common.main(train_and_evaluate)
