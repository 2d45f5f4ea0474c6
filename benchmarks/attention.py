"""Attention throughput and memory: pallas vs xla vs chunked vs cudnn.

    python -m benchmarks.attention            # full sweep (GPU/TPU): B*L = 16k tokens, N*H = 2048
    python -m benchmarks.attention --smoke    # CPU: tiny shapes, Pallas in interpret mode

TFLOP/s follow the FlashAttention-2 convention: forward 4*B*L*L*N*H, halved when causal;
backward 2.5x forward, so forward+backward counts 3.5x. Peak memory is XLA's compiled
estimate for the whole step (arguments + outputs + temporaries).
"""
from __future__ import annotations

import argparse
import datetime
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tfm.ops.attention import dot_product_attention

IMPLS = ("pallas", "xla", "chunked", "cudnn")


class Shape(NamedTuple):
    B: int
    L: int
    N: int
    H: int
    causal: bool


def sweep(smoke: bool) -> list[Shape]:
    """The shape grid: full (B*L = 16k, N*H = 2048) or smoke (B*L = 512, N*H = 128)."""
    tokens, width = (512, 128) if smoke else (16384, 2048)
    heads = (64,) if smoke else (64, 128)
    lengths = (128, 256) if smoke else (512, 1024, 2048, 4096, 8192, 16384)
    return [Shape(tokens // L, L, width // H, H, causal)
            for H in heads for L in lengths for causal in (False, True)]


def flops(shape: Shape, backward: bool) -> float:
    forward = 4 * shape.B * shape.L * shape.L * shape.N * shape.H / (2 if shape.causal else 1)
    return forward * (3.5 if backward else 1.0)


def step_fn(impl: str, shape: Shape, backward: bool):
    """jitted forward, or forward+backward (grads of sum(o)), for q, k, v [B, L, N, H]."""
    def forward(q, k, v):
        return dot_product_attention(q, k, v, causal=shape.causal, impl=impl)

    if not backward:
        return jax.jit(forward)
    loss = lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def measure(impl: str, shape: Shape, backward: bool, dtype, iters: int):
    """(milliseconds per step, TFLOP/s, peak MiB) or raises on unsupported/OOM."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (shape.B, shape.L, shape.N, shape.H), dtype) for key in keys)
    compiled = step_fn(impl, shape, backward).lower(q, k, v).compile()
    memory = compiled.memory_analysis()
    peak = None if memory is None else (memory.argument_size_in_bytes + memory.output_size_in_bytes
                                        + memory.temp_size_in_bytes) / 2**20
    jax.block_until_ready(compiled(q, k, v))
    start = time.perf_counter()
    for _ in range(iters):
        out = compiled(q, k, v)
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - start) / iters
    return seconds * 1e3, flops(shape, backward) / seconds / 1e12, peak


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; Pallas interpreted on CPU")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    parser.add_argument("--iters", type=int, default=None, help="timed steps per point (default 10, smoke 2)")
    args = parser.parse_args(argv)
    iters = args.iters or (2 if args.smoke else 10)
    impls = args.impls.split(",")
    device = jax.devices()[0]
    print(f"# attention benchmark  {datetime.date.today()}  jax {jax.__version__}  device: {device.device_kind}"
          f" ({jax.default_backend()})  dtype bf16  iters {iters}" + ("  SMOKE: interpret mode, no meaning for speed" if args.smoke else ""))
    print(f"{'impl':8} {'pass':8} {'H':>4} {'L':>6} {'B':>4} {'N':>4} {'causal':>6} {'ms':>10} {'TFLOP/s':>9} {'peak MiB':>9}")
    for shape in sweep(args.smoke):
        for backward in (False, True):
            for impl in impls:
                label = f"{impl:8} {'fwd+bwd' if backward else 'fwd':8} {shape.H:4d} {shape.L:6d} {shape.B:4d} {shape.N:4d} {str(shape.causal):>6}"
                try:
                    ms, tflops, peak = measure(impl, shape, backward, jnp.bfloat16, iters)
                except Exception as e:  # unsupported backend or out of memory: report and go on
                    print(f"{label} {'-':>10} {'-':>9} {'-':>9}  ({type(e).__name__}: {str(e).splitlines()[0][:80]})")
                    continue
                peak_text = "n/a" if peak is None else f"{peak:.1f}"
                print(f"{label} {ms:10.2f} {tflops:9.3f} {peak_text:>9}", flush=True)


if __name__ == "__main__":
    main()
