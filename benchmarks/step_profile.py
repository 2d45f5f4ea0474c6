"""Where a train step's time goes on a GPU: MFU per batch, and the device time of every kernel
and HLO op of the step, read from a `jax.profiler` trace.

    python -m benchmarks.step_profile --model gpt2 --batches 8,16 --seq 1024 --impl cudnn --out DIR

For each batch it compiles tfm's bf16 train step (`benchmarks.train_step`'s: forward, backward,
AdamW, fp32 parameters), takes the fastest of --steps, then traces --trace-steps steps and sums
the device time per kernel (the GPU streams' events) and per HLO op (the profiler's "XLA Ops"
line, where the runtime has one), grouped by `category`. DIR gets profile.md (rewritten after
every case, so a run cut short keeps what finished) and bundle.tar (each case's gzipped compiled HLO
text and Perfetto trace, to read the fusions behind the op names).

MFU counts `tfm.train.metrics.flops_per_token` over the device's dense bf16 peak, as gpu_check.
"""
from __future__ import annotations

import argparse
import collections
import gc
import glob
import gzip
import json
import os
import sys
import tarfile
import tempfile
import time
from typing import Optional

import jax

from benchmarks import train_step as bench
from tfm.train.metrics import flops_per_token, peak_flops

# (category, substrings of a kernel or op name, lower case), first match wins.
CATEGORIES = (
    ("attention", ("cudnn", "fmha", "flash", "attention", "mha", "sdpa")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "sm90_", "sm80_", "dot", "matmul")),
    ("reduction", ("reduce", "input_")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset", "dynamic_update_slice", "concatenate")),
    ("elementwise", ("loop_", "fusion", "convert", "multiply", "add", "select")),
)


def category(name: str) -> str:
    low = name.lower()
    for label, parts in CATEGORIES:
        if any(p in low for p in parts):
            return label
    return "other"


def device_times(trace: dict) -> tuple[dict, dict, float]:
    """({kernel: [µs, count]}, {hlo op: [µs, count]}, busy µs) of the GPU lines of a Perfetto trace.
    Kernels come from the "Stream" lines, HLO ops from "XLA Ops"; busy time is the union of the
    kernels' intervals."""
    processes, threads = {}, {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[e["pid"], e["tid"]] = e["args"]["name"]
    gpus = {pid for pid, name in processes.items() if "gpu" in name.lower() and "host" not in name.lower()}
    kernels, ops = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(lambda: [0.0, 0])
    intervals = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("pid") not in gpus:
            continue
        line = threads.get((e["pid"], e.get("tid")), "")
        if line.startswith("Stream"):
            entry = kernels[e["name"]]
            intervals.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
        elif line == "XLA Ops":
            entry = ops[e["name"]]
        else:
            continue
        entry[0] += float(e.get("dur", 0))
        entry[1] += 1
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return dict(kernels), dict(ops), busy


def perfetto_trace(directory: str) -> dict:
    paths = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {directory}")
    with gzip.open(paths[0], "rt") as f:
        return json.load(f)


def top_lines(title: str, times: dict, steps: int, step_ms: float, n: int) -> list[str]:
    """A markdown table of the n largest entries, per step, with their share of the step."""
    rows = sorted(times.items(), key=lambda kv: -kv[1][0])[:n]
    lines = [f"{title}:", "", "| name | category | ms/step | calls/step | share of step |", "|---|---|---|---|---|"]
    for name, (us, count) in rows:
        lines.append(f"| `{name[:90]}` | {category(name)} | {us / steps / 1e3:.3f} | {count / steps:g} | "
                     f"{us / steps / 1e3 / step_ms:.1%} |")
    return lines


def by_category(times: dict, steps: int, step_ms: float) -> list[str]:
    sums = collections.Counter()
    for name, (us, _) in times.items():
        sums[category(name)] += us / steps / 1e3
    return ["| category | ms/step | share of step |", "|---|---|---|"] + [
        f"| {c} | {ms:.2f} | {ms / step_ms:.1%} |" for c, ms in sums.most_common()]


def profile_case(model: str, B: int, T: int, impl: str, steps: int, trace_steps: int, bundle: str,
                 vocab_chunk=None, top: int = 25, execution: Optional[dict] = None) -> list[str]:
    """Markdown lines for one (model, batch): time, MFU, memory, top kernels and ops. execution:
    more ExecutionConfig fields for the model."""
    execution = execution or {}
    step, trainer, compiled = bench.jax_stepper(model, B, T, dtype="bfloat16", attention_impl=impl,
                                                vocab_chunk=vocab_chunk, **execution)
    memory = compiled.memory_analysis()
    seconds, = bench.interleaved([step], steps)
    cfg, peak = trainer.model.config, peak_flops()
    flops = B * T * flops_per_token(trainer.flop_params, cfg.num_layers, cfg.d_model, T)
    mfu = f"{flops / seconds / peak:.1%}" if peak else "n/a"
    step_ms = seconds * 1e3
    variant = (f"attention {impl}, cross-entropy {f'fused, vocab chunk {vocab_chunk}' if vocab_chunk else 'plain'}"
               + "".join(f", {k} {v}" for k, v in execution.items()))
    lines = [f"### {model} {B}×{T}, {variant}: {step_ms:.1f} ms/step, {B * T / seconds:,.0f} tokens/s, "
             f"MFU {mfu}", "", f"XLA_FLAGS: `{os.environ.get('XLA_FLAGS', '')}`", "",
             f"{trainer.num_params:,} parameters ({trainer.flop_params:,} in matmuls); {flops / 1e12:.2f} TFLOP per step; compiled memory "
             f"{(memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes + memory.temp_size_in_bytes) / 2**30:.2f} GiB "
             f"(temporaries {memory.temp_size_in_bytes / 2**30:.2f})", ""]
    with tempfile.TemporaryDirectory() as tmp:
        hlo = compiled.as_text()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(trace_steps):
                step()
        trace = perfetto_trace(tmp)
        tag = "_".join([model, f"{B}x{T}", impl, str(vocab_chunk or "plain"), *map(str, execution.values()),
                        os.environ.get("XLA_FLAGS", "").replace("--xla_gpu_", "").replace(" ", "+").replace("=", "-")])
        with tarfile.open(bundle, "a") as tar:
            for name, data in ((f"{tag}.hlo.txt.gz", hlo), (f"{tag}.trace.json.gz", json.dumps(trace))):
                path = os.path.join(tmp, name)
                with gzip.open(path, "wt") as f:
                    f.write(data)
                tar.add(path, arcname=name)
    kernels, ops, busy = device_times(trace)
    traced_ms = step_ms  # shares are of the timed (untraced) step
    lines += [f"GPU busy {busy / trace_steps / 1e3:.2f} ms of each step (kernels' union over {trace_steps} traced "
              f"steps); idle {1 - busy / trace_steps / 1e3 / traced_ms:.1%}.", ""]
    lines += ["By category (kernels):", ""] + by_category(kernels, trace_steps, traced_ms) + [""]
    lines += top_lines("Top kernels", kernels, trace_steps, traced_ms, top) + [""]
    if ops:
        lines += ["By category (HLO ops):", ""] + by_category(ops, trace_steps, traced_ms) + [""]
        lines += top_lines("Top HLO ops", ops, trace_steps, traced_ms, top) + [""]
    del step, trainer, compiled
    gc.collect()
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", help="gpt2, gpt2_medium, bert, llama1b or transformer")
    p.add_argument("--batches", default="8", help="comma-separated batch sizes")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--impl", default="cudnn", help="attention impl")
    p.add_argument("--steps", type=int, default=5, help="timed steps (the fastest counts)")
    p.add_argument("--trace-steps", type=int, default=3)
    p.add_argument("--vocab-chunk", type=int, default=None, help="fused cross-entropy over vocabulary chunks")
    p.add_argument("--top", type=int, default=25, help="kernels and ops listed per case")
    p.add_argument("--execution", default="", help="ExecutionConfig fields, e.g. logits_block_size=128,remat_policy=full")
    p.add_argument("--out", default="step_profile_out")
    a = p.parse_args(argv)
    execution = dict(item.split("=", 1) for item in a.execution.split(",") if item)
    execution = {k: int(v) if v.isdigit() else v for k, v in execution.items()}
    os.makedirs(a.out, exist_ok=True)
    report, bundle = os.path.join(a.out, "profile.md"), os.path.join(a.out, "bundle.tar")
    lines = [] if not os.path.exists(report) else open(report).read().splitlines()
    if not lines:
        lines = [f"# tfm train-step profile: {jax.devices()[0].device_kind}, jax {jax.__version__}", ""]
    for B in (int(b) for b in a.batches.split(",")):
        start = time.monotonic()
        print(f"profile {a.model} {B}x{a.seq} {a.impl} ...", flush=True)
        try:
            lines += profile_case(a.model, B, a.seq, a.impl, a.steps, a.trace_steps, bundle, a.vocab_chunk, a.top,
                                  execution)
        except Exception as e:  # out of memory at a large batch: shown, the next batch still runs
            lines += [f"### {a.model} {B}×{a.seq}, attention {a.impl}: {type(e).__name__}: "
                      f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}", ""]
        print("\n".join(lines[-(a.top + 20):]), f"\n({time.monotonic() - start:.0f} s)", flush=True)
        with open(report, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
