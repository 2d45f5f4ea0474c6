"""Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA) at ~160M on lm1b.

Command:   python -m experiments.lm.train --config=experiments/lm/configs/llama.py \
               --workdir=gs://BUCKET/lm/llama                (append :runlocal for CPU)
Hardware:  TPU v4-32 or 8x H100; FSDP x tensor parallel.
Runtime:   not yet measured on this codebase.
Expected:  lm1b validation loss below the GPT-2-small config at equal tokens (Llama
           architecture changes); not yet reproduced here.
"""
from experiments.lm.configs import gpt2_small, tiny


def get_config(arg: str = ""):
    c = gpt2_small.get_config()
    c.model = "llama"
    c.model_overrides.update(d_model=768, num_layers=12, num_heads=12, num_kv_heads=4,
                             d_ff=2048, vocab_size=32_000, max_len=1024)
    c.mesh.fsdp, c.mesh.tensor = -1, 2
    c.parallelism = "fsdp+tensor"
    if arg == "runlocal":
        c.update(tiny.get_config())
        c.model = "tiny:llama"
        c.model_overrides = type(c.model_overrides)()
        c.num_train_steps = 20
    return c
