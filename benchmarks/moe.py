"""MoE layer memory and CPU step-time ratios: dropless by sorting (`moe_impl="ragged"`) against the
one-hot einsum dispatch, dropless (C = T) and with capacity_factor 1.25.

For each T (tokens, one batch row, so the einsum dispatch has one group of T) and E (experts), the
forward+backward of `MoeMlp` (gradients of <y, dy> + aux loss with respect to params and x) is
compiled and XLA's compiled memory is read: `memory_analysis()` temp + argument bytes, which is
deterministic. Where every variant's compiled total is under --time-below bytes, the three are also
timed side by side (interleaved, best of --rounds) and the ratios ragged/einsum are printed: these are
CPU ratios on shared, loaded cores, not speeds.

    python -m benchmarks.moe                      # T 1k..16k, E 8..64, D 128, F 256, k 2, fp32
    python -m benchmarks.moe --tokens 1024 --experts 8 --rounds 2   # a quick check
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.feedforward import MoeMlp

VARIANTS = {"ragged": dict(moe_impl="ragged"), "einsum_dropless": dict(moe_impl="einsum"),
            "einsum_cap1.25": dict(moe_impl="einsum", capacity_factor=1.25)}


def layer_config(E: int, args, **variant) -> ModelConfig:
    return ModelConfig(vocab_size=8, d_model=args.d_model, num_heads=1, num_layers=1, d_ff=args.d_ff,
                       activation="swiglu", ffn_bias=False, num_experts=E, experts_per_token=args.k, **variant)


def train_step(cfg: ModelConfig):
    """(params, x, dy) -> gradients of <MoeMlp(x), dy> + aux loss with respect to params and x."""
    def loss(params, x, dy):
        y, sown = MoeMlp(cfg).apply({"params": params}, x, mutable=["losses"])
        return jnp.sum(y * dy) + sown["losses"]["moe_aux_loss"][0]
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def case(T: int, E: int, args):
    """{variant: (compiled, memory bytes, compile seconds)} for one (T, E); inputs for timing."""
    x = jax.random.normal(jax.random.PRNGKey(0), (1, T, args.d_model))
    params = nn.meta.unbox(MoeMlp(layer_config(E, args)).init(jax.random.PRNGKey(1), x[:, :8])["params"])
    out = {}
    for name, variant in VARIANTS.items():
        start = time.perf_counter()
        compiled = train_step(layer_config(E, args, **variant)).lower(params, x, x).compile()
        mem = compiled.memory_analysis()
        out[name] = (compiled, mem.temp_size_in_bytes + mem.argument_size_in_bytes, time.perf_counter() - start)
    return out, (params, x, x)


def best_times(compiled: dict, inputs, rounds: int) -> dict:
    """Best wall time of each compiled step over `rounds` interleaved passes (after one warm-up)."""
    for fn in compiled.values():
        jax.block_until_ready(fn(*inputs))
    best = {name: float("inf") for name in compiled}
    for _ in range(rounds):
        for name, fn in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*inputs))
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    p.add_argument("--experts", default="8,16,32,64")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--d-ff", type=int, default=256)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--time-below", type=float, default=2 ** 30, help="time a case only if every variant fits")
    p.add_argument("--max-compile", type=float, default=120.0,
                   help="skip larger T at this E once a compile took longer (seconds)")
    args = p.parse_args()
    print(f"# {datetime.date.today()} {platform.node()} {jax.devices()[0].device_kind} jax {jax.__version__}; "
          f"D {args.d_model} F {args.d_ff} k {args.k} fp32, one batch row of T tokens")
    print("| E | T | ragged MiB | einsum dropless MiB | einsum cap 1.25 MiB | ragged / T (KiB per token) "
          "| time ragged/dropless | time ragged/cap1.25 | compile s (r, d, c) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for E in map(int, args.experts.split(",")):
        for T in map(int, args.tokens.split(",")):
            cases, inputs = case(T, E, args)
            mib = {n: c[1] / 2 ** 20 for n, c in cases.items()}
            ratios = ["", ""]
            if max(c[1] for c in cases.values()) < args.time_below:
                t = best_times({n: c[0] for n, c in cases.items()}, inputs, args.rounds)
                ratios = [f"{t['ragged'] / t['einsum_dropless']:.2f}", f"{t['ragged'] / t['einsum_cap1.25']:.2f}"]
            compile_times = [c[2] for c in cases.values()]
            compile_s = ", ".join(f"{c:.1f}" for c in compile_times)
            print(f"| {E} | {T} | {mib['ragged']:.1f} | {mib['einsum_dropless']:.1f} | {mib['einsum_cap1.25']:.1f} "
                  f"| {cases['ragged'][1] / T / 1024:.2f} | {ratios[0]} | {ratios[1]} | {compile_s} |", flush=True)
            del cases
            if max(compile_times) > args.max_compile:
                print(f"| {E} | > {T} | skipped: a compile at T {T} took over {args.max_compile:.0f} s |")
                break


if __name__ == "__main__":
    main()
