"""What a compiled train step needs of each chip: memory, collectives, kernels, FLOPs, time.

`check_step(trainer, batch, target)` compiles the Trainer's jitted train step (and eval step)
for the target's compile-only devices and reads the executable: XLA's per-device memory
analysis, the collectives and kernel calls in its HLO, and (TPU) XLA's cost-model time. Model
FLOPs are counted exactly from the forward pass's jaxpr (every dot_general, scans multiplied
out, attention as the xla backend computes it) times 3 for forward + backward.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Optional

import jax
import numpy as np

from tfm.parallel.rules import parse_parallelism
from tfm.preflight.targets import GiB, Target
from tfm.train.step import make_eval_step

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_REDUCE_SCATTER_FUSION = "all-reduce-scatter"  # the computation name XLA TPU gives its reduce-scatter fusions
KERNEL_TARGETS = {"tpu_custom_call": "pallas (Mosaic)", "__gpu$xla.gpu.triton": "pallas (Triton)",
                  "__cudnn$fmha": "cudnn"}
ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
            "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(ITEMSIZE) + r")\[([\d,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


@dataclasses.dataclass
class StepReport:
    """One compiled step on one target; bytes and FLOPs per chip unless named global."""
    step: str
    target: str
    chips: int
    compile_seconds: float
    hbm_bytes: int
    state_bytes: int = 0            # parameters + optimizer state held by each chip
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0            # outputs written into donated arguments
    temp_bytes: int = 0
    total_bytes: int = 0            # argument + output - alias + temp
    fits: bool = False
    model_flops: float = 0.0        # global, per step: 3 x forward dot_general FLOPs
    xla_flops: Optional[float] = None   # per chip, XLA's count (a scanned body once)
    xla_bytes: Optional[float] = None   # per chip, HBM bytes XLA's cost model moves (likewise)
    cost_model_seconds: Optional[float] = None
    estimate_seconds: Optional[float] = None
    estimate_note: str = ""
    mfu: Optional[float] = None     # model FLOPs / (chips x peak x estimate): an estimate
    collectives: dict = dataclasses.field(default_factory=dict)  # kind -> {"count", "bytes", "shapes"}
    kernels: list = dataclasses.field(default_factory=list)      # {"backend", "name", "shapes"}
    largest: list = dataclasses.field(default_factory=list)      # (bytes, shape, op)
    error: str = ""


# ---------------------------------------------------------------------------- model FLOPs


def _sub_jaxprs(value):
    if hasattr(value, "jaxpr") and hasattr(value, "consts"):  # ClosedJaxpr
        yield value.jaxpr
    elif hasattr(value, "eqns"):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def dot_flops(jaxpr, *, unroll: bool = True) -> float:
    """2 x contracted size x output size summed over every dot_general of `jaxpr` and the
    jaxprs inside it: a scan's body times its length (once with unroll=False, as XLA's cost
    analysis counts a loop), a cond's costliest branch, nothing inside a Pallas kernel (XLA sees
    only a kernel's cost estimate)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(lhs[d] for d in contract) * math.prod(eqn.outvars[0].aval.shape)
        if eqn.primitive.name == "pallas_call":
            continue
        inner = [dot_flops(j, unroll=unroll) for v in eqn.params.values() for j in _sub_jaxprs(v)]
        if eqn.primitive.name == "cond":
            total += max(inner, default=0.0)
        elif eqn.primitive.name == "scan" and unroll:
            total += eqn.params["length"] * sum(inner)
        else:
            total += sum(inner)
    return total


def model_flops(model, task, params_shapes, batch: dict) -> float:
    """Training FLOPs of one step on `batch` (global shapes): 3 x the forward pass's matmul FLOPs,
    attention computed as the xla backend does (full T x S scores, as PaLM's 6N + 12LHT)."""
    xla = dict(attention_impl="xla", attention_block_sizes=None)
    reference = model.clone(config=model.config.replace(execution=xla))
    plain = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
    jaxpr = jax.make_jaxpr(make_eval_step(reference, task))(params_shapes, plain)
    return 3.0 * dot_flops(jaxpr.jaxpr)


# ---------------------------------------------------------------------------- the HLO


def shape_arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of each array in an HLO shape ("bf16[2,8]{1,0}": one; a tuple: each element)."""
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape_text)]


def _largest_array(shape_text: str) -> tuple[int, str]:
    """(bytes, "bf16[2,8]") of the largest array in a result shape (a tuple's largest element)."""
    sizes = [(ITEMSIZE[t] * math.prod(dims), f"{t}[{','.join(map(str, dims))}]") for t, dims in shape_arrays(shape_text)]
    return max(sizes, default=(0, ""))


def _arrays(shape_text: str) -> str:
    """"bf16[2,8]" (or "bf16[2,8], f32[2]" for a tuple), without layouts."""
    return ", ".join(f"{t}[{d}]" for t, d in _ARRAY.findall(shape_text)) or shape_text


def split_instruction(line: str):
    """(name, result shape text, opcode, rest) of an HLO instruction line, or None."""
    m = _DEF.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple shape: up to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        shape, rest = rest[:i + 1], rest[i + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    return m.group(1), shape, opcode.strip(), rest


def read_hlo(text: str, top: int = 5) -> tuple[dict, list, list]:
    """(collectives {kind: {count, bytes, shapes}}, kernel calls, `top` largest arrays (bytes,
    shape, opcode)) of compiled HLO. A collective's bytes are its largest array (a tuple's
    largest element), `shapes` the distinct such arrays per device ("bf16[2,64,2,16]": the
    blocks a ring passes on); instructions in a loop body count once. TPU's reduce-scatter, a
    fusion whose computation all-reduces and slices, counts as one reduce-scatter of its result
    (the shard), not as the all-reduce inside it."""
    shapes, collectives, kernels, sizes = {}, {}, [], {}
    fused = False  # inside a fusion's computation: its values live in registers, not in memory
    scatter_body = False  # inside the computation of a reduce-scatter fusion (counted at its call)
    for line in text.splitlines():
        if line.rstrip().endswith("{") and " = " not in line:  # a computation's header
            header = line.split("(")[0]
            fused = "fused" in header or "fusion" in header
            scatter_body = header.strip().lstrip("%").startswith(_REDUCE_SCATTER_FUSION)
            continue
        parts = split_instruction(line)
        if parts is None:
            continue
        name, shape, opcode, rest = parts
        shapes[name] = shape
        nbytes, array = _largest_array(shape)
        kind = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
        if f"calls=%{_REDUCE_SCATTER_FUSION}" in rest:
            kind = "reduce-scatter"
        elif scatter_body:
            kind = None
        if kind in COLLECTIVES:
            entry = collectives.setdefault(kind, {"count": 0, "bytes": 0, "shapes": []})
            entry["count"] += 1
            entry["bytes"] += nbytes
            if array not in entry["shapes"]:
                entry["shapes"].append(array)
        if opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            backend = next((v for k, v in KERNEL_TARGETS.items() if target and target.group(1).startswith(k)), None)
            if backend:
                operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
                kernel = re.search(r'op_name="[^"]*?(flash_attention_\w+|pallas_call|cudnn\w*)', rest)
                kernels.append({"backend": backend, "name": kernel.group(1) if kernel else name,
                                "operands": [_arrays(shapes.get(o, "?")) for o in operands],
                                "result": _arrays(shape)})
        if nbytes and not fused and opcode not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            key = (array, opcode)
            sizes[key] = max(sizes.get(key, 0), nbytes)
    largest = sorted(((b, s, op) for (s, op), b in sizes.items()), reverse=True)[:top]
    return collectives, kernels, largest


# ---------------------------------------------------------------------------- compiling


def _per_chip_bytes(abstract_tree) -> int:
    """Bytes each device holds of a tree of ShapeDtypeStructs with shardings."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(abstract_tree))


def _compile(jitted, *args):
    """(compiled, seconds, loop factor): the factor is the step's matmul FLOPs with every scan
    unrolled over those with each scan body once (1.0 without scans)."""
    start = time.perf_counter()
    traced = jitted.trace(*args)
    compiled = traced.lower().compile()
    once = dot_flops(traced.jaxpr.jaxpr, unroll=False)
    return compiled, time.perf_counter() - start, dot_flops(traced.jaxpr.jaxpr) / once if once else 1.0


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dict(cost or {})


def memory_bytes(memory) -> int:
    """A compiled step's bytes per device from its `memory_analysis()`: arguments + outputs -
    donated (aliased) + temporaries."""
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)


def _fill(report: StepReport, compiled, target: Target, loop_factor: float) -> None:
    mem = compiled.memory_analysis()
    report.argument_bytes, report.output_bytes = mem.argument_size_in_bytes, mem.output_size_in_bytes
    report.alias_bytes, report.temp_bytes = mem.alias_size_in_bytes, mem.temp_size_in_bytes
    report.total_bytes = memory_bytes(mem)
    report.fits = report.total_bytes <= report.hbm_bytes
    report.collectives, report.kernels, report.largest = read_hlo(compiled.as_text())
    cost = _cost(compiled)
    report.xla_flops, report.xla_bytes = cost.get("flops"), cost.get("bytes accessed")
    seconds = cost.get("optimal_seconds")
    if seconds is None:
        report.estimate_note = (f"no cost model: XLA's {target.chip.platform.upper()} compiler gives no "
                                "cost analysis")
        return
    if seconds <= 0:
        report.estimate_note = f"unavailable: XLA's cost model returned {seconds:.3g} s"
        return
    report.cost_model_seconds = report.estimate_seconds = seconds
    report.estimate_note = "XLA cost model"
    if loop_factor > 1.0:
        report.estimate_seconds = seconds * loop_factor
        report.estimate_note = (f"XLA cost model x {loop_factor:.1f}: it counts a scanned body once; the factor is "
                                "the step's matmul FLOPs (remat included) unrolled / with each scan once")
    if report.kernels:
        others = sorted({k["name"] for k in report.kernels if not k["name"].startswith("flash_attention")})
        report.estimate_note += ("; the flash kernels' time included, from their cost estimates (visible tiles)"
                                 + (f"; not that of {others} (no cost estimate: opaque to the cost model)"
                                    if others else ""))
    report.mfu = report.model_flops / (report.chips * target.chip.peak_flops * report.estimate_seconds)


def _oom(report: StepReport, error: Exception) -> None:
    """A compile the TPU compiler refused for memory: not fitting, with its own numbers."""
    text = " ".join(str(error).split())
    report.fits = False
    report.error = text[:400]
    used = re.search(r"Used ([\d.]+)([GMK])? of ([\d.]+)([GMK])? hbm", text)
    if used:
        scale = {"G": GiB, "M": 1 << 20, "K": 1 << 10, None: 1}
        report.total_bytes = int(float(used.group(1)) * scale[used.group(2)])


def check_step(trainer, batch: dict, target: Target, *, with_eval: bool = True) -> list[StepReport]:
    """Compile `trainer`'s train step (and eval step) for `batch` (global ShapeDtypeStructs) on
    the target; one StepReport each. The trainer's mesh must be over target.devices()."""
    sharded = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding) for k, v in batch.items()}
    flops = model_flops(trainer.model, trainer.task, trainer.abstract_state.params, batch)
    steps = [("train", trainer.jitted_train_step, (trainer.abstract_state, sharded), flops)]
    if with_eval:
        steps.append(("eval", trainer.jitted_eval_step, (trainer.abstract_state.params, sharded), flops / 3))
    reports = []
    for name, jitted, args, step_flops in steps:
        report = StepReport(name, target.name, target.chips, 0.0, target.chip.hbm_bytes, model_flops=step_flops,
                            state_bytes=_per_chip_bytes(args[0]))
        start = time.perf_counter()
        try:
            with trainer.context():
                compiled, report.compile_seconds, loop_factor = _compile(jitted, *args)
        except Exception as e:  # noqa: BLE001 - the compiler's refusal is the finding
            report.compile_seconds = time.perf_counter() - start
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            _oom(report, e)
        else:
            _fill(report, compiled, target, loop_factor)
        reports.append(report)
    return reports


@dataclasses.dataclass(frozen=True)
class Tip:
    """One way to make a step fit: what it does, and the settings that do it, each named by its tfm
    field ("TrainConfig.microbatches", "ModelConfig.execution.remat_policy") with its value."""
    what: str
    settings: dict

    def __str__(self) -> str:
        return f"{self.what}: " + ", ".join(f"{field}={value!r}" for field, value in self.settings.items())


def advice(train_config, model_config, rows_per_device: Optional[int] = None) -> list[Tip]:
    """What would make a step that does not fit fit, from what the config does not do yet.
    `rows_per_device`: sequences each device holds per pass; at one, fewer rows cannot help, so
    splitting each sequence over devices (context parallelism) is named instead."""
    tips = []
    styles = parse_parallelism(train_config.parallelism)
    if "fsdp" not in styles:
        tips.append(Tip("shard parameters and optimizer state (parallelism data+fsdp does too)",
                        {"TrainConfig.parallelism": "fsdp", "TrainConfig.mesh.fsdp": -1, "TrainConfig.mesh.data": 1}))
    policy = model_config.execution.remat_policy
    if policy != "full":
        stronger, most = ("full", "") if policy != "none" else ("dots_with_no_batch_dims_saveable",
                                                              "; 'full' saves the most")
        tips.append(Tip(f"rematerialise more (now {policy!r}{most})",
                        {"ModelConfig.execution.remat_policy": stronger}))
    if rows_per_device is not None and rows_per_device <= 1:
        context = train_config.mesh.context if "context" in styles else 1
        others = "+".join(s for s in styles if s != "context")
        held = "one whole sequence" if context == 1 else f"1/{context} of a sequence"
        tips.append(Tip(f"each device holds {held} per pass: split sequences over {'' if context == 1 else 'more '}"
                        "devices (context parallelism)",
                        {"TrainConfig.parallelism": f"{others}+context", "TrainConfig.mesh.context": max(4, 2 * context)}))
        return tips
    tips.append(Tip("accumulate gradients", {"TrainConfig.microbatches": 2 * train_config.microbatches}))
    tips.append(Tip("or a smaller batch", {"TrainConfig.batch_size": train_config.batch_size // 2}))
    return tips
