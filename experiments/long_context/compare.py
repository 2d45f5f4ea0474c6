"""Every attention variant of configs/tiny.py trained on the same documents in one process, and
what each costs: held-out accuracy (near and far needles), parameters, XLA's compiled temporary
memory of a forward + backward pass against length, the share of the L x L attention scores the
flash kernels compute, and the step time as a ratio to full attention.

    python -m experiments.long_context.compare --workdir=/tmp/tfm_long \
        --plot experiments/long_context/comparison.png

Memory is `jax.jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes`, a property of
the program (exact on any machine), for one document (batch 1) at each length with the recipe's
attention_impl ("xla", which materialises the [N, L, L] scores and the mask) and, at the longest
length, with attention_impl="chunked" (blockwise, O(L)). Step times are medians of interleaved
calls of each variant's compiled forward + backward at the training batch and length, so every
variant sees the same load; only their ratio to full attention is reported. The share of scores is
exact: the (128 x 128) tiles the flash kernels visit under the variant's window or sparsity pattern
(`flash_attention.visited_share`; BigBird's 32-token blocks need 32-token tiles), and for Linformer
its projected length over L.
"""
from __future__ import annotations

import argparse
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure  # not pyplot: a notebook's inline backend stays as it is

from experiments import common
from experiments import compare as runs  # the Markdown table of experiments.compare
from experiments.long_context import documents, train
from experiments.long_context.configs import tiny
from experiments.long_context.settings import LongContextSettings
from tfm.kernels import flash_attention as fa
from tfm.models import EncoderModel
from tfm.kernels import sparsity
from tfm.train import ClassificationTask


def grad_fn(model):
    """(params, tokens [B, L], labels [B]) -> the gradient of the mean cross-entropy."""
    def loss(params, tokens, labels):
        logp = jax.nn.log_softmax(model.apply({"params": params}, tokens).logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], -1))
    return jax.grad(loss)


def compiled_step(cfg, batch: int, length: int):
    """The compiled forward + backward of an EncoderModel(cfg) on [batch, length] tokens."""
    model = EncoderModel(cfg.replace(max_len=max(cfg.max_len, length)))
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
    params = jax.eval_shape(lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, length),
                                                                                               jnp.int32))["params"]))
    return model, jax.jit(grad_fn(model)).lower(params, tokens, labels).compile()


def temp_mib(cfg, batch: int, length: int):
    """Compiled temporaries in MiB, or None where the variant rejects that attention_impl."""
    try:
        return compiled_step(cfg, batch, length)[1].memory_analysis().temp_size_in_bytes / 2**20
    except ValueError:
        return None


def step_time_ratios(cfgs: dict, batch: int, length: int, rounds: int) -> dict:
    """Median time of each variant's compiled step over interleaved rounds, divided by full's."""
    x = documents.batch(0, "test", range(batch), length)
    runs = {}
    for name, cfg in cfgs.items():
        model, step = compiled_step(cfg, batch, length)
        params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), x["input_ids"][:1])["params"])
        jax.block_until_ready(step(params, x["input_ids"], x["label"]))  # warm
        runs[name] = (step, params)
    times = {name: [] for name in cfgs}
    for _ in range(rounds):
        for name, (step, params) in runs.items():
            start = time.perf_counter()
            jax.block_until_ready(step(params, x["input_ids"], x["label"]))
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t) / np.median(times["full"])) for name, t in times.items()}


TILE = 128  # the flash kernels' default tile on TPU and (forward) GPU


def score_share(cfg, length: int) -> float:
    """The share of the [length, length] attention scores a layer computes with the flash kernels:
    the 128 x 128 tiles they visit (BigBird's own block when smaller: its tiles must divide it), or
    for Linformer the P projected keys of L."""
    if cfg.linformer_length is not None:
        return cfg.linformer_length / length
    pattern = cfg.attention_sparsity
    tile = min(TILE, pattern.block) if isinstance(pattern, sparsity.BigBird) else TILE
    return fa.visited_share(length, window=cfg.sliding_window, sparsity=pattern, block=tile)


def model_config(config):
    exp = common.resolve(config, LongContextSettings, ClassificationTask)
    return exp.model(documents.VOCAB_SIZE)


def _mib(x) -> str:
    return "n/a" if x is None else f"{x:,.1f}"


def table(rows: dict, lengths, near: int) -> str:
    long = lengths[-1]
    header = (["variant", "held-out acc.", f"needle <= {near}", f"needle > {near}", "parameters", "step time / full"]
              + [f"temp MiB L={L}" for L in lengths] + [f"temp MiB L={long} chunked", f"scores computed L={long}"])
    cells = [[f"`{name}`", f"{r['scores']['accuracy']:.1%}", train.percent(r["scores"]["near_accuracy"]),
              train.percent(r["scores"]["far_accuracy"]), f"{r['scores']['num_params']:,}", f"{r['time_ratio']:.2f}",
              *(_mib(r["memory"][L]) for L in lengths), _mib(r["chunked"]), f"{r['share'][long]:.1%}"]
             for name, r in rows.items()]
    return runs.table(header, cells)


def plot(path: str, rows: dict, lengths) -> None:
    """Left: held-out accuracy on far needles against memory at the longest length; middle: memory
    against length per variant (log-log); right: the share of the scores the flash kernels compute."""
    fig = Figure(figsize=(16, 4.2))
    ax_acc, ax_mem, ax_share = fig.subplots(1, 3)
    long = lengths[-1]
    points = {}  # variants at the same spot share one label
    for name, r in rows.items():
        spot = (float(np.round(np.log10(r["memory"][long]), 1)), round(r["scores"]["far_accuracy"], 2))
        points.setdefault(spot, []).append(name)
        ax_mem.plot(lengths, [r["memory"][L] for L in lengths], marker="o", label=name)
        ax_share.plot(lengths, [r["share"][L] for L in lengths], marker="o", label=name)
    for (_, acc), names in points.items():
        mem = rows[names[0]]["memory"][long]
        ax_acc.scatter(mem, acc, color="k")
        ax_acc.annotate(", ".join(names), (mem, acc), textcoords="offset points", xytext=(-4, 6), ha="right", fontsize=8)
    ax_acc.axhline(train.CHANCE, color="grey", ls="--", lw=1, label="chance")
    ax_acc.set(xscale="log", xlabel=f"compiled temp memory at L={long}, batch 1 (MiB, xla)",
               ylabel="held-out accuracy, needle beyond the window's reach", title="what it learns vs what it costs")
    ax_acc.legend(fontsize=8)
    ax_mem.set(xscale="log", yscale="log", xlabel="document length L", ylabel="compiled temp memory (MiB, xla)",
               title="forward + backward, batch 1")
    ax_mem.set_xticks(lengths, [str(L) for L in lengths])
    ax_mem.legend(fontsize=8)
    ax_share.set(xscale="log", yscale="log", xlabel="document length L", ylabel="share of the L x L scores computed",
                 title="flash kernels: 128 x 128 tiles visited")
    ax_share.set_xticks(lengths, [str(L) for L in lengths])
    ax_share.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="one sub-directory per variant's run")
    parser.add_argument("--variants", default=",".join(tiny.VARIANTS))
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192,16384", help="memory against these lengths")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved timing rounds")
    parser.add_argument("--plot", default=None, help="PNG path (default <workdir>/comparison.png)")
    args = parser.parse_args()
    names = args.variants.split(",")
    if "full" not in names:
        raise SystemExit("--variants must include full (the reference of the time ratios)")
    lengths = [int(v) for v in args.lengths.split(",")]
    configs = {name: tiny.get_config(name) for name in names}
    cfgs = {name: model_config(c) for name, c in configs.items()}
    rows = {}
    for name, config in configs.items():
        print(f"== {name}", flush=True)
        rows[name] = {"scores": train.train_and_evaluate(config, os.path.join(args.workdir, name)),
                      "memory": {L: temp_mib(cfgs[name], 1, L) for L in lengths},
                      "chunked": temp_mib(cfgs[name].replace(attention_impl="chunked"), 1, lengths[-1]),
                      "share": {L: score_share(cfgs[name], L) for L in lengths}}
    ratios = step_time_ratios(cfgs, configs["full"].batch_size, configs["full"].length, args.rounds)
    for name in rows:
        rows[name]["time_ratio"] = ratios[name]
    text = table(rows, lengths, configs["full"].near)
    print(f"\njax {jax.__version__}; {configs['full'].num_train_steps} steps of batch {configs['full'].batch_size}, "
          f"L={configs['full'].length}; step time: median of {args.rounds} interleaved rounds\n" + text)
    with open(os.path.join(args.workdir, "comparison.md"), "w") as f:
        f.write(text + "\n")
    plot(args.plot or os.path.join(args.workdir, "comparison.png"), rows, lengths)


if __name__ == "__main__":
    main()
