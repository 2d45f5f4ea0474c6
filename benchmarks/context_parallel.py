"""Context parallelism: compiled per-device memory of attention forward+backward against L.

    python -m benchmarks.context_parallel                 # the table (compile only, any CPU)
    ... --plot benchmarks/context_parallel.png            # and the plot
    ... --blocks-on v5p-8 --lengths 8192,32768,131072     # the ring's blocks: chunked vs Pallas

Compiles (never runs) grads of sum(o * ct) for causal q, k, v [1, L, N, H] on simulated CPU
devices and reads XLA's per-device memory (`memory_analysis()`: temporaries; arguments and
outputs are the device's own q, k, v, ct shards and dq, dk, dv). Rows:

  ring / all_gather, L / c fixed   c = L / per_device devices: the ring's memory stays flat, the
                                   all-gather's grows with L (every device holds all of K/V).
  ring / all_gather, c = 8         eight devices, L growing: memory grows with L / 8.
  one device (chunked / xla)       the whole sequence on one device: chunked grows with L, xla
                                   (materialised scores) with L^2.

With --blocks-on TARGET instead: the ring over TARGET's chips (compile-only devices, `tfm.preflight`),
bf16, its blocks computed by the chunked backend or by the Pallas flash kernels (impl="pallas").
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from tfm.ops.attention import dot_product_attention  # noqa: E402
from tfm.parallel import MeshConfig, flax_rules, make_mesh, make_rules  # noqa: E402
from tfm.preflight.targets import parse_target, use_plugins  # noqa: E402

use_plugins()  # the compile-only TPU/GPU compilers of --blocks-on, before JAX starts its backends

N, H, CHUNK = 4, 64, 512
MiB = 2 ** 20


def compiled_memory(L: int, devices: int, strategy: str = "ring", impl: str = "chunked", *, device_list=None,
                    dtype=jnp.float32):
    """(temp, arguments + outputs) bytes per device of the compiled fwd+bwd; devices=1: no mesh.
    device_list: the devices (default: the simulated CPU ones)."""
    def loss(q, k, v, ct):
        o = dot_product_attention(q, k, v, causal=True, impl=impl, chunk_size=CHUNK, context_strategy=strategy)
        return jnp.sum(o.astype(jnp.float32) * ct)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    shape = (1, L, N, H)
    if devices == 1:
        args = [jax.ShapeDtypeStruct(shape, dtype)] * 3 + [jax.ShapeDtypeStruct(shape, jnp.float32)]
        compiled = step.lower(*args).compile()
    else:
        mesh = make_mesh(MeshConfig(data=1, context=devices), (device_list or jax.devices())[:devices])
        sharding = NamedSharding(mesh, P(None, "context"))
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)] * 3
        args.append(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding))
        with jax.set_mesh(mesh), nn.logical_axis_rules(flax_rules(make_rules("context", activations=True))):
            compiled = step.lower(*args).compile()
    m = compiled.memory_analysis()
    return m.temp_size_in_bytes, m.argument_size_in_bytes + m.output_size_in_bytes


def table(lengths, per_device: int, xla_up_to: int):
    rows = []  # (series, L, devices, temp, io)
    for L in lengths:
        done = len(rows)
        for strategy in ("ring", "all_gather"):
            c = L // per_device
            rows.append((f"{strategy}, L/c = {per_device}", L, c, *compiled_memory(L, c, strategy)))
            rows.append((f"{strategy}, c = 8", L, 8, *compiled_memory(L, 8, strategy)))
        rows.append(("one device, chunked", L, 1, *compiled_memory(L, 1, impl="chunked")))
        if L <= xla_up_to:
            rows.append(("one device, xla", L, 1, *compiled_memory(L, 1, impl="xla")))
        print(*(f"{r[0]:28s} L={r[1]:7d} c={r[2]:3d} temp {r[3] / MiB:9.1f} MiB  args+out {r[4] / MiB:8.1f} MiB"
                for r in rows[done:]), sep="\n", flush=True)
    return rows


def block_rows(lengths, target: str):
    """The ring over every chip of `target` (bf16), chunked against Pallas blocks."""
    devices = parse_target(target).devices()
    rows = []
    for L in lengths:
        for impl in ("chunked", "pallas"):
            rows.append((f"ring on {target}, {impl} blocks", L, len(devices),
                         *compiled_memory(L, len(devices), "ring", impl, device_list=devices, dtype=jnp.bfloat16)))
            r = rows[-1]
            print(f"{r[0]:36s} L={r[1]:7d} c={r[2]:3d} temp {r[3] / MiB:9.1f} MiB  args+out {r[4] / MiB:8.1f} MiB",
                  flush=True)
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for series in dict.fromkeys(r[0] for r in rows):
        pts = [(r[1], r[3] / MiB) for r in rows if r[0] == series]
        ax.plot(*zip(*pts), marker="o", label=series)
    ax.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="temp memory per device (MiB)",
           title=f"causal attention fwd+bwd, N={N}, H={H}, fp32 (compiled)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,16384,32768,65536,131072")
    parser.add_argument("--per-device", type=int, default=2048, help="L / c of the fixed-share rows")
    parser.add_argument("--xla-up-to", type=int, default=32768, help="longest L of the one-device xla row")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--blocks-on", default=None, help="a compile-only target (e.g. v5p-8): the ring's "
                        "memory there with chunked and with Pallas blocks, instead of the table above")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.blocks_on:
        print(f"# {datetime.date.today()} jax {jax.__version__}, compile-only {args.blocks_on}; N={N} H={H} "
              f"chunk={CHUNK} bf16, causal")
        rows = block_rows(lengths, args.blocks_on)
    else:
        print(f"# {datetime.date.today()} jax {jax.__version__}, {jax.devices()[0].platform}, "
              f"{len(jax.devices())} simulated devices; N={N} H={H} chunk={CHUNK} fp32, causal")
        rows = table(lengths, args.per_device, args.xla_up_to)
    print("\n| series | L | devices | temp / device (MiB) | args + outputs / device (MiB) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3] / MiB:.1f} | {r[4] / MiB:.1f} |")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
