"""Transformer base on WMT14 En->De (Vaswani et al. 2017, Table 3 row "base").

Model: `transformer_base` (position='sinusoidal', norm_position='post', activation='relu', num_layers=6,
  d_model=512)

Command (TPU v3-8 or 8 GPUs; on a pod, a --workdir every worker sees, e.g. a gcsfuse mount /gcs/BUCKET/...):
  python -m experiments.translation.train --config=experiments/translation/configs/base.py \
      --workdir=/tmp/wmt_base
Hardware and time: the paper trained 100k steps in 12 h on 8 P100s; expect a few hours on a TPU v3-8.
Expected result: newstest2014 BLEU 27.3 (paper, tokenized, beam 4, alpha 0.6, average of the last
5 checkpoints); report sacreBLEU beside it, typically ~1 lower.
Target and preflight: TPU v5p-8 (4 chips), data parallel. `python -m experiments.preflight
  --config=experiments/translation/configs/base.py --target=v5p-8` (libtpu 0.0.42.1; 100 packed
  rows of 256): fits, with the estimated step and MFU (the flash kernels' time counted) in
  benchmarks/RESULTS.md's preflight section, the h100-8 row too.
Prerequisite: the TFDS dataset `wmt14_translate/de-en` prepared in --data_dir (needs the `tf` extra).

`runlocal` (e.g. `--config=.../base.py:runlocal`) trains a tiny model on the project's generated
En->De corpus on one CPU in about a minute: the same keys and code path at toy scale.
"""
from experiments import common
from experiments.translation.settings import TranslationSettings
from tfm.train import Seq2SeqTask


def get_config(runlocal: str = ""):
    c = common.new_config(TranslationSettings, Seq2SeqTask)
    c.dataset = "wmt14"  # tfm.data.sources name
    c.synthetic_pairs = 0  # only for dataset "synthetic_translate"
    c.vocab_size = 37_000  # shared source/target byte-pair vocabulary (paper: ~37k)
    # trained on a seeded sample: 500k of WMT14's ~4.5M pairs, both sides (the paper's BPE read
    # the whole corpus; a sample bounds the startup's time and memory whatever the corpus size)
    c.spm_sentences = 1_000_000
    c.max_length = 256
    # processes building the training batches (0: the training process). A core streams ~200k
    # real tokens/s of generated pairs, the v5p-8's chips take ~3.3M: ~16-18 (RESULTS.md, 2026-11-24)
    c.data_workers = 0
    c.eval_examples = 3003  # all of newstest2014 for the final BLEU; newstest2013 for eval loss
    c.eval_bleu_examples = 500  # newstest2013 sentences decoded at each eval (0: loss only)
    c.decode_length = 256
    c.beam_size = 4  # paper: beam 4, length penalty alpha 0.6
    c.alpha = 0.6
    c.average_last = 5  # checkpoint averaging for the final evaluation (paper: last 5)

    c.model.preset = "transformer_base"
    # how, not what: bf16 compute (fp32 parameters and Adam) and the flash kernels on TPU/GPU
    # ("auto"; xla on CPU). The preflight's estimates on v5p-8 before and after: RESULTS.md.
    c.model.overrides = dict(execution=dict(dtype="bfloat16", attention_impl="auto"))
    c.task.label_smoothing = 0.1

    c.tokens_per_batch = 25_000  # per side, as the paper (~25k source + ~25k target tokens per step)
    c.batch_size = None  # derived from tokens_per_batch: packed rows of max_length
    c.num_train_steps = 100_000
    c.optimizer.update(name="adam", b1=0.9, b2=0.98, eps=1e-9, schedule="noam", warmup_steps=4000,
                       learning_rate=1.0, noam_d_model=512, clip_grad_norm=None)
    c.parallelism = "data"
    c.log_every = 100
    c.eval_every = 5000
    c.checkpoint_every = 1000
    c.keep_checkpoints = 5

    if runlocal:
        c.dataset = "synthetic_translate"
        c.synthetic_pairs = 12_000
        c.vocab_size = 256
        c.spm_sentences = 24_000  # every pair's two sides
        c.max_length = 40
        c.eval_examples = 100
        c.eval_bleu_examples = 0
        c.decode_length = 40
        c.model.overrides = dict(d_model=64, num_heads=4, num_layers=2, d_ff=256, dropout_rate=0.0,
                                 execution=dict(dtype="float32", attention_impl="xla"))
        c.tokens_per_batch = 1_000  # ~30 packed rows of 40
        c.num_train_steps = 600
        c.optimizer.update(warmup_steps=100, learning_rate=0.3, noam_d_model=64)
        c.log_every = 50
        c.eval_every = 0
        c.checkpoint_every = 0
        c.average_last = 1
    return c
