"""Token mixers side by side on two generated causal recall tasks (experiments/long_context/recall.py):
what each learns (multi-query associative recall by number of pairs, a needle asked at the end by its
distance) and what it costs (XLA's compiled temporaries against length, step time against full
attention).

    python -m experiments.long_context.mixers --out /tmp/tfm_mixers \
        --plot experiments/long_context/mixers.png
    python -m experiments.long_context.mixers --out /tmp/tfm_mixers_smoke --smoke   # a check that it runs

Every variant is a dict of ModelConfig overrides (VARIANTS) over one Llama-style decoder (BASE: D 64,
4 layers, 4 heads, SwiGLU F 128, RoPE, untied): only the token mixer changes, every layer keeps its
feed-forward. Each variant is trained on each task from the same initial seed on the same rows by
tfm's Trainer (AdamW, warmup and cosine), then scored on held-out rows; accuracy counts the answer
tokens only (LMTask's weights). Memory is `.lower(...).compile().memory_analysis().temp_size_in_bytes`
of the Trainer's step (forward, backward, AdamW) at batch 1 for each length, compile only, with
attention_impl "xla" (the [N, L, L] scores) and, for variants with attention layers, "chunked" at the
longest length; the recurrent mixers run their chunked forms (mixer_impl "auto"). Step time: the
fastest of interleaved calls of each variant's compiled train step at each task's training shape
(`benchmarks.train_step.interleaved`), as a ratio to full attention's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import numpy as np
from matplotlib.figure import Figure  # not pyplot: a notebook's inline backend stays as it is

from benchmarks.train_step import interleaved
from experiments.long_context import documents, recall
from tfm.models import DecoderLM, presets
from tfm.parallel import MeshConfig, make_mesh
from tfm.train import LMTask, OptimizerConfig, TrainConfig, Trainer

WINDOW = 32
BASE = dict(d_model=64, num_layers=4, num_heads=4, num_kv_heads=4, d_ff=128, dropout_rate=0.0, attention_dropout=0.0)
# The recurrent mixers sized to about attention's 4 D^2 = 16,384 parameters per layer (the counts are printed):
# Mamba-2 at expand 1 (E = D = 64 channels in 4 heads of 16, state 32: 17,356), gated DeltaNet as
# Qwen3-Next's shape shrunk (2 query/key heads of 16 serving 4 value heads of 16: 17,432).
# The 2025-26 mixers likewise: KDA in 3 heads of 16 (16,707), lightning attention in 4 heads of 14 (17,980), the
# mLSTM in 4 heads (16,968); top-k sparse attention is DeepSeek-V3.2's indexer (4 index heads of 16) choosing
# WINDOW keys per query over latent attention (latents 24, heads 16 + 8 rotated, values 16: 15,952), trained on
# its KL loss beside the LM loss (LMTask.indexer_loss_weight 1).
MAMBA2 = dict(state_size=32, head_dim=16, expand=1, groups=1)
DELTANET = dict(key_heads=2, value_heads=4, key_head_dim=16, value_head_dim=16)
VARIANTS = {
    "full": {},
    "window": dict(sliding_window=WINDOW),
    "mamba2": dict(mixer_pattern=("mamba2",), mamba2=MAMBA2),
    "gated_deltanet": dict(mixer_pattern=("gated_deltanet",), deltanet=DELTANET),
    "hybrid": dict(mixer_pattern=("mamba2", "mamba2", "mamba2", "attention"), mamba2=MAMBA2),
    "kda": dict(mixer_pattern=("kda",), kda=dict(heads=3, head_dim=16)),
    "lightning": dict(mixer_pattern=("lightning",), head_dim=14),
    "mlstm": dict(mixer_pattern=("mlstm",), mlstm=dict(heads=4)),
    "top_k": dict(head_dim=24, mla=dict(kv_rank=24, q_rank=24, rope_dim=8, value_dim=16),
                  indexer=dict(heads=4, head_dim=16, top_k=WINDOW)),
}


@dataclasses.dataclass(frozen=True)
class TaskSize:
    length: int  # tokens per row
    steps: int   # training steps
    batch: int   # rows per step


@dataclasses.dataclass(frozen=True)
class Settings:
    """The comparison's sizes, for about 15 minutes on 2 CPU cores. MQAR rows are short, so it gets
    more steps (the key-value binding is learned late); needle rows are long enough to put needles
    beyond the window's reach (n (w - 1) = 124)."""
    mqar: TaskSize = TaskSize(length=64, steps=600, batch=32)
    needle: TaskSize = TaskSize(length=192, steps=200, batch=16)
    pairs: tuple = (2, 4, 8, 16)       # MQAR: trained on rows cycling through these, scored per value
    num_layers: int = BASE["num_layers"]
    eval_rows: int = 128               # held-out rows per number of pairs and per needle distance bucket
    learning_rate: float = 3e-3
    warmup_steps: int = 30             # at most a tenth of a task's steps
    weight_decay: float = 0.01
    memory_lengths: tuple = (1024, 4096, 16384)
    rounds: int = 10                   # interleaved timing rounds
    log_every: int = 100
    seed: int = 0


# --smoke: 2 layers (the hybrid's are two Mamba-2 layers then); batch 1, both tasks and the memory at one
# size, so that they share one compiled step (a hit in JAX's persistent compilation cache where one is
# set, as in the tests)
SMOKE = Settings(mqar=TaskSize(32, 3, 1), needle=TaskSize(32, 3, 1), pairs=(2, 4, 8), num_layers=2, eval_rows=2,
                 memory_lengths=(32,), rounds=2, log_every=1)


def model_config(variant: str, max_len: int, num_layers: int = BASE["num_layers"]):
    """The Llama-style base with `variant`'s overrides."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} unknown; choose from {sorted(VARIANTS)}")
    return presets.llama(recall.VOCAB_SIZE, **{**BASE, "num_layers": num_layers}, max_len=max_len).replace(
        **VARIANTS[variant])


def has_attention(cfg) -> bool:
    return "attention" in (cfg.mixer_pattern or ("attention",))


def make_trainer(cfg, s: Settings, size: TaskSize) -> Trainer:
    """tfm's Trainer for DecoderLM(cfg) on one CPU device, set up for [size.batch, size.length] batches
    and a schedule of size.steps."""
    optimizer = OptimizerConfig(name="adamw", learning_rate=s.learning_rate, schedule="cosine",
                                warmup_steps=min(s.warmup_steps, size.steps // 10), weight_decay=s.weight_decay)
    mesh = MeshConfig(data=1)
    config = TrainConfig(num_train_steps=size.steps, batch_size=size.batch, seed=s.seed, mesh=mesh,
                         optimizer=optimizer)
    shape = (size.batch, size.length)
    example = {"inputs": np.zeros(shape, np.int32), "targets": np.zeros(shape, np.int32),
               "weights": np.zeros(shape, np.float32)}
    task = LMTask(indexer_loss_weight=1.0 if cfg.indexer is not None else 0.0)
    return Trainer(DecoderLM(cfg), task, config, make_mesh(mesh, jax.devices()[:1])).setup(example)


def train_rows(task: str, s: Settings, step: int) -> list:
    """Training step `step`'s rows: MQAR cycling through s.pairs, needles at any distance."""
    size = getattr(s, task)
    indices, length = range(step * size.batch, (step + 1) * size.batch), size.length
    if task == "mqar":
        return [recall.mqar(s.seed, "train", i, length, s.pairs[i % len(s.pairs)]) for i in indices]
    return [recall.needle(s.seed, "train", i, length, range(1, length - 1)) for i in indices]


def held_out(task: str, s: Settings) -> dict:
    """{group label: its held-out rows}: MQAR per number of pairs, needles per distance bucket."""
    length = getattr(s, task).length
    if task == "mqar":
        return {n: [recall.mqar(s.seed, "test", i, length, n) for i in range(s.eval_rows)] for n in s.pairs}
    buckets = recall.distance_buckets(length, s.num_layers, WINDOW)
    return {label: [recall.needle(s.seed, "test", i, length, r) for i in range(s.eval_rows)]
            for label, r in buckets.items()}


def train_and_score(trainer: Trainer, task: str, s: Settings, log) -> tuple:
    """A fresh state trained on `task`, then its answer accuracy per held-out group.
    Returns (the trained state, {group: accuracy})."""
    size = getattr(s, task)
    state, start = trainer.init_state(), time.perf_counter()
    for step in range(size.steps):
        state, metrics = trainer.train_step(state, trainer.global_batch(recall.batch(train_rows(task, s, step))))
        if (step + 1) % s.log_every == 0 or step + 1 == size.steps:
            log(f"  {task} step {step + 1}/{size.steps}: loss {float(metrics['loss']):.3f}, "
                f"answer accuracy {float(metrics['accuracy']):.1%} ({time.perf_counter() - start:.0f} s)")
    scores = {}
    for group, rows in held_out(task, s).items():
        batches = [recall.batch(rows[i:i + size.batch]) for i in range(0, len(rows), size.batch)]
        scores[group] = trainer.evaluate(state.params, batches)["accuracy"]
    log(f"  {task} held-out: " + ", ".join(f"{g}: {a:.1%}" for g, a in scores.items()))
    return state, scores


def temp_mib(cfg, s: Settings, length: int) -> float:
    """XLA's compiled temporaries (MiB) of the Trainer's step on one row of `length` tokens."""
    size = TaskSize(length, s.needle.steps, 1)
    trainer = make_trainer(cfg.replace(max_len=max(cfg.max_len, length)), s, size)
    spec = lambda dtype: jax.ShapeDtypeStruct((1, length), dtype, sharding=trainer.batch_sharding)
    batch = {"inputs": spec(np.int32), "targets": spec(np.int32), "weights": spec(np.float32)}
    with trainer.context():
        compiled = trainer.jitted_train_step.lower(trainer.abstract_state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def _print(line: str) -> None:
    print(line, flush=True)


def run(variants, s: Settings, log=_print) -> dict:
    """Train and score every variant on both tasks, then measure its memory and step times.
    Returns {variant: {"params", "mqar", "needle", "memory": {L: MiB}, "chunked", "time_ratio": {task: x}}}."""
    if "full" not in variants:
        raise ValueError(f"variants {list(variants)} must include 'full' (the reference of the time ratios)")
    rows, steppers = {}, {task: {} for task in recall.TASKS}
    for name in variants:
        cfg = model_config(name, max(getattr(s, task).length for task in recall.TASKS), s.num_layers)
        sizes = {task: getattr(s, task) for task in recall.TASKS}
        # one Trainer per distinct size: the tasks share one where their sizes agree (--smoke)
        trainers = {size: make_trainer(cfg, s, size) for size in dict.fromkeys(sizes.values())}
        row = rows[name] = {"params": next(iter(trainers.values())).num_params}
        log(f"== {name}: {row['params']:,} parameters")
        for task, size in sizes.items():
            state, row[task] = train_and_score(trainers[size], task, s, log)
            steppers[task][name] = _stepper(trainers[size], state, recall.batch(train_rows(task, s, 0)))
        row["memory"] = {L: temp_mib(cfg, s, L) for L in s.memory_lengths}
        long = s.memory_lengths[-1]
        chunked = has_attention(cfg) and cfg.indexer is None  # sparse attention is masked dense attention ("xla")
        row["chunked"] = temp_mib(cfg.replace(attention_impl="chunked"), s, long) if chunked else None
        log("  temp MiB: " + ", ".join(f"L={L}: {m:,.1f}" for L, m in row["memory"].items())
            + ("" if row["chunked"] is None else f", L={long} chunked: {row['chunked']:,.1f}"))
    for task, calls in steppers.items():
        seconds = dict(zip(calls, interleaved(list(calls.values()), s.rounds)))
        for name in rows:
            rows[name].setdefault("time_ratio", {})[task] = seconds[name] / seconds["full"]
        size = getattr(s, task)
        log(f"{task} step time, {size.batch} x {size.length} (fastest of {s.rounds} interleaved "
            "rounds): " + ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in seconds.items()))
    return rows


def _stepper(trainer: Trainer, state, batch: dict):
    """A call that runs one more train step (the state is donated, so it carries the new one)."""
    held, batch = [state], trainer.global_batch(batch)

    def step():
        held[0], metrics = trainer.train_step(held[0], batch)
        jax.block_until_ready(metrics)
    step()  # compiled already; one warm call
    return step


def _mib(x) -> str:
    return "n/a" if x is None else f"{x:,.1f}"


def table(rows: dict, s: Settings) -> str:
    """The markdown table: parameters, MQAR accuracy per pairs, needle accuracy per distance, memory, time."""
    first = next(iter(rows.values()))
    long = s.memory_lengths[-1]
    heads = (["variant", "params", "params / full"] + [f"MQAR n={n}" for n in first["mqar"]]
             + [f"needle d {d}" for d in first["needle"]] + [f"temp MiB L={L}" for L in s.memory_lengths]
             + [f"temp MiB L={long} chunked"] + [f"step time / full, {task} shape" for task in recall.TASKS])
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    full = rows["full"]["params"]
    for name, r in rows.items():
        cells = ([f"`{name}`", f"{r['params']:,}", f"{r['params'] / full:.2f}"]
                 + [f"{a:.1%}" for a in r["mqar"].values()] + [f"{a:.1%}" for a in r["needle"].values()]
                 + [_mib(r["memory"][L]) for L in s.memory_lengths] + [_mib(r["chunked"])]
                 + [f"{r['time_ratio'][task]:.2f}" for task in recall.TASKS])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: str, rows: dict, s: Settings) -> None:
    """Left: MQAR accuracy against the number of pairs; middle: needle accuracy per distance bucket;
    right: compiled temporaries against length (log-log)."""
    fig = Figure(figsize=(16, 4.2))
    ax_mqar, ax_needle, ax_mem = fig.subplots(1, 3)
    for name, r in rows.items():
        ax_mqar.plot(list(r["mqar"]), list(r["mqar"].values()), marker="o", label=name)
        ax_needle.plot(range(len(r["needle"])), list(r["needle"].values()), marker="o", label=name)
        ax_mem.plot(s.memory_lengths, [r["memory"][L] for L in s.memory_lengths], marker="o", label=name)
    pairs = list(next(iter(rows.values()))["mqar"])
    ax_mqar.set(xscale="log", xlabel="key-value pairs in the row", ylabel="held-out answer accuracy", ylim=(0, 1.02),
                title=f"multi-query associative recall, L={s.mqar.length}")
    ax_mqar.set_xticks(pairs, [str(n) for n in pairs])
    buckets = list(next(iter(rows.values()))["needle"])
    ax_needle.axhline(1 / len(recall.VALUES), color="grey", ls="--", lw=1, label="chance")
    ax_needle.set(xlabel="needle's distance from the question (tokens)", ylabel="held-out answer accuracy",
                  ylim=(0, 1.02), title=f"needle asked at the end, L={s.needle.length} (window reach "
                                        f"{documents.reach(s.num_layers, WINDOW)})")
    ax_needle.set_xticks(range(len(buckets)), buckets)
    ax_mem.set(xscale="log", yscale="log", xlabel="length L", ylabel="compiled temp memory (MiB)",
               title="train step, batch 1 (attention 'xla')")
    ax_mem.set_xticks(s.memory_lengths, [str(L) for L in s.memory_lengths])
    for ax in (ax_mqar, ax_needle, ax_mem):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for mixers.md, mixers.json and (default) mixers.png")
    parser.add_argument("--steps", type=int, default=None, help="training steps of every variant on both tasks "
                        f"(default {Settings.mqar.steps} on MQAR, {Settings.needle.steps} on the needles)")
    for task in recall.TASKS:
        parser.add_argument(f"--{task}-steps", type=int, default=None, help=f"training steps on {task} alone")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--plot", default=None, help="PNG path (default <out>/mixers.png)")
    parser.add_argument("--smoke", action="store_true", help="a few steps at tiny lengths: a check that it runs")
    args = parser.parse_args(argv)
    s = SMOKE if args.smoke else Settings()
    for task in recall.TASKS:
        steps = next((n for n in (getattr(args, f"{task}_steps"), args.steps) if n is not None), None)
        if steps is not None:
            if steps < 1:
                parser.error(f"--steps / --{task}-steps = {steps} must be >= 1")
            s = dataclasses.replace(s, **{task: dataclasses.replace(getattr(s, task), steps=steps)})
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or "full" not in names:
        parser.error(f"--variants {args.variants!r}: choose from {sorted(VARIANTS)}, 'full' included")
    os.makedirs(args.out, exist_ok=True)
    print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}; AdamW {s.learning_rate:g}; " + "; ".join(
        f"{task} {size.steps} steps of {size.batch} x {size.length}" for task, size in
        ((task, getattr(s, task)) for task in recall.TASKS)))
    rows = run(names, s)
    text = table(rows, s)
    print("\n" + text)
    with open(os.path.join(args.out, "mixers.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "mixers.json"), "w") as f:
        json.dump({"settings": dataclasses.asdict(s), "rows": rows}, f, indent=1, default=str)
    plot(args.plot or os.path.join(args.out, "mixers.png"), rows, s)


if __name__ == "__main__":
    main()
