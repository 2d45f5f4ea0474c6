"""Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA) at ~160M on lm1b.

Command:   python -m experiments.lm.train --config=experiments/lm/configs/llama.py \
               --workdir=/gcs/BUCKET/lm/llama                (append :runlocal for CPU)
Hardware:  TPU v4-32 or 8x H100; FSDP x tensor parallel.
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
