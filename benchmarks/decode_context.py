"""Per-token decode cost against context length: a Llama, a Mamba-2 + attention hybrid (3 Mamba-2
layers to 1 attention layer, as Jamba / Nemotron-H / Qwen3-Next mix theirs), a Griffin-style hybrid (3
RG-LRU layers to 1 local-attention layer over a window, as RecurrentGemma mixes 2 to 1), a Mamba-2
model, and the hybrids of 2025-26 in their layouts: Kimi Linear's (3 KDA layers to 1 attention layer),
MiniMax's (3 lightning to 1), Falcon-H1's (attention and Mamba-2 side by side in every layer) and Zamba2's
(a shared attention block feeding every fourth Mamba-2 layer), all of the same width and depth, side by
side in one process.

One decoding step is `tfm.decode.step_fn` (jitted, the cache donated) on a cache of `context`
positions: an attention layer reads all of them (the step's keys are masked by position, so its cost
is the cache length), a local-attention layer its ring of `window` positions, a recurrent layer its
fixed-size state. Step time is the fastest of
--rounds interleaved calls (`benchmarks.train_step.interleaved`); cache bytes are the cache's arrays.
Random weights, fp32, batch 1.

    python -m benchmarks.decode_context [--contexts 1024,2048,...] [--plot benchmarks/decode_context.png]
    python -m benchmarks.decode_context --smoke    # tiny models, one short context: a check that it runs
"""
from __future__ import annotations

import argparse
import datetime
import platform

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.train_step import interleaved
from tfm import decode
from tfm.models import DecoderLM, presets

SIZES = {"full": dict(d_model=512, num_heads=8, num_kv_heads=8, num_layers=8, d_ff=1536, vocab=32_000,
                      mamba2=dict(state_size=64, head_dim=64, expand=2, groups=1), kda=dict(heads=8, head_dim=64),
                      window=2048),
         "smoke": dict(d_model=64, num_heads=4, num_kv_heads=4, num_layers=4, d_ff=128, vocab=256,
                       mamba2=dict(state_size=16, head_dim=16, expand=2, groups=1), kda=dict(heads=4, head_dim=16),
                       window=32)}
MIXERS = {"llama": None, "hybrid 3:1": ("mamba2", "mamba2", "mamba2", "attention"),
          "griffin 3:1": ("rglru", "rglru", "rglru", "attention"), "mamba2": ("mamba2",),
          "kimi linear 3:1": ("kda", "kda", "kda", "attention"),
          "minimax 3:1": ("lightning", "lightning", "lightning", "attention"),
          "falcon-h1": ("attention+mamba2",), "zamba2 3:1": ("mamba2", "mamba2", "mamba2", "shared>mamba2")}


def model_config(size: dict, mixers, context: int):
    """The Llama preset at `size`, its token mixers per `mixers` (None: attention everywhere; with RG-LRU layers
    the attention is local, over size["window"] tokens)."""
    extra = {} if mixers is None else dict(mixer_pattern=mixers, mamba2=size["mamba2"], kda=size["kda"])
    if mixers is not None and "rglru" in mixers:
        extra.update(sliding_window=size["window"])
    if mixers == ("mamba2",):
        extra.update(ffn_pattern=("none",), position="none")
    return presets.llama(size["vocab"], d_model=size["d_model"], num_heads=size["num_heads"],
                         num_kv_heads=size["num_kv_heads"], num_layers=size["num_layers"], d_ff=size["d_ff"],
                         max_len=context + 1, **extra)


def measure(cfg, context: int, rounds: int):
    """(seconds per decoding step at a cache of `context` positions, cache bytes, parameter count)."""
    model = DecoderLM(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    cache = decode.init_cache(model, params, 1, context)
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    # params as an argument, not closed over: as constants XLA would fold the weights into the program
    step = jax.jit(lambda params, cache, token: decode.step_fn(model, params)(cache, token), donate_argnums=1)
    token = jnp.ones((1, 1), jnp.int32)
    state = {"cache": cache}

    def call():
        logits, state["cache"] = step(params, state["cache"], token)
        logits.block_until_ready()
    call()  # compile
    return call, cache_bytes, count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--plot", default=None, help="write the step time against context to this PNG")
    p.add_argument("--smoke", action="store_true", help="tiny models, context 64, 2 rounds")
    args = p.parse_args(argv)
    size = SIZES["smoke" if args.smoke else "full"]
    contexts = [64] if args.smoke else [int(c) for c in args.contexts.split(",")]
    rounds = 2 if args.smoke else args.rounds
    print(f"# decode step vs context, batch 1, fp32; {datetime.date.today()}, jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}, {platform.processor() or platform.machine()}")
    print("| model | params | " + " | ".join(f"{c:,}" for c in contexts) + " | cache at the longest |")
    print("|---|---|" + "---|" * len(contexts) + "---|")
    rows = {}
    for context in contexts:
        calls = {name: measure(model_config(size, mixers, context), context, rounds) for name, mixers in MIXERS.items()}
        times = interleaved([c[0] for c in calls.values()], rounds)
        for (name, (_, cache_bytes, count)), seconds in zip(calls.items(), times):
            rows.setdefault(name, dict(count=count, times=[], cache=0))
            rows[name]["times"].append(seconds)
            rows[name]["cache"] = cache_bytes
        print(f"# context {context:,} done", flush=True)
    for name, row in rows.items():
        print(f"| {name} | {row['count'] / 1e6:.1f}M | " + " | ".join(f"{t * 1e3:.2f} ms" for t in row["times"]) +
              f" | {row['cache'] / 2 ** 20:.1f} MiB |")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, row in rows.items():
            ax.plot(contexts, [t * 1e3 for t in row["times"]], marker="o", label=f"{name} ({row['count'] / 1e6:.0f}M)")
        ax.set(xscale="log", yscale="log", xlabel="context (cached tokens)", ylabel="ms per decoded token",
               title=f"decode step, batch 1, fp32, {jax.devices()[0].device_kind}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"# plot: {args.plot}")


if __name__ == "__main__":
    main()
