"""Attention throughput and memory: pallas vs xla vs chunked vs cudnn.

    python -m benchmarks.attention            # full sweep (GPU/TPU): B*L = 16k tokens, N*H = 2048
    python -m benchmarks.attention --smoke    # CPU: tiny shapes, Pallas in interpret mode
    ... --plot attention.png                  # also draw TFLOP/s and peak memory against L

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


def tfm_forward(impl: str, causal: bool):
    """o = attention(q, k, v) with tfm's entry point; q, k, v, o [B, L, N, H]."""
    return lambda q, k, v: dot_product_attention(q, k, v, causal=causal, impl=impl)


def step_fn(forward, backward: bool, argnums: tuple = (0, 1, 2)):
    """jitted forward, or forward+backward (grads of sum(o) w.r.t. the arguments `argnums`: q, k, v
    [B, L, N, H] by default)."""
    if not backward:
        return jax.jit(forward)
    loss = lambda *args: forward(*args).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss, argnums=argnums))


def measure(impl: str, shape: Shape, backward: bool, dtype, iters: int):
    """(milliseconds per step, TFLOP/s, peak MiB) of tfm's `impl`, or raises on unsupported/OOM."""
    return measure_forward(tfm_forward(impl, shape.causal), shape, backward, dtype, iters)


def measure_forward(forward, shape: Shape, backward: bool, dtype, iters: int):
    """(milliseconds per step, TFLOP/s, peak MiB) of any JAX forward(q, k, v) on [B, L, N, H]."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (shape.B, shape.L, shape.N, shape.H), dtype) for key in keys)
    seconds, peak = time_step(forward, (q, k, v), backward, iters)
    return seconds * 1e3, flops(shape, backward) / seconds / 1e12, peak


def time_step(forward, args: tuple, backward: bool, iters: int, argnums: tuple = (0, 1, 2)):
    """(seconds per step, peak MiB or None) of `step_fn(forward, backward, argnums)` on `args`: the mean
    of `iters` calls after a warm-up; peak is XLA's compiled arguments + outputs + temporaries."""
    compiled = step_fn(forward, backward, argnums).lower(*args).compile()
    memory = compiled.memory_analysis()
    peak = None if memory is None else (memory.argument_size_in_bytes + memory.output_size_in_bytes
                                        + memory.temp_size_in_bytes) / 2**20
    jax.block_until_ready(compiled(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = compiled(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters, peak


def plot(rows: list[dict], path: str, title: str, value: str = "tflops", ylabel: str = "TFLOP/s",
         log_y: bool = False) -> None:
    """rows' `value` (TFLOP/s by default) and peak memory (where rows have it) against L: one panel pair
    per (pass, causal), a line per impl and H (rows with H None: a line per impl)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["pass"], r["causal"]) for r in rows})
    memory = any(r.get("peak") is not None for r in rows)
    fig, axes = plt.subplots(1 + memory, len(panels), figsize=(4.5 * len(panels), 3.5 * (1 + memory)), squeeze=False)
    for col, (pass_, causal) in enumerate(panels):
        for (impl, H) in sorted({(r["impl"], r["H"]) for r in rows}):
            line = sorted((r["L"], r[value], r["peak"]) for r in rows
                          if (r["impl"], r["H"], r["pass"], r["causal"]) == (impl, H, pass_, causal))
            if not line:
                continue
            L, values, peak = zip(*line)
            style = dict(marker="o", label=impl if H is None else f"{impl} H={H}",
                         linestyle="-" if H in (128, None) else "--")
            axes[0, col].plot(L, values, **style)
            if memory and None not in peak:
                axes[1, col].plot(L, peak, **style)
        axes[0, col].set_title(f"{pass_}, {'causal' if causal else 'bidirectional'}")
        axes[0, col].set_ylabel(ylabel)
        if log_y:
            axes[0, col].set_yscale("log")
        if memory:
            axes[1, col].set_ylabel("peak MiB")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length L")
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; Pallas interpreted on CPU")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    parser.add_argument("--iters", type=int, default=None, help="timed steps per point (default 10, smoke 2)")
    parser.add_argument("--plot", default=None, help="write a PNG of TFLOP/s and peak memory against L")
    args = parser.parse_args(argv)
    iters = args.iters or (2 if args.smoke else 10)
    impls = args.impls.split(",")
    device = jax.devices()[0]
    header = (f"attention benchmark  {datetime.date.today()}  jax {jax.__version__}  device: {device.device_kind}"
              f" ({jax.default_backend()})  dtype bf16  iters {iters}"
              + ("  SMOKE: interpret mode, no meaning for speed" if args.smoke else ""))
    print("# " + header)
    rows = []
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
                rows.append(dict(impl=impl, H=shape.H, L=shape.L, causal=shape.causal, tflops=tflops, peak=peak,
                                 **{"pass": "fwd+bwd" if backward else "fwd"}))
    if args.plot:
        plot(rows, args.plot, header)


if __name__ == "__main__":
    main()
