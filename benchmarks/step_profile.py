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

--compile-only needs no GPU: it compiles the same step for a compile-only GPU (--target, default
h100-1; `tfm.preflight`'s plugins) on this CPU and breaks the optimized HLO down per kernel
(`breakdown`): every top-level fusion, custom call, copy or collective, a loop body's kernels
times its known trip count. DIR gets breakdown.md and breakdown.json. --tiny shrinks the model to
`benchmarks.train_step.TINY`. JAX's cuDNN attention cannot be traced without cuDNN, so take
--impl pallas (the default here) or xla.

    python -m benchmarks.step_profile --compile-only --model gpt2 --batches 8 --seq 1024 --out DIR

--hlo FILE breaks down a saved program the same way (a bundle's .hlo.txt.gz; --target's chip for
the roofline) and prints it.

Per kernel: bytes = its operands' and results' sizes from their shapes (a dynamic slice counted by
the slice, an in-place dynamic update by the update, as a scan's body touches one step of its stacked
arrays; an upper bound where it reads part of an operand otherwise; cuBLAS/cuDNN scratch results left
out; a Pallas TPU kernel's FLOPs and bytes are its own cost estimate's); FLOPs =
2 x result size x contracted size of every dot and convolution inside it, a cuBLAS gemm's from its
dot dimensions, cuDNN attention's as 2 products forward (QKᵀ, PV) and 5 backward (QKᵀ again, dV,
dP, dQ, dK) over the full T x S scores (a causal mask not discounted); Pallas (Triton) kernels'
FLOPs are not known (0, listed). A roofline time per kernel is max(bytes / HBM bandwidth, FLOPs /
dense bf16 peak) of the target chip: an estimate, not a measurement. Category, first rule that
holds: "attention" (a cuDNN attention or Pallas flash-attention call), "weight convert" (only
converts between f32 and bf16, with moves, of an array shaped as a parameter, up to the order of
its dims: parameters are the ENTRY parameters named state.params), "copy/transpose" (only copies,
transposes, slices, pads, concatenations, reshapes, wherever they come from: the op_name says),
then by the kernel's op_name (its root op's): "attention" (tfm's attention entry point's scope),
"logits/cross-entropy" (an output layer's scope: output, mlm_output, ...; or the cross_entropy
scope of tfm's losses), "optimizer" (the train step's optimizer scope: the optax update), then by
what it computes: "matmul" (a dot, a convolution or a cuBLAS gemm), "collective",
"gather/scatter", "reduction", "elementwise".
Every f32<->bf16 convert of a parameter-shaped array is listed too, fused into another kernel or not.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import glob
import gzip
import json
import math
import os
import re
import sys
import tarfile
import tempfile
import time
from typing import Optional

import jax

from benchmarks import train_step as bench
from tfm.parallel import MeshConfig, make_mesh
from tfm.preflight.analysis import COLLECTIVES, ITEMSIZE, shape_arrays, split_instruction
from tfm.preflight.targets import Chip, parse_target, use_plugins
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


# ---------------------------------------------------------------------- compile-only breakdown

_NO_KERNEL = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
                        "partition-id", "replica-id", "add-dependency", "opt-barrier"})  # no data moved
_MOVES = frozenset({"copy", "transpose", "reshape", "slice", "dynamic-slice", "dynamic-update-slice", "pad",
                    "concatenate", "reverse"})
_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul")
_FMHA = "__cudnn$fmha"
_SCOPES = (("attention", re.compile(r"(^|[/(])attention[/)]")),
           ("logits/cross-entropy", re.compile(r"(^|[/(])(\w+_)?output/|(^|[/(])cross_entropy[/)]")),
           ("optimizer", re.compile(r"(^|[/(])optimizer[/)]")))
_CALLS = ("calls", "to_apply", "body", "condition", "branch_computations", "true_computation", "false_computation")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One line of HLO text, split (`tfm.preflight.analysis.split_instruction`)."""
    name: str
    shape: str    # result shape text, layouts included
    opcode: str
    rest: str     # operands and attributes

    @property
    def operands(self) -> list[str]:
        return list(dict.fromkeys(re.findall(r"%([\w.\-]+)", self.rest.split(")", 1)[0])))

    @property
    def op_name(self) -> str:
        found = re.search(r'op_name="([^"]*)"', self.rest)
        return found.group(1).replace("jit(train_step)/", "") if found else ""

    @property
    def target(self) -> str:
        found = re.search(r'custom_call_target="([^"]+)"', self.rest)
        return found.group(1) if found else ""

    def called(self, *keys: str) -> list[str]:
        """Names of the computations this instruction calls through the given attributes."""
        names = []
        for key in keys:
            found = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", self.rest)
            names += re.findall(r"%?([\w.\-]+)", found.group(1).strip("{}")) if found else []
        return names


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One top-level instruction of a compiled step, per run, and how often a step runs it."""
    name: str
    category: str
    op_name: str
    bytes: int
    flops: float
    count: int = 1
    flops_known: bool = True


def _parse(hlo: str) -> tuple[dict, str]:
    """({computation: [Instruction]}, the ENTRY computation's name) of HLO text."""
    computations, entry, current = {}, "", None
    for line in hlo.splitlines():
        text = line.strip()
        if text.endswith("{") and " = " not in text:
            header = re.match(r"(ENTRY\s+)?%?([\w.\-]+)", text)
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif current is not None and (parts := split_instruction(line)):
            computations[current].append(Instruction(*parts))
    return computations, entry


def _nbytes(shape: str, drop_scratch: bool = False) -> int:
    """Bytes of the arrays of a shape; drop_scratch leaves out a tuple's trailing s8/u8 array (a
    custom call's workspace)."""
    arrays = shape_arrays(shape)
    if drop_scratch and len(arrays) > 1 and arrays[-1][0] in ("s8", "u8"):
        arrays = arrays[:-1]
    return sum(ITEMSIZE[t] * math.prod(dims) for t, dims in arrays)


def _dims(shape: str) -> tuple[int, ...]:
    return shape_arrays(shape)[0][1]


def _flops(i: Instruction, shapes: dict) -> Optional[float]:
    """FLOPs of one dot, convolution, cuBLAS gemm or cuDNN attention call; 0 for other ops, None
    for a custom call whose FLOPs the HLO does not give."""
    if i.opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.rest).group(1)
        lhs = _dims(shapes[i.operands[0]])
        return 2.0 * math.prod(_dims(i.shape)) * math.prod(lhs[int(d)] for d in contracting.split(",") if d)
    if i.opcode == "convolution":
        kernel_labels = re.search(r"dim_labels=\w+_(\w+)->", i.rest).group(1)
        rhs = _dims(shapes[i.operands[1]])
        return 2.0 * math.prod(_dims(i.shape)) * math.prod(rhs) / rhs[kernel_labels.index("o")]
    if i.opcode != "custom-call":
        return 0.0
    if i.target.startswith(_GEMMS):
        contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', i.rest).group(1)
        lhs = _dims(shapes[i.operands[0]])
        return 2.0 * math.prod(_dims(i.shape)) * math.prod(lhs[int(d)] for d in re.findall(r"\d+", contracting))
    if i.target.startswith("__cublas$triangularSolve"):  # a [..., C, C] triangle against [..., C, n]: C² n
        a, b = _dims(shapes[i.operands[0]]), _dims(shapes[i.operands[1]])
        return float(math.prod(b) * a[-1])
    scores = re.search(r'"intermediate_tensor_shape":\{"dimensions":\[([^\]]*)\]', i.rest)
    if i.target.startswith(_FMHA) and scores:
        size = math.prod(int(d) for d in re.findall(r"\d+", scores.group(1)))
        h, h_v = _dims(shapes[i.operands[0]])[-1], _dims(shapes[i.operands[2]])[-1]  # Q, V: [..., H]
        return 2.0 * size * ((3 * h + 2 * h_v) if "Backward" in i.target else (h + h_v))
    return None


def _inside(i: Instruction, computations: dict) -> list[Instruction]:
    """The instructions a kernel runs: a fusion's (nested fusions and called computations
    included), else the instruction itself."""
    if i.opcode != "fusion":
        return [i]
    found, stack = [], list(i.called("calls"))
    while stack:
        for inner in computations[stack.pop()]:
            found.append(inner)
            stack += inner.called(*_CALLS)
    return found


def _weight_converts(ops: list, shapes: dict, weights: set) -> list[str]:
    """"f32[768,3072] -> bf16" for each convert among ops between f32 and bf16 of an array shaped
    as a parameter (dims in any order)."""
    found = []
    for i in ops:
        if i.opcode != "convert":
            continue
        (to, dims), = shape_arrays(i.shape)
        (source, _), = shape_arrays(shapes[i.operands[0]])
        if {source, to} == {"f32", "bf16"} and tuple(sorted(dims)) in weights:
            found.append(f"{source}[{','.join(map(str, dims))}] -> {to}")
    return found


def _category(i: Instruction, ops: list, flops: float, weight_convert: bool) -> str:
    """The module doc's rules, in order."""
    if i.target.startswith(_FMHA) or (i.opcode == "custom-call" and "flash_attention" in i.op_name):
        return "attention"
    if weight_convert:
        return "weight convert"
    kinds = {op.opcode for op in ops} - _NO_KERNEL
    if kinds and kinds <= _MOVES:
        return "copy/transpose"
    for label, scope in _SCOPES:
        if scope.search(i.op_name):
            return label
    if flops or i.target.startswith(_GEMMS):
        return "matmul"
    if any(k.removesuffix("-start") in COLLECTIVES for k in kinds):
        return "collective"
    if kinds & {"gather", "scatter"}:
        return "gather/scatter"
    return "reduction" if "reduce" in kinds else "elementwise"


_COST_ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"(\d+)".*?"bytes_accessed":"(\d+)"')


def _moved_bytes(i: Instruction, computations: dict, shapes: dict) -> int:
    """Bytes a kernel reads and writes: its results and operands, except that a slice reads only its
    slice (an operand a fusion reads only through dynamic-slices counts their results) and an update in
    place moves only the update (a dynamic-update-slice whose buffer is an operand: that operand and
    the buffer's share of the result count the update's size), as a scan's body reads and writes one
    step of its stacked arrays; a custom call's scratch result is left out."""
    raw_operands = re.findall(r"%([\w.\-]+)", i.rest.split(")", 1)[0])
    if i.opcode == "dynamic-slice":
        return 2 * _nbytes(i.shape)
    if i.opcode == "dynamic-update-slice":
        return 2 * _nbytes(shapes[raw_operands[1]])
    moved = _nbytes(i.shape, drop_scratch=i.opcode == "custom-call")
    if i.opcode != "fusion":
        return moved + sum(_nbytes(shapes[o]) for o in i.operands)
    inner = [op for name in i.called("calls") for op in computations[name]]
    params = {op.name: raw_operands[int(op.rest.split(")")[0])] for op in inner if op.opcode == "parameter"}
    users: dict = {}
    for op in inner:
        for position, operand in enumerate(re.findall(r"%([\w.\-]+)", op.rest.split(")", 1)[0])):
            users.setdefault(operand, []).append((op, position))
    read = {}  # fusion operand -> bytes read
    for param, operand in params.items():
        uses = users.get(param, [])
        if uses and all(op.opcode == "dynamic-slice" and position == 0 for op, position in uses):
            size = sum(_nbytes(op.shape) for op, _ in uses)
        elif uses and all(op.opcode == "dynamic-update-slice" and position == 0 for op, position in uses):
            size = 0  # the buffer updated in place
            moved -= sum(_nbytes(op.shape) - _nbytes(shapes[op.operands[1]]) for op, _ in uses)
        else:
            size = _nbytes(shapes[operand])
        read[operand] = max(read.get(operand, 0), size)
    return moved + sum(read.values())


def breakdown(hlo: str) -> tuple[list[Kernel], list[tuple[str, str, str]]]:
    """(kernels, weight converts (kernel, its category, "f32[V,D] -> bf16")) of compiled HLO text:
    each top-level instruction of the ENTRY computation and of the loop bodies, calls and branches it
    runs (a while body's kernels counted its known trip count of times, its condition not at all),
    categorised and costed as the module doc says."""
    computations, entry = _parse(hlo)
    shapes = {i.name: i.shape for ops in computations.values() for i in ops}
    weights = {tuple(sorted(_dims(i.shape))) for i in computations[entry]
               if i.opcode == "parameter" and i.op_name.startswith("state.params")}
    kernels, converts = [], []

    def walk(computation: str, count: int):
        for i in computations[computation]:
            if i.opcode in _NO_KERNEL or i.opcode.endswith("-done"):
                continue
            if i.opcode in ("while", "call", "conditional", "async-start"):
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', i.rest) if i.opcode == "while" else None
                for called in i.called("body", "to_apply", "calls", "branch_computations", "true_computation",
                                       "false_computation"):
                    walk(called, count * (int(trips.group(1)) if trips else 1))
                continue
            ops = _inside(i, computations)
            counted = [_flops(op, shapes) for op in ops]
            flops = sum(f for f in counted if f)
            found = _weight_converts(ops, shapes, weights)
            moves_only = {op.opcode for op in ops} - _NO_KERNEL <= _MOVES | {"convert"}
            category = _category(i, ops, flops, bool(found) and moves_only)
            moved = _moved_bytes(i, computations, shapes)
            estimate = _COST_ESTIMATE.search(i.rest) if i.opcode == "custom-call" else None
            if estimate:  # a Pallas TPU kernel's own cost estimate: its FLOPs and the bytes it streams
                flops, moved, counted = float(estimate.group(1)), int(estimate.group(2)), []
            kernels.append(Kernel(i.name, category, i.op_name, moved, flops, count, None not in counted))
            converts.extend((i.name, category, text) for text in found)

    walk(entry, 1)
    return kernels, converts


def _roofline_s(k: Kernel, chip: Chip) -> float:
    return max(k.bytes / chip.hbm_bandwidth, k.flops / chip.peak_flops)


def _kernel_rows(title: str, kernels: list, key, chip: Chip, n: int) -> list[str]:
    rows = sorted(kernels, key=lambda k: -key(k) * k.count)[:n]
    lines = [f"{title}:", "", "| kernel | category | op_name | runs | MB per run | GFLOP per run | roofline µs |",
             "|---|---|---|---|---|---|---|"]
    for k in rows:
        op_name = k.op_name if len(k.op_name) <= 90 else "…" + k.op_name[-89:]
        lines.append(f"| `{k.name}` | {k.category} | `{op_name}` | {k.count} | {k.bytes / 1e6:,.2f} | "
                     f"{k.flops / 1e9:,.3f}{'' if k.flops_known else ' (unknown)'} | {_roofline_s(k, chip) * 1e6:,.1f} |")
    return lines + [""]


def category_totals(kernels: list, chip: Chip) -> dict:
    """{category: {kernels, bytes, flops, roofline_s}} per step, largest roofline time first."""
    totals = collections.defaultdict(lambda: dict(kernels=0, bytes=0, flops=0.0, roofline_s=0.0))
    for k in kernels:
        t = totals[k.category]
        t["kernels"] += k.count
        t["bytes"] += k.bytes * k.count
        t["flops"] += k.flops * k.count
        t["roofline_s"] += _roofline_s(k, chip) * k.count
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]["roofline_s"]))


def breakdown_lines(kernels: list, converts: list, chip: Chip, top: int = 20) -> list[str]:
    """Markdown: totals per category, the `top` kernels by bytes and by FLOPs, the largest copies
    and transposes, the logits/cross-entropy and optimizer kernels, and every weight convert."""
    totals = category_totals(kernels, chip)
    step_s = sum(t["roofline_s"] for t in totals.values())
    lines = [f"Roofline time (each kernel at the larger of bytes / {chip.hbm_bandwidth / 1e12:.2f} TB/s and "
             f"FLOPs / {chip.peak_flops / 1e12:.0f} TFLOP/s, summed): {step_s * 1e3:.2f} ms; "
             f"{sum(t['bytes'] for t in totals.values()) / 1e9:.2f} GB moved, "
             f"{sum(t['flops'] for t in totals.values()) / 1e12:.3f} TFLOP.", "",
             "| category | kernels | GB | TFLOP | roofline ms | share |", "|---|---|---|---|---|---|"]
    lines += [f"| {c} | {t['kernels']} | {t['bytes'] / 1e9:.3f} | {t['flops'] / 1e12:.4f} | "
              f"{t['roofline_s'] * 1e3:.3f} | {t['roofline_s'] / step_s:.1%} |" for c, t in totals.items()]
    unknown = sorted({k.op_name.rsplit("/", 2)[-2] if "/" in k.op_name else k.name
                      for k in kernels if not k.flops_known})
    lines += [""] + ([f"FLOPs not known (counted 0): {', '.join(unknown)}.", ""] if unknown else [])
    lines += _kernel_rows(f"Top {top} kernels by bytes", kernels, lambda k: k.bytes, chip, top)
    lines += _kernel_rows(f"Top {top} kernels by FLOPs", [k for k in kernels if k.flops], lambda k: k.flops, chip, top)
    for category in ("copy/transpose", "logits/cross-entropy", "optimizer"):
        chosen = [k for k in kernels if k.category == category]
        if chosen:
            lines += _kernel_rows(f"{category}, top 10 of {len(chosen)} by bytes", chosen, lambda k: k.bytes, chip, 10)
    counts = collections.Counter((text, "its own kernel" if category == "weight convert" else f"fused in {category}")
                                 for _, category, text in converts)
    lines += [f"Weight converts (f32 <-> bf16 of a parameter-shaped array): {len(converts)}", "",
              "| convert | where | times |", "|---|---|---|"]
    lines += [f"| {text} | {where} | {n} |" for (text, where), n in counts.most_common()]
    return lines + [""]


def compile_step(model: str, B: int, T: int, impl: str, target_name: str, vocab_chunk=None,
                 execution: Optional[dict] = None, tiny: bool = False):
    """(compiled, trainer, seconds): tfm's bf16 train step of the case compiled, not run, for the
    compile-only GPU `target_name` (one chip: h100-1 or h200-1)."""
    mesh = make_mesh(MeshConfig(data=1), parse_target(target_name).devices())
    changes = dict(dtype="bfloat16", attention_impl=impl, **(bench.TINY if tiny else {}), **(execution or {}))
    trainer, batch = bench.case_trainer(model, B, T, vocab_chunk, mesh=mesh, **changes)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding) for k, v in batch.items()}
    start = time.perf_counter()
    with trainer.context():
        compiled = trainer.jitted_train_step.trace(trainer.abstract_state, batch).lower().compile()
    return compiled, trainer, time.perf_counter() - start


def compile_only_case(model: str, B: int, T: int, impl: str, target_name: str, vocab_chunk=None,
                      execution: Optional[dict] = None, tiny: bool = False, top: int = 20) -> tuple[list, dict]:
    """(markdown lines, json record) of one case's compile-only breakdown."""
    compiled, trainer, seconds = compile_step(model, B, T, impl, target_name, vocab_chunk, execution, tiny)
    chip = parse_target(target_name).chip
    kernels, converts = breakdown(compiled.as_text())
    cfg = trainer.model.config
    model_flops = B * T * flops_per_token(trainer.flop_params, cfg.num_layers, cfg.d_model, T)
    variant = (f"{'tiny ' if tiny else ''}{model} {B}×{T}, attention {impl}, cross-entropy "
               f"{f'fused, vocab chunk {vocab_chunk}' if vocab_chunk else 'plain'}"
               + "".join(f", {k} {v}" for k, v in (execution or {}).items()))
    lines = [f"### {variant}: compiled for {chip.name} (compile-only) in {seconds:.0f} s", "",
             f"{trainer.num_params:,} parameters; model FLOPs (flops_per_token x tokens) {model_flops / 1e12:.3f} "
             f"TFLOP per step.", ""] + breakdown_lines(kernels, converts, chip, top)
    record = {"case": variant, "target": chip.name, "compile_seconds": seconds, "model_flops": model_flops,
              "categories": category_totals(kernels, chip), "weight_converts": [list(c) for c in converts]}
    del compiled, trainer
    gc.collect()
    return lines, record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", help="gpt2, gpt2_medium, bert, llama1b or transformer")
    p.add_argument("--batches", default="8", help="comma-separated batch sizes")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--impl", default=None, help="attention impl (default cudnn; with --compile-only, pallas)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (the fastest counts)")
    p.add_argument("--trace-steps", type=int, default=3)
    p.add_argument("--vocab-chunk", type=int, default=None, help="fused cross-entropy over vocabulary chunks")
    p.add_argument("--top", type=int, default=None, help="kernels and ops listed per case (default 25; breakdowns 20)")
    p.add_argument("--execution", default="", help="ExecutionConfig fields, e.g. logits_block_size=128,remat_policy=full")
    p.add_argument("--out", default="step_profile_out")
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU: compile for --target on this CPU and break the optimized HLO down")
    p.add_argument("--target", default="h100-1", help="--compile-only: the GPU, h100-1 or h200-1")
    p.add_argument("--tiny", action="store_true", help="--compile-only: the model at train_step.TINY's size")
    p.add_argument("--hlo", default=None, help="break down this saved HLO text (.gz too; a bundle's) and print it")
    a = p.parse_args(argv)
    execution = dict(item.split("=", 1) for item in a.execution.split(",") if item)
    execution = {k: int(v) if v.isdigit() else v for k, v in execution.items()}
    if a.hlo:
        with (gzip.open if a.hlo.endswith(".gz") else open)(a.hlo, "rt") as f:
            print("\n".join(breakdown_lines(*breakdown(f.read()), parse_target(a.target).chip, a.top or 20)))
        return 0
    if a.compile_only:
        return compile_only_main(a, execution)
    impl, top = a.impl or "cudnn", a.top or 25
    os.makedirs(a.out, exist_ok=True)
    report, bundle = os.path.join(a.out, "profile.md"), os.path.join(a.out, "bundle.tar")
    lines = [] if not os.path.exists(report) else open(report).read().splitlines()
    if not lines:
        lines = [f"# tfm train-step profile: {jax.devices()[0].device_kind}, jax {jax.__version__}", ""]
    for B in (int(b) for b in a.batches.split(",")):
        start = time.monotonic()
        print(f"profile {a.model} {B}x{a.seq} {impl} ...", flush=True)
        try:
            lines += profile_case(a.model, B, a.seq, impl, a.steps, a.trace_steps, bundle, a.vocab_chunk, top,
                                  execution)
        except Exception as e:  # out of memory at a large batch: shown, the next batch still runs
            lines += [f"### {a.model} {B}×{a.seq}, attention {impl}: {type(e).__name__}: "
                      f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}", ""]
        print("\n".join(lines[-(top + 20):]), f"\n({time.monotonic() - start:.0f} s)", flush=True)
        with open(report, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def compile_only_main(a, execution: dict) -> int:
    """--compile-only: each batch's breakdown appended to DIR/breakdown.md and DIR/breakdown.json."""
    target = parse_target(a.target)
    if target.chip.platform != "gpu" or target.chips != 1:
        print(f"error: --compile-only takes one GPU: --target h100-1 or h200-1, got {a.target!r}", file=sys.stderr)
        return 1
    if a.impl == "cudnn":
        print("error: --compile-only cannot trace JAX's cuDNN attention without cuDNN; take --impl pallas or xla",
              file=sys.stderr)
        return 1
    if jax.config.jax_platforms != "cpu":
        jax.config.update("jax_platforms", "cpu")  # before JAX starts its backends: compile-only GPUs
    use_plugins()
    os.makedirs(a.out, exist_ok=True)
    report, records = os.path.join(a.out, "breakdown.md"), os.path.join(a.out, "breakdown.json")
    lines = open(report).read().splitlines() if os.path.exists(report) else [
        f"# tfm train-step breakdown from the compiled HLO (compile-only), jax {jax.__version__}", ""]
    data = json.load(open(records)) if os.path.exists(records) else []
    for B in (int(b) for b in a.batches.split(",")):
        print(f"compile {a.model} {B}x{a.seq} for {a.target} ...", flush=True)
        case, record = compile_only_case(a.model, B, a.seq, a.impl or "pallas", a.target, a.vocab_chunk, execution,
                                         a.tiny, a.top or 20)
        lines += case
        data.append(record)
        with open(report, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(records, "w") as f:
            json.dump(data, f, indent=1)
        print("\n".join(case), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
