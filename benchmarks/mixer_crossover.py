"""Where the linear-time mixers overtake attention: one layer's token mixing at one width, forward and
forward+backward, L 1k-128k: tfm's flash attention against Mamba-2's SSD and gated DeltaNet (tfm's chunked
forms and its Pallas SSD kernels), beside flash-linear-attention's Triton kernels and cuDNN attention.

    python -m benchmarks.mixer_crossover --out DIR            # measured on this machine's device
    make gpu-mixers                                           # the same on the GPU machine (< 9 min)
    python -m benchmarks.mixer_crossover --smoke --out DIR    # CPU, tiny shapes, Pallas interpreted
    python -m benchmarks.mixer_crossover --compile-only v5p-8,h100-1 --out DIR   # estimates, any CPU

Token mixing only (no projections, convolution, norm or gate), bf16 inputs, width D (--width, 2048):
  attention       causal, D/128 heads of 128: q, k, v [B, L, N, H]
  SSD             D/64 heads of P 64, state S 128, one B/C group: x [B, L, D/64, 64], dt [B, L, D/64],
                  A [D/64], B, C [B, L, 1, 128] (Mamba-2's layer at model width D/2, expand 2)
  gated DeltaNet  D/128 heads, K = V = 128: q, k (L2-normalised), v [B, L, h, 128], g, beta [B, L, h]
B = max(1, --tokens / L) (16,384), so that short rows still fill the device. Forward+backward: the
gradients of sum(output) with respect to every floating input. Chunk 64 tokens (--chunk; tfm's Pallas
SSD on TPU: 128, its smallest tile there). flash-linear-attention: `chunk_gated_delta_rule`, and for SSD
`chunk_simple_gla` (Mamba-2's scan is a simple GLA: q = C, k = B, v = x dt, log decay dt A; B and C
expanded to the heads).

Measured: the mean of --iters steps after a warm-up; peak = XLA's compiled arguments + outputs +
temporaries (JAX), torch's peak allocated (flash-linear-attention). Compile-only (--compile-only
TARGETS, `tfm.preflight.targets`): each point compiled for one chip and never run; its estimate is
max(FLOPs / peak FLOP/s, bytes / HBM bandwidth) of the chip. TPU: FLOPs and bytes are XLA's cost analysis
(the Pallas kernels by their cost estimates; a loop body counted once, so the chunked scans' state pass
is undercounted). GPU, where XLA gives none: counted from the compiled program
(`benchmarks.step_profile.breakdown`: every kernel, a loop body times its trip count), the Triton calls,
which keep no cost estimate there, by their Pallas cost estimates read from the jaxpr. The memory
analysis's temporaries are reported beside it.

The crossover of a mixer: the shortest L from which it is faster than the fastest attention at every
longer L measured, interpolated log-log between that L and the one before (exact for power laws).

DIR gets rows.jsonl (a JSON line per point as it finishes, also logged), and after each length
report.md (tables, crossovers, ratios ours / flash-linear-attention's and tfm's / cuDNN's attention) and
mixer_crossover.png (time and peak memory against L). Lengths run coarse to fine; once --budget-s is
spent the rest are skipped, leaving gaps rather than a cut-off.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import sys
import time
from typing import NamedTuple, Optional

from benchmarks import attention as attention_bench
from benchmarks import gpu_check
from benchmarks.step_profile import breakdown
from tfm.preflight.analysis import cost_analysis
from tfm.preflight.targets import parse_target, use_plugins

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tfm.ops.delta_rule import gated_delta_rule
from tfm.ops.ssd import ssd
from tfm.parallel.mesh import MeshConfig, make_mesh

# impl -> the token mixer it computes
FAMILY = {"tfm pallas": "attention", "tfm hopper": "attention", "jax cudnn": "attention", "tfm chunked": "attention",
          "tfm xla": "attention", "ssd chunked": "ssd", "ssd pallas": "ssd", "fla ssd": "ssd",
          "gdn chunked": "gdn", "fla gdn": "gdn"}
DEFAULT_IMPLS = {"gpu": ("tfm hopper", "tfm pallas", "jax cudnn", "ssd chunked", "ssd pallas", "fla ssd",
                         "gdn chunked", "fla gdn"),
                 "tpu": ("tfm pallas", "ssd chunked", "ssd pallas", "gdn chunked"),
                 "cpu": ("tfm chunked", "tfm xla", "ssd chunked", "gdn chunked")}
OURS_VS_THEIRS = (("ssd chunked", "fla ssd"), ("ssd pallas", "fla ssd"), ("gdn chunked", "fla gdn"),
                  ("tfm hopper", "jax cudnn"), ("tfm pallas", "jax cudnn"))
LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
LENGTH_ORDER = (4096, 16384, 1024, 65536, 8192, 2048, 32768, 131072)  # coarse to fine (others after)
FULL = dict(H=128, P=64, S=128)  # attention / DeltaNet head dim, SSD head dim and state
SMOKE = dict(H=16, P=8, S=16)


class Shape(NamedTuple):
    B: int
    L: int
    D: int
    H: int   # attention and gated DeltaNet head dim
    P: int   # SSD head dim
    S: int   # SSD state size


def shape_of(L: int, width: int, tokens: int, dims: dict) -> Shape:
    for name, d in (("width", dims["H"]), ("width", dims["P"])):
        if width % d:
            raise ValueError(f"--{name} {width} is not a multiple of the head dim {d}: pick a multiple of {dims['H']}")
    return Shape(max(1, tokens // L), L, width, **dims)


def input_specs(family: str, s: Shape) -> list[tuple[tuple, str, str]]:
    """(shape, dtype, kind) of each input of `family`'s mixer; kinds say how `inputs` draws it."""
    if family == "attention":
        return [((s.B, s.L, s.D // s.H, s.H), "bfloat16", "normal")] * 3
    if family == "ssd":
        n = s.D // s.P
        return [((s.B, s.L, n, s.P), "bfloat16", "normal"), ((s.B, s.L, n), "float32", "dt"),
                ((n,), "float32", "A"), ((s.B, s.L, 1, s.S), "bfloat16", "normal"),
                ((s.B, s.L, 1, s.S), "bfloat16", "normal")]
    h = s.D // s.H
    return [((s.B, s.L, h, s.H), "bfloat16", "unit"), ((s.B, s.L, h, s.H), "bfloat16", "unit"),
            ((s.B, s.L, h, s.H), "bfloat16", "normal"), ((s.B, s.L, h), "float32", "log decay"),
            ((s.B, s.L, h), "float32", "beta")]


def draw(kind: str, z: np.ndarray) -> np.ndarray:
    """An input of `kind` from standard normals z: dt > 0, A < 0, log decay <= 0, beta in (0, 1), unit:
    rows of norm 1."""
    return {"normal": lambda: z, "unit": lambda: z / np.linalg.norm(z, axis=-1, keepdims=True),
            "dt": lambda: np.logaddexp(z - 2.0, 0.0), "A": lambda: -np.exp(z * 0.5),
            "log decay": lambda: -np.logaddexp(z - 3.0, 0.0), "beta": lambda: 1 / (1 + np.exp(-z))}[kind]()


@functools.lru_cache(maxsize=len(set(FAMILY.values())))
def inputs(family: str, s: Shape) -> tuple:
    """The mixer's inputs as JAX arrays on the default device (drawn on the host: no compile), kept for
    the family's other impls and passes at this shape."""
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(draw(kind, rng.standard_normal(shape, np.float32)).astype(jnp.dtype(dtype)))
                 for shape, dtype, kind in input_specs(family, s))


def chunk_for(impl: str, chunk: int, target_platform: str) -> int:
    """tfm's Pallas SSD tiles chunks of at least 128 on TPU (`tfm.kernels.ssd.check_chunk`)."""
    return max(chunk, 128) if impl == "ssd pallas" and target_platform == "tpu" else chunk


def jax_forward(impl: str, chunk: int, target_platform: str):
    """forward(*inputs) -> output of one JAX implementation, or raises gpu_check.Unavailable."""
    family = FAMILY[impl]
    if family == "attention":
        return gpu_check.jax_forward(impl, causal=True)
    form = impl.split()[1]
    if family == "ssd":
        size = chunk_for(impl, chunk, target_platform)
        return lambda x, dt, A, B, C: ssd(x, dt, A, B, C, impl=form, chunk_size=size)[0]
    return lambda q, k, v, g, beta: gated_delta_rule(q * q.shape[-1] ** -0.5, k, v, g, beta, impl=form,
                                                     chunk_size=chunk)[0]


# ---------------------------------------------------------------- measured

def measure_jax(impl: str, s: Shape, backward: bool, iters: int, chunk: int) -> tuple[float, Optional[float]]:
    """(ms per step, peak MiB) of a JAX implementation on this machine's default device."""
    forward = jax_forward(impl, chunk, jax.default_backend())
    args = inputs(FAMILY[impl], s)
    seconds, peak = attention_bench.time_step(forward, args, backward, iters, argnums=tuple(range(len(args))))
    return seconds * 1e3, peak


def fla_step(impl: str, s: Shape, backward: bool):
    """A step of flash-linear-attention's Triton kernel for `impl` on CUDA, or raises gpu_check.Unavailable."""
    if jax.default_backend() != "gpu":  # (and torch, seconds to import, is left alone)
        raise gpu_check.Unavailable(f"flash-linear-attention is timed beside JAX on a GPU (JAX backend is "
                                    f"{jax.default_backend()})")
    try:
        import torch
    except ImportError as e:
        raise gpu_check.Unavailable(gpu_check.short(e))
    if not torch.cuda.is_available():
        raise gpu_check.Unavailable(f"flash-linear-attention's Triton kernels need CUDA (torch {torch.__version__} has none)")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:
        raise gpu_check.Unavailable(f"{gpu_check.short(e)} (carry wheels/fla_core-*.whl; see the Makefile's gpu-mixers)")
    xs = [torch.from_dlpack(x).requires_grad_(backward) for x in inputs(FAMILY[impl], s)]  # ours, shared
    if impl == "fla gdn":
        q, k, v, g, beta = xs
        forward = lambda: chunk_gated_delta_rule(q, k, v, g, beta.to(q.dtype), scale=s.H ** -0.5)[0]
    else:
        x, dt, A, B, C = xs
        heads = x.shape[2]

        def forward():  # Mamba-2's scan as a simple GLA, B and C shared by all heads
            v = (x * dt[..., None]).to(x.dtype)
            q, k = (a.expand(-1, -1, heads, -1).contiguous() for a in (C, B))  # its kernels read [B, T, H, K] dense
            return chunk_simple_gla(q, k, v, g=dt * A, scale=1.0)[0]

    def step():
        out = forward()
        if backward:
            torch.autograd.grad(out.float().sum(), xs)
    return step


def measure_fla(impl: str, s: Shape, backward: bool, iters: int) -> tuple[float, float]:
    """(ms per step, torch's peak MiB) of flash-linear-attention's kernel."""
    step = fla_step(impl, s, backward)
    torch = sys.modules["torch"]
    torch.cuda.reset_peak_memory_stats()
    try:
        seconds = gpu_check.torch_seconds(step, iters)
    finally:
        del step
        gpu_check.release_memory()
    return seconds * 1e3, torch.cuda.max_memory_allocated() / 2**20


def measure(impl: str, s: Shape, backward: bool, iters: int, chunk: int) -> dict:
    """The row fields (ms, peak) of one measured point."""
    if impl.startswith("fla "):
        ms, peak = measure_fla(impl, s, backward, iters)
    else:
        ms, peak = measure_jax(impl, s, backward, iters, chunk)
    return dict(ms=ms, peak=peak)


# ---------------------------------------------------------------- compile-only estimates

def kernel_costs(jaxpr) -> tuple[float, float]:
    """(FLOPs, bytes) the Pallas kernels of `jaxpr` declare in their cost estimates, a scan's body
    times its length: what the compiled program keeps of them on TPU, and nothing of on GPU."""
    flops = nbytes = 0.0
    for eqn in jaxpr.eqns:
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        if eqn.primitive.name == "pallas_call" and eqn.params.get("cost_estimate") is not None:
            flops, nbytes = flops + eqn.params["cost_estimate"].flops, nbytes + eqn.params["cost_estimate"].bytes_accessed
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    f, b = kernel_costs(inner)
                    flops, nbytes = flops + times * f, nbytes + times * b
    return flops, nbytes


def estimate(flops: float, nbytes: float, chip) -> tuple[float, str]:
    """(seconds, bound): max(FLOPs / peak, bytes / bandwidth) of `chip` and which term is larger."""
    compute, memory = flops / chip.peak_flops, nbytes / chip.hbm_bandwidth
    return max(compute, memory), "compute" if compute >= memory else "memory"


def compile_point(impl: str, s: Shape, backward: bool, target, devices, chunk: int) -> dict:
    """The row fields of one point compiled for one compile-only chip of `target`."""
    family = FAMILY[impl]
    forward = jax_forward(impl, chunk, target.chip.platform)
    mesh = make_mesh(MeshConfig(), devices[:1])
    whole = NamedSharding(mesh, P())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=whole) for shape, dtype, _ in input_specs(family, s)]
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        traced = attention_bench.step_fn(forward, backward, tuple(range(len(args)))).trace(*args)
        compiled = traced.lower().compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = cost_analysis(compiled)
    if cost.get("flops") is not None:  # TPU: XLA's cost model, the Pallas kernels by their cost estimates
        flops, nbytes, note = cost["flops"], cost["bytes accessed"], "XLA cost analysis (a loop body once)"
    else:  # GPU: counted from the program, loop bodies times their trips
        kernels, _ = breakdown(compiled.as_text())
        flops = sum(k.flops * k.count for k in kernels)
        nbytes = sum(k.bytes * k.count for k in kernels)
        opaque = [k for k in kernels if not k.flops_known and "pallas_call" in k.op_name + k.name]
        kernel_flops, kernel_bytes = kernel_costs(traced.jaxpr.jaxpr) if opaque else (0.0, 0.0)
        flops += kernel_flops  # Triton calls keep no cost estimate in the program; the jaxpr has them
        nbytes += kernel_bytes - sum(k.bytes * k.count for k in opaque)
        unknown = sorted({k.name for k in kernels if not k.flops_known} - {k.name for k in opaque})
        note = (f"{len(opaque)} Triton kernel(s) by their cost estimates" if opaque else "") + (
            f"; FLOPs unknown, counted 0: {', '.join(unknown)}" if unknown else "")
    est, bound = estimate(flops, nbytes, target.chip)
    return dict(ms=est * 1e3, bound=bound, flops=flops, bytes=nbytes, xla_flops=cost.get("flops"),
                xla_bytes=cost.get("bytes accessed"), temp=memory.temp_size_in_bytes / 2**20,
                peak=(memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes) / 2**20,
                compile_s=seconds, note=note)


# ---------------------------------------------------------------- crossover and report

def crossover(mixer: dict, attention: dict) -> tuple[Optional[float], str]:
    """(L, text): where the mixer's times {L: ms} fall below attention's for good, interpolated log-log
    between the last L where attention is faster and the next; None when not bracketed."""
    Ls = sorted(set(mixer) & set(attention))
    if not Ls:
        return None, "no length with both"
    ratio = [math.log(mixer[L] / attention[L]) for L in Ls]
    if ratio[-1] > 0:
        return None, f"attention faster up to L {Ls[-1]:,} (the longest)"
    k = max((i for i, r in enumerate(ratio) if r > 0), default=None)
    if k is None:
        return None, f"≤ {Ls[0]:,} (mixer faster at every L, from the shortest)"
    t = ratio[k] / (ratio[k] - ratio[k + 1])
    L = math.exp(math.log(Ls[k]) + t * (math.log(Ls[k + 1]) - math.log(Ls[k])))
    return L, f"≈ {L:,.0f} (attention faster at {Ls[k]:,}, the mixer at {Ls[k + 1]:,} and beyond)"


def fastest_attention(rows: list[dict], device: str, pass_: str) -> dict:
    """{L: (ms, impl)} of the fastest attention impl at each L."""
    best = {}
    for r in rows:
        if (r["device"], r["pass"]) == (device, pass_) and FAMILY[r["impl"]] == "attention" and r.get("ms"):
            if r["L"] not in best or r["ms"] < best[r["L"]][0]:
                best[r["L"]] = (r["ms"], r["impl"])
    return best


def report(rows: list[dict], head: list[str], estimates: bool) -> list[str]:
    """Markdown: per device and pass a table of ms (peak MiB) by L and impl, the crossovers, and the
    ratios ours / theirs (measured) or the cost figures (estimates)."""
    lines = list(head)
    unit = "estimated ms" if estimates else "ms"
    for device in dict.fromkeys(r["device"] for r in rows):
        for pass_ in ("fwd", "fwd+bwd"):
            mine = [r for r in rows if (r["device"], r["pass"]) == (device, pass_)]
            impls = list(dict.fromkeys(r["impl"] for r in mine))
            cell = {(r["L"], r["impl"]): r for r in mine}
            lines += ["", f"### {device}, {pass_}: {unit} (peak MiB)", ""]
            body = []
            for L in sorted({r["L"] for r in mine}):
                B = next(r["B"] for r in mine if r["L"] == L)
                body.append([f"{L:,}", B] + [point_text(cell.get((L, i))) for i in impls])
            lines += gpu_check.table(["L", "B"] + impls, body)
            best = fastest_attention(rows, device, pass_)
            if best:
                lines += ["", "Crossover against the fastest attention at each L ("
                          + ", ".join(f"{L:,}: {impl}" for L, (_, impl) in sorted(best.items())) + "):", ""]
                for impl in impls:
                    if FAMILY[impl] != "attention":
                        times = {r["L"]: r["ms"] for r in mine if r["impl"] == impl and r.get("ms")}
                        lines.append(f"- {impl}: {crossover(times, {L: t for L, (t, _) in best.items()})[1]}")
            if not estimates:
                lines += ratio_lines(mine)
    if estimates:
        lines += ["", "Cost figures per point: FLOPs and bytes counted from the compiled program (the estimate's), "
                  "XLA's cost analysis (a loop body once; GPU: none), temporaries (memory analysis), compile time.", ""]
        lines += gpu_check.table(
            ["device", "pass", "impl", "L", "B", "GFLOP", "GB", "XLA GFLOP", "XLA GB", "temp MiB", "est. ms", "bound",
             "compile s", "note"],
            [[r["device"], r["pass"], r["impl"], f"{r['L']:,}", r["B"], fmt(r.get("flops"), 1e9), fmt(r.get("bytes"), 1e9),
              fmt(r.get("xla_flops"), 1e9), fmt(r.get("xla_bytes"), 1e9), fmt(r.get("temp"), 1, ".0f"),
              fmt(r.get("ms"), 1, ".3f"), r.get("bound", ""), fmt(r.get("compile_s"), 1, ".0f"),
              (r.get("note") or r["status"]) if r.get("ms") is None else r.get("note", "")]
             for r in rows])
    return lines


def fmt(value, scale: float, spec: str = ".2f") -> str:
    return "" if value is None else format(value / scale, spec)


def point_text(r: Optional[dict]) -> str:
    if r is None:
        return ""
    if r.get("ms") is None:
        return r["status"]
    return f"{r['ms']:.3f}" + ("" if r.get("peak") is None else f" ({mib(r['peak'])})")


def mib(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def ratio_lines(mine: list[dict]) -> list[str]:
    """Speed ratios theirs ms / ours ms (> 1: ours faster) per L, for the pairs measured."""
    ms = {(r["L"], r["impl"]): r["ms"] for r in mine if r.get("ms")}
    pairs = [(a, b) for a, b in OURS_VS_THEIRS if any((L, a) in ms and (L, b) in ms for L, _ in ms)]
    if not pairs:
        return []
    body = [[f"{L:,}"] + [f"{ms[L, b] / ms[L, a]:.2f}" if (L, a) in ms and (L, b) in ms else "" for a, b in pairs]
            for L in sorted({L for L, _ in ms})]
    return ["", "Speed of ours over theirs (their ms / our ms; > 1: ours faster):", ""] + gpu_check.table(
        ["L"] + [f"{a} vs {b}" for a, b in pairs], body)


def plot(rows: list[dict], path: str, title: str, estimates: bool) -> None:
    """Time and peak memory against L (benchmarks.attention.plot), a line per device and impl."""
    devices = list(dict.fromkeys(r["device"] for r in rows))
    points = [dict(r, causal=True, H=None, impl=r["impl"] if len(devices) == 1 else f"{r['device'].split(' (')[0]}: {r['impl']}")
              for r in rows if r.get("ms")]
    if points:
        attention_bench.plot(points, path, title, value="ms", log_y=True,
                             ylabel="estimated ms per step" if estimates else "ms per step")


# ---------------------------------------------------------------- the run

def ordered(lengths) -> list[int]:
    return sorted(lengths, key=lambda L: (LENGTH_ORDER.index(L) if L in LENGTH_ORDER else len(LENGTH_ORDER), L))


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="mixer_crossover_out", help="directory for rows.jsonl, report.md and the plot")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (D 64, heads of 16), L 32 and 64, 2 iterations")
    parser.add_argument("--compile-only", default=None, metavar="TARGETS",
                        help="comma-separated compile-only targets (e.g. v5p-8,h100-1): estimates, nothing runs")
    parser.add_argument("--impls", default=None, help="comma-separated, from " + ", ".join(FAMILY))
    parser.add_argument("--lengths", default=None, help="comma-separated L (default 1k..128k; smoke 32,64)")
    parser.add_argument("--width", type=int, default=None, help="D, the mixed width (default 2048; smoke 64)")
    parser.add_argument("--tokens", type=int, default=None, help="B = max(1, tokens / L) (default 16384; smoke 64)")
    parser.add_argument("--chunk", type=int, default=None, help="the mixers' chunk (default 64; smoke 16)")
    parser.add_argument("--iters", type=int, default=None, help="timed steps per point (default 10; smoke 2)")
    parser.add_argument("--passes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting points after this many seconds")
    args = parser.parse_args(argv)
    impls = None if args.impls is None else tuple(args.impls.split(","))
    if impls and set(impls) - set(FAMILY):
        parser.error(f"--impls: unknown {sorted(set(impls) - set(FAMILY))}; choose from {', '.join(FAMILY)}")
    try:
        lengths = (tuple(int(x) for x in args.lengths.split(",")) if args.lengths else (32, 64) if args.smoke else LENGTHS)
    except ValueError:
        parser.error(f"--lengths {args.lengths!r}: expected comma-separated integers, e.g. 1024,4096")
    passes = args.passes.split(",")
    if not passes or set(passes) - {"fwd", "fwd+bwd"}:
        parser.error(f"--passes {args.passes!r}: choose from fwd, fwd+bwd (comma-separated)")
    dims = SMOKE if args.smoke else FULL
    width, tokens = args.width or (64 if args.smoke else 2048), args.tokens or (64 if args.smoke else 16384)
    chunk, iters = args.chunk or (16 if args.smoke else 64), args.iters or (2 if args.smoke else 10)
    try:
        shapes = [shape_of(L, width, tokens, dims) for L in ordered(lengths)]
    except ValueError as e:
        parser.error(str(e))
    if args.compile_only:
        use_plugins()  # the compile-only TPU/GPU compilers, before JAX starts its backends
        jax.config.update("jax_platforms", "cpu")  # compile-only devices beside the CPU; nothing runs
        try:
            targets = [parse_target(name) for name in args.compile_only.split(",")]
        except ValueError as e:
            parser.error(f"--compile-only: {e}")
    os.makedirs(args.out, exist_ok=True)
    if not args.smoke:  # a rerun compiles less
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.out, "jax_cache"))
    rows_path = os.path.join(args.out, "rows.jsonl")
    open(rows_path, "w").close()
    estimates = bool(args.compile_only)
    head = [f"# Token mixers against attention{' (compile-only estimates)' if estimates else ''}"
            f"{' (SMOKE: tiny shapes, no meaning for speed)' if args.smoke else ''}", "",
            f"- date: {datetime.date.today()}",
            f"- command: `python -m benchmarks.mixer_crossover {' '.join(argv)}`",
            f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
            + ("targets: " + ", ".join(t.describe() for t in targets) if estimates else
               f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), driver {gpu_check.driver()}"),
            f"- versions: {gpu_check.versions()}{fla_version()}",
            f"- width D {width}, tokens per step {tokens} (B = max(1, tokens / L)), chunk {chunk}, bf16 inputs, causal; "
            f"heads: attention {width // dims['H']} x {dims['H']}, SSD {width // dims['P']} x P {dims['P']} "
            f"(state {dims['S']}), gated DeltaNet {width // dims['H']} x {dims['H']}"
            + ("" if estimates else f"; mean of {iters} steps after a warm-up")]
    budget = gpu_check.Budget(args.budget_s)
    rows = []
    plan = ([((t, t.devices()), t.chip.name + " (compile-only)", t.chip.platform) for t in targets] if estimates
            else [(None, jax.devices()[0].device_kind, jax.default_backend())])
    for s in shapes:
        for target, device, where in plan:
            for backward in [p == "fwd+bwd" for p in passes]:
                for impl in impls or DEFAULT_IMPLS[where]:
                    row = dict(device=device, impl=impl, L=s.L, B=s.B, ms=None, peak=None,
                               **{"pass": "fwd+bwd" if backward else "fwd"})
                    if budget.spent():
                        row["status"] = budget.skipped()
                    else:
                        row["status"] = point(row, impl, s, backward, iters, chunk, target)
                    rows.append(row)
                    with open(rows_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    gpu_check.log(f"mixers  {device[:24]:24} {impl:12} {row['pass']:8} L {s.L:7} B {s.B:3} {row['status']}")
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write("\n".join(report(rows, head, estimates)) + "\n")
        plot(rows, os.path.join(args.out, "mixer_crossover.png"),
             f"token mixing at D {width}{', estimates' if estimates else ''}{', SMOKE' if args.smoke else ''}", estimates)
    gpu_check.log(f"report written to {os.path.join(args.out, 'report.md')}")
    return 0


def point(row: dict, impl: str, s: Shape, backward: bool, iters: int, chunk: int, target) -> str:
    """Measures or compiles (target: (Target, its compile-only devices)) one point into row; returns its status."""
    try:
        if target is None:
            row.update(measure(impl, s, backward, iters, chunk))
            gpu_check.release_memory()
        else:
            row.update(compile_point(impl, s, backward, *target, chunk))
    except gpu_check.Unavailable as e:
        return f"unavailable: {e}"
    except Exception as e:  # out of memory, a kernel that does not lower: shown, not fatal
        gpu_check.log_traceback(e, lines=6)
        return f"error: {gpu_check.short(e)}"
    return f"{row['ms']:.3f} ms" + ("" if row.get("peak") is None else f", peak {mib(row['peak'])} MiB")


def fla_version() -> str:
    import importlib.metadata
    try:
        return f", fla-core {importlib.metadata.version('fla-core')}"
    except importlib.metadata.PackageNotFoundError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
