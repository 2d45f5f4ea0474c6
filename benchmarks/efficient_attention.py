"""Compiled memory of one encoder layer's forward + backward against sequence length: full
attention (the xla reference and the flash kernels) against Linformer's length projection, with the
low-rank value projection's parameter saving beside them; and the share of (128 x 128) tiles the
flash kernels visit under each sparse pattern (tfm.kernels.sparsity), against full attention.

XLA's memory_analysis() of the compiled step (temporaries, per device) is a property of the
program, not of the machine, so the figures are exact on any CPU; the visited tiles are the kernels'
block lists (`flash_attention.visible_tiles`), exact too; no time is measured.

    python -m benchmarks.efficient_attention [--lengths 1024,2048,4096,8192] [--projected 256] [--no-memory]
"""
from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfm.kernels import flash_attention as fa
from tfm.models import EncoderModel, presets
from tfm.kernels import sparsity

WIDTH = dict(d_model=768, num_heads=12, d_ff=3072, num_layers=1)  # one BERT-base layer


def temp_gib(cfg, length: int, batch: int) -> float:
    model = EncoderModel(cfg)
    x = jnp.ones((batch, length), jnp.int32)
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), x)["params"]))
    loss = lambda p: jnp.sum(model.apply({"params": p}, x).hidden.astype(jnp.float32) ** 2)
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**30


TILE = 128
PATTERNS = {  # name -> (pattern, causal): the papers' settings at their block/stride of 128..1024
    "causal": (None, True),
    "strided 1024 (causal)": (sparsity.Strided(1024), True),
    "fixed 1024, c=32 (causal)": (sparsity.Fixed(1024, 32), True),
    "BigBird 128: w 1, g 2, r 3": (sparsity.BigBird(128, window=1, globals=2, random=3), False),
    "Longformer w 512, 128 global": (sparsity.Longformer(513, globals=128), False),
}


def _share(name: str, length: int) -> float:
    pattern, causal = PATTERNS[name]
    return fa.visited_share(length, causal=causal, sparsity=pattern, block=TILE)


def tile_table(lengths):
    names = list(PATTERNS)
    print(f"\nshare of {TILE}x{TILE} tiles the flash kernels visit (full attention = 100%)")
    print("| L | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for L in lengths:
        print(f"| {L} | " + " | ".join(f"{_share(n, L):.1%}" for n in names) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--projected", type=int, default=256, help="Linformer's projected length P")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true", help="only the visited-tiles table")
    parser.add_argument("--tile-lengths", default="4096,16384,65536")
    args = parser.parse_args()
    if args.no_memory:
        return tile_table([int(v) for v in args.tile_lengths.split(",")])
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
    tile_table([int(v) for v in args.tile_lengths.split(",")])


if __name__ == "__main__":
    main()
