"""Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA) at ~160M on lm1b.

Model: `llama` (position='rope', rope.theta=500000.0, activation='swiglu', num_layers=12, d_model=768,
  num_kv_heads=4)

Command:   python -m experiments.lm.train --config=experiments/lm/configs/llama.py \
               --workdir=/gcs/BUCKET/lm/llama                (append :runlocal for CPU)
Hardware:  TPU v4-32 or 8x H100; FSDP x tensor parallel. Preflight (2026-11-24, v4-32:
           fsdp 8 x tensor 2): fits, 3.23 GiB per chip of 32; no cost-model estimate on v4
           (XLA returns a negative time).
Runtime:   not yet measured on this codebase.
Expected:  lm1b validation loss below the GPT-2-small config at equal tokens (Llama
           architecture changes); not yet reproduced here.
"""
from experiments.lm.configs import gpt2_small


def get_config(arg: str = ""):
    c = gpt2_small.get_config()
    c.model.preset = "llama"
    c.model.overrides.update(d_model=768, num_layers=12, num_heads=12, num_kv_heads=4, d_ff=2048, max_len=1024)
    c.mesh.fsdp, c.mesh.tensor = -1, 2
    c.parallelism = "fsdp+tensor"
    if arg == "runlocal":
        gpt2_small.shrink(c)
        c.model.overrides.num_kv_heads = 2
        c.mesh.tensor = 1  # one CPU device
    return c
