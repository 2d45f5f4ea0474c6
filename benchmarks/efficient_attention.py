"""Compiled memory of one encoder layer's forward + backward against sequence length: full
attention (the xla reference and the flash kernels) against Linformer's length projection, with the
low-rank value projection's parameter saving beside them.

XLA's memory_analysis() of the compiled step (temporaries, per device) is a property of the
program, not of the machine, so the figures are exact on any CPU; no time is measured.

    python -m benchmarks.efficient_attention [--lengths 1024,2048,4096,8192] [--projected 256]
"""
from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfm.models import EncoderModel, presets

WIDTH = dict(d_model=768, num_heads=12, d_ff=3072, num_layers=1)  # one BERT-base layer


def temp_gib(cfg, length: int, batch: int) -> float:
    model = EncoderModel(cfg)
    x = jnp.ones((batch, length), jnp.int32)
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), x)["params"]))
    loss = lambda p: jnp.sum(model.apply({"params": p}, x).hidden.astype(jnp.float32) ** 2)
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**30


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--projected", type=int, default=256, help="Linformer's projected length P")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    print(f"jax {jax.__version__}; one BERT-base-width encoder layer, batch {args.batch}, bf16, forward + backward; "
          f"XLA temporaries in GiB")
    print(f"| L | full (xla) | full (chunked) | Linformer P={args.projected} | full / Linformer |")
    print("|---|---|---|---|---|")
    for L in [int(v) for v in args.lengths.split(",")]:
        base = presets.tiny("encoder", **WIDTH, max_len=L, dtype="bfloat16")
        full = temp_gib(base, L, args.batch)
        kernels = temp_gib(base.replace(attention_impl="chunked"), L, args.batch)
        lin = temp_gib(base.replace(linformer_length=args.projected), L, args.batch)
        print(f"| {L} | {full:.3f} | {kernels:.3f} | {lin:.3f} | {full / lin:.1f}x |", flush=True)
    D, KH, r = WIDTH["d_model"], WIDTH["d_model"], 64
    print(f"\nvalue_rank={r} at D={D}: value weights per layer {D * KH:,} -> {r * (D + KH):,} "
          f"({r * (D + KH) / (D * KH):.1%})")


if __name__ == "__main__":
    main()
