"""BERT-large pretraining, MLM + NSP (Devlin et al. 2018): base.py with L24/H1024/A16.

Model: `bert_large` (position='learned', norm_position='post', activation='gelu', num_layers=24, d_model=1024,
  num_heads=16)

Command (TPU v3-128 pod slice or 8 GPUs; on a pod, a workdir every worker sees: a gcsfuse mount):
  python -m experiments.bert.pretrain --config=experiments/bert/configs/large.py --workdir=/gcs/BUCKET/bert_large
Hardware and time: the paper took 4 days on 64 Cloud TPU chips (16 Cloud TPUs); not yet run
with this code.
Target and preflight: TPU v5p-16 (8 chips), data parallel. `python -m experiments.preflight
  --config=experiments/bert/configs/large.py --target=v5p-16` (libtpu 0.0.42.1): fits in both
  phases (3.76 GiB params + Adam per chip of 95), attention by the flash kernels with the paper's
  dropout (impl auto); the memory, estimated steps and MFU of both phases, and of the bf16 + fsdp
  variant (`--config.model.overrides.execution.dtype=bfloat16 --config.parallelism=fsdp
  --config.mesh.data=1 --config.mesh.fsdp=-1`), are in benchmarks/RESULTS.md.
Expected: GLUE average 82.1 and SQuAD v1.1 dev F1 90.9 after fine-tuning (paper, Tables 1 and
2); held-out masked_lm_accuracy 0.720 is MLPerf's BERT-large target (MLPerf Training reference,
Wikipedia only).

`large.py:lamb` is the large-batch recipe of You et al. 2019 ("76 minutes"): LAMB, batch
65,536 at 128 for 7,038 steps then 32,768 at 512 for 1,561 (8,599 in all), one schedule with
peak lr 6e-3 and 2,000 warmup steps (the values NVIDIA's LAMB BERT recipe uses; the paper
re-warms phase 2, one schedule here), LAMB's bias-corrected moments and a linear decay from the
end of warmup. Expected SQuAD v1.1 F1 90.58 (the paper's Table 1). Target and preflight: TPU
v5p-512 (256 chips; the paper used 1,024 TPU v3 chips), `--config=...large.py:lamb
--target=v5p-512` (2026-11-27): fits, 64.97 GiB per chip in phase 1 and 89.99 GiB (95% of 95) in
phase 2; cost-model MFU 57.4% / 58.5% (estimates, fp32; benchmarks/RESULTS.md).
`large.py:runlocal` shrinks it as base.py's.
"""
from experiments.bert.configs import base


def get_config(arg: str = ""):
    c = base.get_config()
    c.model.preset = "bert_large"
    if arg == "runlocal":
        base.shrink(c)
    elif arg == "lamb":
        c.batch_size, c.phase2_batch_size = 65_536, 32_768
        c.num_train_steps, c.phase2_start_step = 8_599, 7_038
        c.optimizer.update(name="lamb", learning_rate=6e-3, warmup_steps=2_000, bias_correction=True,
                           schedule="linear")
        c.log_every, c.eval_every, c.checkpoint_every = 10, 500, 500
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; use 'runlocal', 'lamb' or nothing")
    return c
