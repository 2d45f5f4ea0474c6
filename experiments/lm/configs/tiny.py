"""Tiny GPT-2-style LM on the locally generated corpus (CPU, no downloads).

Model: `gpt2_small` (position='learned', norm_position='pre', activation='gelu_tanh', num_layers=2,
  d_model=32, num_heads=4)

Command:   python -m experiments.lm.train --config=experiments/lm/configs/tiny.py --workdir=/tmp/lm_tiny
Hardware:  one CPU (2 shared cores); runtime ~30 s.
Expected:  validation loss 1.52 nats/token (perplexity 4.6) after 300 steps, against a
           unigram entropy of 4.27 nats/token for this corpus and tokenizer (measured;
           tests/test_lm_experiment.py checks a shorter run).
"""
from experiments import common
from experiments.lm.settings import LMSettings
from tfm.train import LMTask

TINY = dict(d_model=32, num_heads=4, num_layers=2, d_ff=64, max_len=64, dropout_rate=0.0, attention_dropout=0.0)


def get_config(arg: str = ""):
    del arg  # already tiny: `runlocal` changes nothing
    c = common.new_config(LMSettings, LMTask)
    c.model.preset = "gpt2_small"
    c.model.overrides = dict(TINY)
    c.dataset = "synthetic_docs"
    c.vocab_size = 256
    c.seq_len = 32
    c.eval_split = "validation"
    c.eval_batches = 4
    c.sample_prompt = "the"
    c.sample_tokens = 16
    c.batch_size = 32
    c.num_train_steps = 300
    c.optimizer.update(name="adamw", learning_rate=3e-3, warmup_steps=20, schedule="cosine",
                       weight_decay=0.01, b2=0.98)
    c.log_every = 50
    c.eval_every = 100
    c.checkpoint_every = 100
    return c
