"""Transformer base on WMT14 En->De (Vaswani et al. 2017, Table 3 row "base").

Command (TPU v3-8 or 8 GPUs; add --workdir=gs://... on a pod):
  python -m experiments.translation.train --config=experiments/translation/configs/base.py \
      --workdir=/tmp/wmt_base
Hardware and time: the paper trained 100k steps in 12 h on 8 P100s; expect a few hours on a TPU v3-8.
Expected result: newstest2014 BLEU 27.3 (paper, tokenized, beam 4, alpha 0.6, average of the last
5 checkpoints); report sacreBLEU beside it, typically ~1 lower.
Prerequisite: the TFDS dataset `wmt14_translate/de-en` prepared in --data_dir (needs the `tf` extra).

`runlocal` (e.g. `--config=.../base.py:runlocal`) trains a tiny model on the project's generated
En->De corpus on one CPU in about a minute: the same code path at toy scale.
"""
import ml_collections


def get_config(runlocal: str = "") -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.dataset = "wmt14"  # tfm.data.sources name
    c.data_dir = ml_collections.FieldReference(None, field_type=str)
    c.vocab_size = 37_000  # shared source/target byte-pair vocabulary (paper: ~37k)
    c.max_length = 256
    c.eval_examples = 3003  # all of newstest2014
    c.decode_length = 256
    c.beam_size = 4  # paper: beam 4, length penalty alpha 0.6
    c.alpha = 0.6

    c.model = ml_collections.ConfigDict(dict(preset="transformer_base", overrides={}))

    c.batch_size = 512  # sequences per step; with packing ~25k source + ~25k target tokens (paper)
    c.num_train_steps = 100_000
    c.label_smoothing = 0.1
    c.optimizer = ml_collections.ConfigDict(dict(
        name="adam", b1=0.9, b2=0.98, eps=1e-9, schedule="noam", warmup_steps=4000, learning_rate=1.0,
        noam_d_model=512, clip_grad_norm=None))
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, expert=1))
    c.parallelism = "data"
    c.log_every = 100
    c.eval_every = 5000
    c.checkpoint_every = 1000
    c.keep_checkpoints = 5
    c.average_last = 5  # checkpoint averaging for the final evaluation (paper: last 5)
    c.seed = 0

    if runlocal:
        c.dataset = "synthetic_translate"
        c.vocab_size = 256
        c.max_length = 40
        c.eval_examples = 100
        c.decode_length = 40
        c.synthetic_pairs = 12_000
        c.model.overrides = dict(d_model=64, num_heads=4, num_layers=2, d_ff=256, dropout_rate=0.0)
        c.batch_size = 32
        c.num_train_steps = 600
        c.optimizer.update(warmup_steps=100, learning_rate=0.3, noam_d_model=64)
        c.log_every = 50
        c.eval_every = 0
        c.checkpoint_every = 0
        c.average_last = 1
    return c
