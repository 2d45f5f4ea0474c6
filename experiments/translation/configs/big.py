"""Transformer big on WMT14 En->De (Vaswani et al. 2017, Table 3 row "big").

Model: `transformer_big` (position='sinusoidal', norm_position='post', activation='relu', num_layers=6,
  d_model=1024, num_heads=16)

Command (TPU v3-32 / v4-16 or 8 GPUs; on a pod, a --workdir every worker sees, e.g. a gcsfuse mount /gcs/BUCKET/...):
  python -m experiments.translation.train --config=experiments/translation/configs/big.py \
      --workdir=/tmp/wmt_big
Hardware and time: the paper trained 300k steps in 3.5 days on 8 P100s; not yet run with this code.
Expected result: newstest2014 BLEU 28.4 (paper, tokenized with compound splitting, beam 4,
alpha 0.6, average of the last 20 checkpoints).

Differs from base.py only where the paper's big model does: D 1024, F 4096, 16 heads, dropout
0.3, 300k steps, averaging the last 20 checkpoints (the noam schedule's d_model follows D).
`runlocal` shrinks it exactly as base.py's.
"""
from experiments.translation.configs import base


def get_config(runlocal: str = ""):
    c = base.get_config(runlocal)
    c.model.preset = "transformer_big"
    if not runlocal:
        c.num_train_steps = 300_000
        c.optimizer.noam_d_model = 1024
        c.average_last = c.keep_checkpoints = 20
    return c
