"""What a compiled train step needs of each chip: memory, collectives, kernels, FLOPs, time.

`check_step(trainer, batch, target)` compiles the Trainer's jitted train step (and eval step)
for the target's compile-only devices and reads the executable: XLA's per-device memory
analysis, the collectives and kernel calls in its HLO, and (TPU) XLA's cost-model time. Model
FLOPs are counted exactly from the forward pass's jaxpr (every dot_general, scans multiplied
out, attention as the xla backend computes it) times 3 for forward + backward. With `kernels_apart`
the step is compiled a second time with the flash kernels' cost estimates left off, and the difference
of XLA's two estimates is the kernels' part of the step. All-reduces are also
read by what they do (`all_reduce_forms`): XLA TPU writes some of FSDP's all-gathers and (over a
whole slice) its reduce-scatters as all-reduces, and under fsdp a weight- or activation-sized
all-reduce that is neither is reported as unexpected.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Optional

import jax
import numpy as np

from tfm.kernels import flash_attention
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
    # `kernels_apart`: the estimate with the flash kernels scored at 0 s (compiled again without their cost
    # estimates, the same loop factor), and estimate_seconds minus that: the kernels' part, by XLA's cost model
    estimate_seconds_without_kernels: Optional[float] = None
    kernel_seconds: Optional[float] = None
    mfu: Optional[float] = None     # model FLOPs / (chips x peak x estimate): an estimate
    collectives: dict = dataclasses.field(default_factory=dict)  # kind -> {"count", "bytes", "shapes"}
    # the arrays all-reduces sum, by what they do (`all_reduce_forms`): "gather" / "scatter" (an all-gather
    # or reduce-scatter written as an all-reduce) / "sum" -> {"count", "bytes", "shapes"}
    all_reduce_forms: dict = dataclasses.field(default_factory=dict)
    unexpected: list = dataclasses.field(default_factory=list)   # `unexpected_all_reduces`: "sum" records
    kernels: list = dataclasses.field(default_factory=list)      # `read_hlo`'s kernel calls
    largest: list = dataclasses.field(default_factory=list)      # (bytes, shape, op)
    time_by_op: list = dataclasses.field(default_factory=list)   # `time_by_op`: (op, share of the cycles)
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
    """(collectives {kind: {count, bytes, shapes}}, kernel calls {backend, name, operands, result,
    cost_estimate: whether the call carries one for XLA's cost model}, `top` largest arrays (bytes,
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
                operands = _operand_names(rest)
                kernel = re.search(r'op_name="[^"]*?(flash_attention_\w+|pallas_call|cudnn\w*)', rest)
                kernels.append({"backend": backend, "name": kernel.group(1) if kernel else name,
                                "operands": [_arrays(shapes.get(o, "?")) for o in operands],
                                "result": _arrays(shape), "cost_estimate": '"cost_estimate"' in rest})
        if nbytes and not fused and opcode not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            key = (array, opcode)
            sizes[key] = max(sizes.get(key, 0), nbytes)
    largest = sorted(((b, s, op) for (s, op), b in sizes.items()), reverse=True)[:top]
    return collectives, kernels, largest


_PASS_THROUGH = ("bitcast", "copy", "copy-start", "copy-done", "convert", "reshape", "all-reduce-done")


def _operand_names(rest: str) -> list[str]:
    """The %names of an instruction's operands (the text up to its operand list's closing parenthesis)."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return re.findall(r"%([\w.\-]+)", rest[:i])
    return re.findall(r"%([\w.\-]+)", rest)


def _computations(text: str) -> dict:
    """{computation name: {"root", "ops": {name: (shape, opcode, rest, operands)}, "users": {name: [user]},
    "params": {index: name}}} of HLO text."""
    computations, current = {}, None
    for line in text.splitlines():
        if line.rstrip().endswith("{") and " = " not in line:  # "[ENTRY] %name (params) -> shape {"
            name = line.split("(")[0].split()[-1].lstrip("%")
            current = computations.setdefault(name, {"root": None, "ops": {}, "users": {}, "params": {}})
            continue
        parts = split_instruction(line) if current is not None else None
        if parts is None:
            continue
        name, shape, opcode, rest = parts
        operands = _operand_names(rest)
        current["ops"][name] = (shape, opcode, rest, operands)
        for operand in operands:
            current["users"].setdefault(operand, []).append(name)
        if opcode == "parameter":
            current["params"][int(rest.split(")")[0])] = name
        if line.lstrip().startswith("ROOT"):
            current["root"] = name
    return computations


_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_TRANSFORMS = re.compile(r"jit\([^)]*\)/|jvp\(|transpose\(|\)|while/body/|closed_call/|checkpoint/|"
                         r"rematted_computation/|shard_map/")


def _trip_count(condition: dict) -> int:
    """Iterations of a scan's while loop from its condition computation (`i < N`: the s32 constant
    its root compares with); 1 when the condition is not of that form."""
    root = condition["ops"].get(condition["root"])
    if root is None or root[1] != "compare" or "direction=LT" not in root[2]:
        return 1
    for operand in root[3]:
        shape, opcode, rest, _ = condition["ops"].get(operand, ("", "", "", ()))
        if opcode == "constant" and shape.startswith("s32[]"):
            return int(rest.split(")")[0])
    return 1


def _op_label(opcode: str, rest: str) -> str:
    """An instruction's op_name without jit/jvp/loop wrappers, its last three parts ("ffn/wo/dot_general"),
    marked "(backward)" inside a transpose (the backward pass); its opcode when it has no op_name (XLA's
    own, such as the zeros an all-gather written as an all-reduce fills: "broadcast (no op name)")."""
    op = re.search(r'op_name="([^"]*)"', rest)
    if not op:
        return f"{opcode} (no op name)"
    parts = [p for p in _TRANSFORMS.sub("", re.sub(r"\[.*?\]", "", op.group(1))).split("/") if p]
    return "/".join(parts[-3:]) + (" (backward)" if "transpose(" in op.group(1) else "")


def time_by_op(text: str, top: int = 8) -> list[tuple[str, float]]:
    """Where XLA's TPU cost model puts a compiled step's time: the estimated cycles it writes on each
    top-level instruction (a fusion's `backend_config`), those inside a while loop times the loop's
    trip count (nested loops multiplied out), summed by `_op_label`; the `top` labels as
    (label, share of all such cycles), largest first. Collectives carry no cycle estimate and are left
    out. Empty for a program without estimates (GPU)."""
    computations = _computations(text)
    times = {name: 1 for name in computations}
    pending, seen = [_entry_name(text)], set()
    while pending:  # each computation's multiplier: its caller's x the trip count of the loop it is the body of
        name = pending.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for shape, opcode, rest, _ in computations[name]["ops"].values():
            if opcode != "while":
                continue
            body, condition = (re.search(rf"{key}=%?([\w.\-]+)", rest) for key in ("body", "condition"))
            if body and condition and condition.group(1) in computations:
                times[body.group(1)] = times[name] * _trip_count(computations[condition.group(1)])
                pending.append(body.group(1))
    cycles: dict[str, float] = {}
    for name, computation in computations.items():
        for shape, opcode, rest, _ in computation["ops"].values():
            estimate = _CYCLES.search(rest)
            if estimate:
                label = _op_label(opcode, rest)
                cycles[label] = cycles.get(label, 0.0) + int(estimate.group(1)) * times[name]
    total = sum(cycles.values())
    return [(label, c / total) for label, c in sorted(cycles.items(), key=lambda kv: -kv[1])[:top]] if total else []


def _entry_name(text: str) -> str:
    entry = re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M)
    return entry.group(1) if entry else ""


def _group_size(rest: str) -> int:
    """Devices per replica group of a collective: iota form `[G,S]<=[N]`, mesh form
    `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`, or an explicit `{{0,1},{2,3}}`."""
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if iota:
        return int(iota.group(2))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2)))
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    return len(explicit.group(1).split(",")) if explicit else 0


def _called(rest: str, computations: dict) -> Optional[dict]:
    """The computation a fusion calls."""
    called = re.search(r"calls=%([\w.\-]+)", rest)
    return computations.get(called.group(1)) if called else None


def _placed_in_zeros(comp: dict, name: str, computations: dict) -> bool:
    """`name` is a dynamic-update-slice (the result of one, or of a fusion whose root is one, or one
    output of a multi-output fusion whose tuple holds one there), through copies, bitcasts and converts:
    the partitioner's way of laying a shard into a zeroed whole array."""
    for _ in range(8):
        shape, opcode, rest, operands = comp["ops"].get(name, (None, None, "", ()))
        producer = comp["ops"].get(operands[0], (None, None, "", ())) if operands else None
        if opcode == "fusion" and _called(rest, computations):
            comp = _called(rest, computations)
            name = comp["root"]
        elif opcode == "get-tuple-element" and producer[1] == "fusion" and _called(producer[2], computations):
            comp = _called(producer[2], computations)
            root = comp["ops"].get(comp["root"], (None, None, "", ()))
            if root[1] != "tuple":
                return False
            name = root[3][int(re.search(r"index=(\d+)", rest).group(1))]
        elif opcode in _PASS_THROUGH and operands:
            name = operands[0]
        else:
            return opcode == "dynamic-update-slice"
    return False


def _only_sliced(comp: dict, value: str, computations: dict, depth: int = 0) -> bool:
    """Every use of `value` keeps a dynamic-slice of it: directly, through copies, bitcasts and
    converts, or inside the fusions it is passed to."""
    uses = comp["users"].get(value, [])
    if not uses or depth > 8:
        return False
    for use in uses:
        _, opcode, rest, operands = comp["ops"][use]
        if opcode == "dynamic-slice" and operands[0] == value:
            continue
        if opcode in _PASS_THROUGH and _only_sliced(comp, use, computations, depth + 1):
            continue
        body = _called(rest, computations) if opcode == "fusion" else None
        if body and all(_only_sliced(body, body["params"].get(i), computations, depth + 1)
                        for i, o in enumerate(operands) if o == value):
            continue
        return False
    return True


def all_reduce_forms(text: str) -> list[dict]:
    """What each array an all-reduce of compiled HLO sums does, one record per array (a combined
    all-reduce sums several): {"form", "array", "bytes", "group_size", "op_name", "computation"}.

    XLA's SPMD partitioner and XLA TPU write some all-gathers and reduce-scatters as all-reduces:
    libtpu 0.0.42.1 lowers a small all-gather (a norm's scale), or any all-gather over 64 chips or
    more of a slice without wraparound links (`Target.wraparound`), as an all-reduce of the device's
    shard written into zeros (a dynamic-update-slice), and a reduce-scatter over a whole v5p slice as
    an all-reduce of the whole array of which each device keeps its own slice (a dynamic-slice). The
    forms:

      "gather"   the summed array is a dynamic-update-slice (a shard placed in zeros): an all-gather;
      "scatter"  every use of the sum slices it (dynamic-slice, also inside a fusion): a reduce-scatter;
      "sum"      anything else: partial results summed whole (a loss, a norm's gradient, or, where
                 the plan says all-gather or reduce-scatter, a sharding mistake).

    All-reduces inside TPU's reduce-scatter fusions (`read_hlo` counts those as reduce-scatters) are
    left out."""
    computations = _computations(text)
    records = []
    for cname, comp in computations.items():
        if cname.startswith(_REDUCE_SCATTER_FUSION):
            continue
        ops, users = comp["ops"], comp["users"]
        for name, (shape, opcode, rest, operands) in ops.items():
            if opcode not in ("all-reduce", "all-reduce-start"):
                continue
            arrays = shape_arrays(shape)
            outputs = [name] if len(arrays) == 1 else [None] * len(arrays)
            if len(arrays) > 1:  # a tuple: its elements are read by get-tuple-element
                for use in users.get(name, []):
                    if ops[use][1] == "get-tuple-element":
                        outputs[int(re.search(r"index=(\d+)", ops[use][2]).group(1))] = use
            op_name = re.search(r'op_name="([^"]*)"', rest)
            for i, (dtype, dims) in enumerate(arrays):
                if i < len(operands) and _placed_in_zeros(comp, operands[i], computations):
                    form = "gather"
                elif outputs[i] is not None and _only_sliced(comp, outputs[i], computations):
                    form = "scatter"
                else:
                    form = "sum"
                records.append({"form": form, "array": f"{dtype}[{','.join(map(str, dims))}]",
                                "bytes": ITEMSIZE[dtype] * math.prod(dims), "group_size": _group_size(rest),
                                "op_name": op_name.group(1) if op_name else "", "computation": cname})
    return records


def unexpected_all_reduces(records: list[dict], *, min_bytes: int, expected_groups=()) -> list[dict]:
    """The "sum" records of `all_reduce_forms` that a sharded-data-parallel plan does not call for:
    at least `min_bytes` (a weight or an activation, not a loss or a norm's scale) and over a
    replica group whose size is not in `expected_groups` (e.g. the tensor axis, whose row-parallel
    projections sum partial products by design)."""
    return [r for r in records
            if r["form"] == "sum" and r["bytes"] >= min_bytes and r["group_size"] not in expected_groups]


# ---------------------------------------------------------------------------- compiling


def _per_chip_bytes(abstract_tree) -> int:
    """Bytes each device holds of a tree of ShapeDtypeStructs with shardings."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(abstract_tree))


def loop_factor(jaxpr) -> float:
    """A step's matmul FLOPs with every scan unrolled over those with each scan body once (1.0 without
    scans): what XLA's cost model, which counts a loop body once, is multiplied by."""
    once = dot_flops(jaxpr, unroll=False)
    return dot_flops(jaxpr) / once if once else 1.0


def _compile(jitted, *args):
    """(compiled, seconds, `loop_factor`)."""
    start = time.perf_counter()
    traced = jitted.trace(*args)
    compiled = traced.lower().compile()
    return compiled, time.perf_counter() - start, loop_factor(traced.jaxpr.jaxpr)


def cost_analysis(compiled) -> dict:
    """XLA's cost analysis of a compiled step as a dict (empty without one; the first of a list)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return dict(cost or {})


def memory_bytes(memory) -> int:
    """A compiled step's bytes per device from its `memory_analysis()`: arguments + outputs -
    donated (aliased) + temporaries."""
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)


def tally_forms(records: list[dict]) -> dict:
    """`all_reduce_forms` records by form: {"gather" / "scatter" / "sum": {"count", "bytes", "shapes"}}."""
    tally = {}
    for r in records:
        entry = tally.setdefault(r["form"], {"count": 0, "bytes": 0, "shapes": []})
        entry["count"] += 1
        entry["bytes"] += r["bytes"]
        if r["array"] not in entry["shapes"]:
            entry["shapes"].append(r["array"])
    return tally


def _fill(report: StepReport, compiled, target: Target, factor: float, expected_groups=None) -> None:
    mem = compiled.memory_analysis()
    report.argument_bytes, report.output_bytes = mem.argument_size_in_bytes, mem.output_size_in_bytes
    report.alias_bytes, report.temp_bytes = mem.alias_size_in_bytes, mem.temp_size_in_bytes
    report.total_bytes = memory_bytes(mem)
    report.fits = report.total_bytes <= report.hbm_bytes
    text = compiled.as_text()
    report.collectives, report.kernels, report.largest = read_hlo(text)
    report.time_by_op = time_by_op(text)
    forms = all_reduce_forms(text)
    report.all_reduce_forms = tally_forms(forms)
    if expected_groups is not None:
        report.unexpected = unexpected_all_reduces(forms, min_bytes=UNEXPECTED_MIN_BYTES,
                                                   expected_groups=expected_groups)
    cost = cost_analysis(compiled)
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
    if factor > 1.0:
        report.estimate_seconds = seconds * factor
        report.estimate_note = (f"XLA cost model x {factor:.1f}: it counts a scanned body once; the factor is "
                                "the step's matmul FLOPs (remat included) unrolled / with each scan once")
    if report.kernels:
        others = sorted({k["name"] for k in report.kernels if not k["name"].startswith("flash_attention")})
        report.estimate_note += ("; the flash kernels' time included, from their cost estimates (visible tiles)"
                                 + (f"; not that of {others} (no cost estimate: opaque to the cost model)"
                                    if others else ""))
    mfu = report.model_flops / (report.chips * target.chip.peak_flops * report.estimate_seconds)
    if mfu > 1.0:  # faster than the chips' peak: the estimate has left work out
        report.estimate_note = (f"refused: {report.estimate_seconds * 1e3:.3g} ms would be MFU {mfu:.0%}, above "
                                "peak; the loop factor (matmul FLOPs) cannot scale work XLA's cost model sees "
                                "once and the jaxpr does not count as a matmul, such as kernels inside a loop")
        report.estimate_seconds = None
        return
    report.mfu = mfu


def _oom(report: StepReport, error: Exception) -> None:
    """A compile the TPU compiler refused for memory: not fitting, with its own numbers."""
    text = " ".join(str(error).split())
    report.fits = False
    report.error = text[:400]
    used = re.search(r"Used ([\d.]+)([GMK])? of ([\d.]+)([GMK])? hbm", text)
    if used:
        scale = {"G": GiB, "M": 1 << 20, "K": 1 << 10, None: 1}
        report.total_bytes = int(float(used.group(1)) * scale[used.group(2)])


def has_flash_kernels(kernels: list) -> bool:
    """Whether `read_hlo`'s kernel calls include tfm's flash-attention kernels."""
    return any(k["name"].startswith("flash_attention") for k in kernels)


def _kernels_apart(report: StepReport, trainer, jitted, args, factor: float) -> None:
    """The estimate without the flash kernels' time: the step compiled again with their cost estimates
    left off (XLA's cost model then scores each kernel at 0 s), times the same loop factor; the kernels'
    part is the difference. Without flash kernels in the step there is nothing to take apart (part 0, no
    second compile)."""
    if report.estimate_seconds is None:
        return
    without = report.estimate_seconds
    if has_flash_kernels(report.kernels):
        with trainer.context(), flash_attention.without_cost_estimates():
            compiled, seconds, _ = _compile(jitted, *args)
        report.compile_seconds += seconds
        without = cost_analysis(compiled)["optimal_seconds"] * factor
    report.estimate_seconds_without_kernels = without
    report.kernel_seconds = report.estimate_seconds - without


UNEXPECTED_MIN_BYTES = 1 << 20  # a summed array this large is a weight's or an activation's, not a loss's


def sharded_data_groups(trainer) -> Optional[tuple[int, ...]]:
    """Replica-group sizes over which a step may sum weight- or activation-sized arrays, or None when
    its plan sums gradients whole anyway (no fsdp: data parallelism all-reduces them). Under fsdp the
    plan gathers weights and reduce-scatters gradients over the batch axes, so a big sum is expected
    only over the tensor axis (row-parallel projections) and the data axis (hybrid FSDP: params are
    replicated over `data`, whose devices sum their gradient shards). Groups are told apart by size
    alone: a mesh whose tensor or data axis has the size of another axis can hide a wrong sum."""
    styles = parse_parallelism(trainer.config.parallelism)
    if "fsdp" not in styles:
        return None
    return tuple(trainer.mesh.shape[axis] for axis in ("tensor", "data")
                 if trainer.mesh.shape[axis] > 1 and (axis == "data" or axis in styles))


def check_step(trainer, batch: dict, target: Target, *, with_eval: bool = True,
               kernels_apart: bool = False) -> list[StepReport]:
    """Compile `trainer`'s train step (and eval step) for `batch` (global ShapeDtypeStructs) on
    the target; one StepReport each. The trainer's mesh must be over target.devices().
    `kernels_apart` (TPU, where XLA has a cost model): a step with flash kernels is compiled twice to
    report their part of the estimate (`estimate_seconds_without_kernels`, `kernel_seconds`)."""
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
                compiled, report.compile_seconds, factor = _compile(jitted, *args)
        except Exception as e:  # noqa: BLE001 - the compiler's refusal is the finding
            report.compile_seconds = time.perf_counter() - start
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            _oom(report, e)
        else:
            _fill(report, compiled, target, factor, sharded_data_groups(trainer))
            if kernels_apart:
                _kernels_apart(report, trainer, jitted, args, factor)
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
