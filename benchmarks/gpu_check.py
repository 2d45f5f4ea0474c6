"""One command that proves tfm on an NVIDIA GPU: attention correctness, attention throughput,
train step and decode against PyTorch, and the `impl="auto"` rules the figures support.

On the GPU machine (its image has jax 0.11/0.12 with CUDA, torch, transformers and Triton, and
reaches no package registry), from the repository root:

    pip install --no-deps -e .
    pip install --no-deps wheels/*.whl           # the carried packages, see below
    python -m benchmarks.gpu_check --out gpu_check_out          # or: make gpu-check
    python -m benchmarks.gpu_check --only correctness,attention # a part, with less GPU time

It writes gpu_check_out/report.md (markdown ready for benchmarks/RESULTS.md: device, driver,
versions, date, the exact command, one section per part) and gpu_check_out/attention.png, and
exits 1 if any correctness case fails (exceeds its tolerance, gives NaN or raises). Each
section stops starting cases once its time budget (BUDGET_S, about 17 minutes in all, times
--budget-scale) is spent. On a fresh H100 (2026-11-24) compiles dominate: correctness,
attention and auto took 400 s, train and decode 390 s at smaller budgets; under a 10-minute
limit per command run it as two commands, `--only correctness,attention,auto` and `--only
train,decode`. A case not reached reads "skipped"; one that cannot run here (cuDNN without a
GPU, torch without CUDA, an import failing) "unavailable: reason". The report is rewritten
after each section, so a run cut short still leaves the finished sections.

Carried packages. On the image of 2026-11-24 (jax 0.11.2 with CUDA 13, flax 0.12.10, torch
2.11.0, transformers 5.17.0) none were needed: `PYTHONPATH=. python3 -m benchmarks.gpu_check`
ran from the repository root without any install. Otherwise: the check imports only `tfm.ops`,
`tfm.models`, `tfm.decode`, `tfm.train` and `tfm.preflight.analysis` (never tfm.data, experiments, TFDS, Grain,
SentencePiece, sacreBLEU or ml_collections). Beyond jax, numpy, torch and transformers these
import flax, optax, absl-py, treescope, rich (markdown-it-py, mdurl, pygments), msgpack and
PyYAML (both fall back to pure Python without their C extensions), etils, and for the train
section, through tfm.train's checkpoints, orbax-checkpoint, humanize, simplejson, protobuf,
googleapis-common-protos and the compiled tensorstore and uvloop (take wheels for the image's
Python version). Fetch them on any machine with a registry, then carry wheels/ along:

    pip download --no-deps --only-binary=:all: --python-version 3.X --platform manylinux2014_x86_64 \\
        -d wheels flax optax absl-py treescope rich markdown-it-py mdurl pygments msgpack PyYAML etils \\
        orbax-checkpoint humanize simplejson protobuf googleapis-common-protos tensorstore uvloop

Leave in wheels/ only what the image lacks (`python -c "import flax, optax, orbax.checkpoint"`
says), so that no package of the image is replaced: `make gpu-check` installs every wheel there.
A section whose imports fail is reported as unavailable, and the run goes on.

    python -m benchmarks.gpu_check --smoke --out DIR   # CPU, tiny shapes, Pallas interpreted (in make test)
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import os
import subprocess
import sys
import time
import traceback
from typing import NamedTuple, Optional

# JAX and torch share the GPU in one process: JAX takes memory as it needs it, up to half
# (its allocator keeps what it took), instead of 75% up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import attention as attention_bench
from tfm.kernels import flash_hopper
from tfm.ops import select
from tfm.ops.attention import alibi_slopes, dot_product_attention

SECTIONS = ("correctness", "attention", "train", "decode", "auto")
BUDGET_S = {"correctness": 210, "attention": 300, "train": 360, "decode": 180, "auto": 1}
# Relative error max|x - ref| / max|ref| allowed per dtype, for outputs and gradients alike.
# fp32 allows TF32 matmul units (10-bit mantissa) on the GPU.
TOLERANCE = {"bfloat16": 2e-2, "float32": 2e-3}
TFM_IMPLS = ("pallas", "hopper", "cudnn", "xla")
# The correctness section also checks the Hopper driver's other forward schedule (`flash_hopper.FORWARD_SCHEDULES`)
CHECKED_IMPLS = TFM_IMPLS[:2] + ("hopper pingpong",) + TFM_IMPLS[2:]


def log(text: str) -> None:
    print(text, flush=True)


class Selection(NamedTuple):
    """What a command narrows the sections to (None: everything): correctness cases whose name
    contains one of `cases`; throughput `impls`, head dims and lengths."""
    cases: Optional[tuple[str, ...]] = None
    impls: Optional[tuple[str, ...]] = None
    heads: Optional[tuple[int, ...]] = None
    lengths: Optional[tuple[int, ...]] = None
    dtype: str = "bfloat16"  # of the attention section's inputs
    models: Optional[tuple[str, ...]] = None  # the train section's


class Unavailable(Exception):
    """A case that cannot run on this machine (not a failure)."""


class Budget:
    """The seconds a section may spend; `spent` once they are."""

    def __init__(self, seconds: float):
        self.seconds, self.deadline = seconds, time.monotonic() + seconds

    def spent(self) -> bool:
        return time.monotonic() > self.deadline

    def skipped(self) -> str:
        return f"skipped: section budget of {self.seconds:.0f} s spent"


def log_traceback(error: BaseException, lines: int = 25) -> None:
    """The last `lines` lines of `error`'s traceback, for the command's log (the report keeps `short`)."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip().splitlines()
    log("\n".join("    | " + line for line in text[-lines:]))


def short(error: BaseException) -> str:
    """'Type: first line of the message', at most 120 characters of it."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:120] if lines else ''}"


def table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines."""
    cells = lambda row: "| " + " | ".join(str(c) for c in row) + " |"
    return [cells(header), "|" + "---|" * len(header), *map(cells, rows)]


# ---------------------------------------------------------------- 1. correctness

class Case(NamedTuple):
    """q [B, T, N, H]; k, v [B, S, K, H]; the mask features tfm's entry point takes."""
    name: str
    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    causal: bool = False
    packed: bool = False  # segment ids: three packed sequences, then padding (id 0)
    window: Optional[int] = None
    alibi: bool = False
    softcap: Optional[float] = None
    dropout: float = 0.0  # attention dropout; the reference drops the same (seed, position) hash


DROPOUT_SEED = 7


def correctness_cases(smoke: bool) -> list[Case]:
    if smoke:
        return [Case("causal GQA L 40", 2, 40, 40, 4, 2, 32, causal=True),
                Case("cross T 13 / S 29", 2, 13, 29, 4, 4, 32),
                Case("MQA H 80 L 17", 1, 17, 17, 4, 1, 80, causal=True),
                Case("packed segments + padding L 40", 2, 40, 40, 4, 2, 32, packed=True),
                Case("window 9 + ALiBi L 40", 1, 40, 40, 4, 4, 32, causal=True, window=9, alibi=True),
                Case("soft-cap 5 L 40", 1, 40, 40, 4, 2, 32, causal=True, softcap=5.0),
                Case("dropout 0.1 causal GQA L 40", 2, 40, 40, 4, 2, 32, causal=True, dropout=0.1)]
    # the two cases unrun on hardware until 2026-11-27 first, so a short budget reaches them
    return [Case("soft-cap 5 L 1024", 2, 1024, 1024, 8, 4, 128, causal=True, softcap=5.0),
            Case("dropout 0.1 causal GQA L 1024", 2, 1024, 1024, 8, 4, 64, causal=True, dropout=0.1),
            Case("dropout 0.1 packed L 1023", 2, 1023, 1023, 8, 8, 64, packed=True, dropout=0.1),
            Case("causal GQA L 1000", 2, 1000, 1000, 16, 4, 128, causal=True),
            Case("cross T 333 / S 777", 4, 333, 777, 8, 8, 64),
            Case("MQA H 80 L 513", 2, 513, 513, 8, 1, 80, causal=True),
            Case("packed segments + padding L 1023", 2, 1023, 1023, 8, 2, 64, packed=True),
            Case("window 256 + ALiBi L 1023", 2, 1023, 1023, 8, 8, 64, causal=True, window=256, alibi=True)]


def packed_segments(B: int, L: int) -> np.ndarray:
    """int32 [B, L]: sequences 1, 2, 3 of 30%, 40%, 20% of L, then padding 0."""
    a, b, c = int(0.3 * L), int(0.4 * L), int(0.2 * L)
    row = np.concatenate([np.full(a, 1), np.full(b, 2), np.full(c, 3), np.zeros(L - a - b - c)])
    return np.tile(row.astype(np.int32), (B, 1))


def case_inputs(case: Case) -> tuple[tuple, dict]:
    """((q, k, v, do) in fp32, already rounded to bf16; mask keyword arguments)."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shapes = [(case.B, case.T, case.N, case.H), (case.B, case.S, case.K, case.H),
              (case.B, case.S, case.K, case.H), (case.B, case.T, case.N, case.H)]
    arrays = tuple(jax.random.normal(key, shape, jnp.bfloat16).astype(jnp.float32)
                   for key, shape in zip(keys, shapes))
    masks = dict(causal=case.causal, window=case.window, softcap=case.softcap,
                 alibi_slopes=alibi_slopes(case.N) if case.alibi else None)
    if case.dropout:
        masks.update(dropout_rate=case.dropout, dropout_rng=jax.random.PRNGKey(DROPOUT_SEED))
    if case.packed:
        masks["q_segment_ids"] = masks["kv_segment_ids"] = jnp.asarray(packed_segments(case.B, case.T))
    return arrays, masks


def outputs_and_grads(impl: str, arrays: tuple, masks: dict, dtype) -> dict[str, np.ndarray]:
    """{"o", "dq", "dk", "dv"} of tfm's `impl` (CHECKED_IMPLS) at `dtype`, gradients of <o, do>; as fp32 numpy."""
    attend = tfm_attention(impl, **masks)

    def run(q, k, v, do):
        o, vjp = jax.vjp(attend, q, k, v)
        return (o, *vjp(do))
    results = jax.jit(run)(*(a.astype(dtype) for a in arrays))
    return {name: np.asarray(x.astype(jnp.float32)) for name, x in zip(("o", "dq", "dk", "dv"), results)}


def reference(arrays: tuple, masks: dict) -> dict[str, np.ndarray]:
    """The float32 xla result with Precision.HIGHEST matmuls, on the same device."""
    with jax.default_matmul_precision("highest"):
        return outputs_and_grads("xla", arrays, masks, jnp.float32)


def compare(got: dict[str, np.ndarray], ref: dict[str, np.ndarray], tolerance: float):
    """(relative error per array, problems): max|got - ref| / max|ref|; a problem is a
    non-finite value or an error above tolerance, named by its array (those `got` has)."""
    errors, problems = {}, []
    for name, want in ref.items():
        if name not in got:
            continue
        bad = [which for array, which in ((got[name], name), (want, f"the reference's {name}"))
               if not np.isfinite(array).all()]
        if bad:
            errors[name] = float("nan")
            problems += [f"NaN/inf in {which}" for which in bad]
            continue
        errors[name] = float(np.abs(got[name] - want).max() / max(np.abs(want).max(), 1e-30))
        if errors[name] > tolerance:
            problems.append(f"{name} {errors[name]:.1e} > {tolerance:.0e}")
    return errors, problems


def tfm_attention(impl: str, **masks):
    """attend(q, k, v): tfm's entry point with `impl`, or "hopper <schedule>" (the Hopper driver traced
    with that forward schedule)."""
    name, _, schedule = impl.partition(" ")

    def attend(q, k, v):
        if not schedule:
            return dot_product_attention(q, k, v, impl=name, **masks)
        with flash_hopper.forward_schedule(schedule):
            return dot_product_attention(q, k, v, impl=name, **masks)
    return attend


def hopper_missing() -> Optional[str]:
    """Why tfm's Hopper kernels cannot run here, or None on an H100/H200."""
    if select.hopper_present():
        return None
    return f"the Hopper kernel needs an H100/H200 (device: {jax.devices()[0].device_kind})"


def unsupported(impl: str, case: Case, dtype: str) -> Optional[str]:
    """Why tfm's `impl` cannot run this case here, or None."""
    impl = impl.split()[0]
    if impl == "hopper":
        if reason := hopper_missing():
            return reason
        if dtype == "float32":
            return "the Hopper kernel takes bf16/fp16 only"
        return None
    if impl == "pallas" and dtype == "float32" and jax.default_backend() == "gpu":
        return "tfm's Triton kernels refuse fp32 by design (off the tensor cores; `auto` picks xla)"
    if impl != "cudnn":
        return None
    if jax.default_backend() != "gpu":
        return f"cuDNN needs a GPU (JAX backend is {jax.default_backend()})"
    if dtype == "float32":
        return "cuDNN attention takes fp16/bf16 only"
    if case.dropout:
        return "tfm's cudnn backend has no attention dropout"
    if case.softcap is not None:
        return "tfm's cudnn backend has no logit soft-cap"
    if case.window is not None and not case.causal:
        return "tfm's cudnn backend has no bidirectional window"
    return None


def correctness_impls(selection: Selection) -> tuple[str, ...]:
    """tfm's implementations the correctness section checks: those named "tfm <impl>" in the
    selection's impls, or all."""
    return CHECKED_IMPLS if selection.impls is None else tuple(i for i in CHECKED_IMPLS if f"tfm {i}" in selection.impls)


def correctness(smoke: bool, budget: Budget, selection: Selection = Selection()) -> tuple[list[str], list[str]]:
    """(markdown lines, names of the failed cases)."""
    rows, failures = [], []
    cases = [c for c in correctness_cases(smoke)
             if selection.cases is None or any(part in c.name for part in selection.cases)]
    for case in cases:
        if budget.spent():
            rows.append([case.name, "all", "", "", "", "", "", "", budget.skipped()])
            continue
        arrays, masks = case_inputs(case)
        try:
            ref = reference(arrays, masks)
        except Exception as e:  # nothing to compare with: the case fails
            rows.append([case.name, "reference", "float32", "", "", "", "", "", f"FAIL: raised {short(e)}"])
            failures.append(f"{case.name} reference: raised {short(e)}")
            continue
        for impl in correctness_impls(selection):
            for dtype in ("bfloat16", "float32"):
                row, failed = correctness_row(case, impl, dtype, arrays, masks, ref)
                errors = " ".join(f"{n} {e}" for n, e in zip(("o", "dq", "dk", "dv"), row[3:7]) if e)
                log(f"correctness  {case.name:34} {impl:15} {dtype:9} {row[-1]}{'  ' + errors if errors else ''}")
                rows.append(row)
                if failed:
                    failures.append(f"{case.name} {impl} {dtype}: {row[-1]}")
    lines = ["Each case against the float32 xla reference with `Precision.HIGHEST` matmuls on the same "
             "device, from the same bf16-rounded inputs; gradients of <o, do> for a random do. Error is "
             "max|x - ref| / max|ref| per array. Tolerance: "
             + ", ".join(f"{d} {t:.0e}" for d, t in TOLERANCE.items())
             + " (fp32 allows TF32 matmul units on the GPU).", ""]
    lines += table(["case", "impl", "dtype", "o", "dq", "dk", "dv", "tolerance", "status"], rows)
    lines += ["", f"**{len(failures)} failed**" + "".join(f"\n- {f}" for f in failures) if failures
              else "All cases that ran are within tolerance."]
    return lines, failures


def correctness_row(case: Case, impl: str, dtype: str, arrays, masks, ref) -> tuple[list, bool]:
    """(table row, failed) for one case, impl and dtype."""
    head, tolerance = [case.name, impl, dtype], TOLERANCE[dtype]
    reason = unsupported(impl, case, dtype)
    if reason:
        return head + ["", "", "", "", f"{tolerance:.0e}", f"unavailable: {reason}"], False
    try:
        errors, problems = compare(outputs_and_grads(impl, arrays, masks, jnp.dtype(dtype)), ref, tolerance)
    except Exception as e:  # a supported case that raises is a failure
        log_traceback(e)
        return head + ["", "", "", "", f"{tolerance:.0e}", f"FAIL: raised {short(e)}"], True
    status = "FAIL: " + "; ".join(problems) if problems else "ok"
    return (head + [f"{errors[n]:.1e}" if n in errors else "" for n in ("o", "dq", "dk", "dv")]
            + [f"{tolerance:.0e}", status], bool(problems))


# ---------------------------------------------------------------- 2. attention throughput

THROUGHPUT_IMPLS = ("tfm pallas", "tfm hopper", "tfm hopper pingpong", "tfm cudnn", "tfm xla", "jax pallas mha", "jax mgpu", "jax cudnn",
                    "torch flash", "torch cudnn")


# The order lengths are measured in: coarse to fine, so that a spent budget leaves gaps, not a cut-off.
LENGTH_ORDER = (4096, 16384, 1024, 8192, 2048, 128)


def throughput_shapes(smoke: bool, selection: Selection = Selection()) -> list[attention_bench.Shape]:
    """benchmarks.attention's grid from L 1k (smoke: its L 128 shapes), in LENGTH_ORDER, narrowed
    to the selection's head dims and lengths."""
    shapes = [s for s in attention_bench.sweep(smoke) if (s.L == 128 if smoke else s.L >= 1024)
              and (selection.heads is None or s.H in selection.heads)
              and (selection.lengths is None or s.L in selection.lengths)]
    return sorted(shapes, key=lambda s: LENGTH_ORDER.index(s.L))


# JAX's FlashAttention-3-style Mosaic GPU kernel (Hopper only): its tiles, forward and backward.
MGPU_TILES = dict(block_q=64, block_kv=128, max_concurrent_steps=2,
                  block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)


def mgpu_forward(causal: bool):
    """forward(q, k, v) of `jax.experimental.pallas.ops.gpu.attention_mgpu`, or raises Unavailable."""
    if not select.hopper_present():
        raise Unavailable(f"Mosaic GPU attention needs a Hopper GPU (device: {jax.devices()[0].device_kind})")
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except ImportError as e:
        raise Unavailable(f"jax.experimental.pallas.ops.gpu.attention_mgpu: {short(e)}")
    config = attention_mgpu.TuningConfig(causal=causal, **MGPU_TILES)
    return lambda q, k, v: attention_mgpu.attention(q, k, v, config)


def jax_forward(impl: str, causal: bool):
    """forward(q, k, v) [B, L, N, H] for a JAX implementation, or raises Unavailable."""
    if impl.startswith("tfm "):
        name = impl.split()[1]
        if name == "cudnn" and jax.default_backend() != "gpu":
            raise Unavailable(f"cuDNN needs a GPU (JAX backend is {jax.default_backend()})")
        if name == "hopper" and (reason := hopper_missing()):
            raise Unavailable(reason)
        return tfm_attention(impl.split(" ", 1)[1], causal=causal)
    if impl == "jax mgpu":
        return mgpu_forward(causal)
    if impl == "jax cudnn":
        if jax.default_backend() != "gpu":
            raise Unavailable(f"cuDNN needs a GPU (JAX backend is {jax.default_backend()})")
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    try:
        from jax.experimental.pallas.ops.gpu.attention import mha
    except ImportError as e:
        raise Unavailable(f"jax.experimental.pallas.ops.gpu.attention.mha: {short(e)}")
    interpret = jax.default_backend() == "cpu"
    return lambda q, k, v: mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal, interpret=interpret)


def torch_measure(impl: str, shape: attention_bench.Shape, backward: bool, iters: int):
    """(ms, TFLOP/s, peak MiB) of torch's scaled_dot_product_attention with one backend, bf16 on CUDA."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        raise Unavailable(short(e))
    if not torch.cuda.is_available():
        raise Unavailable(f"torch {torch.__version__} has no CUDA device")
    backend = {"torch flash": SDPBackend.FLASH_ATTENTION, "torch cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    q, k, v = (torch.randn(shape.B, shape.N, shape.L, shape.H, device="cuda", dtype=torch.bfloat16,
                           requires_grad=backward) for _ in range(3))  # torch's layout [B, N, L, H]

    def step():
        with sdpa_kernel(backend):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=shape.causal)
        if backward:
            torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    torch.cuda.reset_peak_memory_stats()
    try:
        seconds = torch_seconds(step, iters)
    finally:  # after the clock stops: a collection of JAX's heap takes far longer than a step
        del q, k, v
        release_memory()
    tflops = attention_bench.flops(shape, backward) / seconds / 1e12
    return seconds * 1e3, tflops, torch.cuda.max_memory_allocated() / 2**20


def torch_seconds(step, iters: int) -> float:
    """Seconds per call of a CUDA torch `step`: the mean of `iters` calls after a warm-up, synchronised."""
    torch = sys.modules["torch"]
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def measure_impl(impl: str, shape, backward: bool, iters: int, dtype: str = "bfloat16"):
    if impl.startswith("torch "):
        if dtype != "bfloat16":
            raise Unavailable("the torch rows are timed in bf16 only")
        return torch_measure(impl, shape, backward, iters)
    return attention_bench.measure_forward(jax_forward(impl, shape.causal), shape, backward, jnp.dtype(dtype), iters)


# tfm xla keeps fp32 logits [B, N, L, L] (forward), about three of them with the backward; above this
# its autotuner ran out of an H100's half (JAX's share here) from 16 GiB and spent the budget failing.
XLA_MAX_LOGIT_GIB = 12


def xla_logit_gib(shape, backward: bool) -> float:
    return shape.B * shape.N * shape.L ** 2 * 4 * (3 if backward else 1) / 2**30


def throughput(smoke: bool, budget: Budget, selection: Selection = Selection()) -> tuple[list[str], list[dict]]:
    """(markdown lines, rows): a row per impl, shape and pass; `tflops` None where it did not run."""
    iters = 1 if smoke else 10
    rows = []
    impls = [i for i in THROUGHPUT_IMPLS if selection.impls is None or i in selection.impls]
    for shape in throughput_shapes(smoke, selection):
        for backward in (False, True):
            for impl in impls:
                row = dict(impl=impl, H=shape.H, L=shape.L, B=shape.B, N=shape.N, causal=shape.causal,
                           tflops=None, peak=None, **{"pass": "fwd+bwd" if backward else "fwd"})
                if budget.spent():
                    row["status"] = budget.skipped()
                elif impl == "tfm xla" and xla_logit_gib(shape, backward) > XLA_MAX_LOGIT_GIB:
                    row["status"] = f"skipped: materialises ~{xla_logit_gib(shape, backward):.0f} GiB of fp32 logits"
                else:
                    row["status"] = throughput_cell(row, impl, shape, backward, iters, selection.dtype)
                log(f"attention  {impl:19} {row['pass']:8} H {shape.H:3} L {shape.L:6} causal {shape.causal!s:5} "
                    f"{row['status']}")
                rows.append(row)
    keys = sorted({(r["pass"], r["causal"], r["H"], r["L"], r["B"], r["N"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2], k[3]))
    cell = {(r["pass"], r["causal"], r["H"], r["L"], r["impl"]): r["status"] for r in rows}
    lines = [f"TFLOP/s, {selection.dtype}, FlashAttention-2 convention (forward 4·B·L²·N·H, halved when causal; fwd+bwd "
             f"3.5× forward), mean of {iters} steps after a warm-up; B·L = {keys[0][3] * keys[0][4] if keys else 0}, "
             f"N·H = {keys[0][2] * keys[0][5] if keys else 0}. `attention.png` plots these and the peak memory "
             f"against L.", ""]
    lines += table(["pass", "causal", "H", "L", "B", "N", *impls],
                   [[p, c, H, L, B, N, *(cell[(p, c, H, L, impl)] for impl in impls)]
                    for p, c, H, L, B, N in keys])
    return lines, rows


def throughput_cell(row: dict, impl: str, shape, backward: bool, iters: int, dtype: str = "bfloat16") -> str:
    """Measures one point into row (ms, tflops, peak); returns the table cell."""
    try:
        ms, row["tflops"], row["peak"] = measure_impl(impl, shape, backward, iters, dtype)
    except Unavailable as e:
        return f"unavailable: {e}"
    except Exception as e:  # out of memory, or a kernel that does not lower: shown, not fatal
        log_traceback(e)
        return f"error: {short(e)}"
    return f"{row['tflops']:.3f}"


# ---------------------------------------------------------------- 3. train step

def release_memory() -> None:
    """Frees the previous run's model, optimizer state and compiled step, and gives torch's
    cached GPU memory back for JAX. Nothing to give back without a GPU (the CPU smoke run)."""
    if jax.default_backend() != "gpu":
        return
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_cases(smoke: bool, selection: Selection = Selection()) -> list[tuple[str, int, int]]:
    """(model, B, T): GPT-2 small at 8×1024 and at its best measured batch, BERT-base without and
    with the paper's dropout (0.1, attention too), the Llama-1B shape; narrowed to the selection's
    models (`benchmarks.train_step` names)."""
    cases = ([("gpt2", 2, 32), ("bert_dropout", 2, 32)] if smoke else  # smoke: BERT's path with dropout
             [("gpt2", 8, 1024), ("gpt2", 32, 1024), ("bert", 32, 512), ("bert_dropout", 32, 512),
              ("llama1b", 4, 2048)])
    return [c for c in cases if selection.models is None or c[0] in selection.models]


def torch_device(smoke: bool) -> str:
    """"cuda", or "cpu" on a smoke run; raises Unavailable otherwise."""
    try:
        import torch
    except ImportError as e:
        raise Unavailable(short(e))
    if torch.cuda.is_available():
        return "cuda"
    if smoke:
        torch.set_num_threads(1)  # torch's threads next to XLA's on a small shared CPU slow both
        return "cpu"
    raise Unavailable(f"torch {torch.__version__} has no CUDA device")


TRAIN_RUNS = ("tfm cudnn", "tfm hopper", "torch compile", "tfm pallas", "torch eager", "tfm xla")  # in the order they run
# A smoke run times each tfm impl that runs on CPU on one model only (every model, every run kind and
# the memory figure still run; each tfm step's compile is most of the smoke run's train time):
# pallas on BERT's path with dropout, xla on GPT-2. Pallas against xla in training: tests/test_pallas_models.py.
SMOKE_TFM_MODEL = {"tfm pallas": "bert_dropout", "tfm xla": "gpt2"}


def smoke_skipped(label: str, name: str) -> Optional[str]:
    """Why a smoke run leaves out this tfm run, or None."""
    model = SMOKE_TFM_MODEL.get(label, name)
    return None if model == name else f"skipped: the smoke run times {label} on {model} only"


def train(smoke: bool, budget: Budget, selection: Selection = Selection()) -> list[str]:
    """Markdown lines. Runs go breadth first (each run for every model, in TRAIN_RUNS order),
    so that a spent budget skips the least needed ones."""
    from benchmarks import train_step as bench
    from tfm.train.metrics import flops_per_token, peak_flops
    peak, steps = peak_flops(), 2 if smoke else 5
    cases = train_cases(smoke, selection)
    status, flops_per_step = {}, {}  # (model, B, run) -> (seconds, where) or a reason; (model, B) -> FLOPs
    for label in TRAIN_RUNS:
        for name, B, T in cases:
            release_memory()
            if budget.spent():
                status[name, B, label] = budget.skipped()
                continue
            if smoke and (reason := smoke_skipped(label, name)):
                status[name, B, label] = reason
                continue
            try:
                step, where, trainer, compiled = train_run(bench, label, name, B, T, smoke)
                seconds, = bench.interleaved([step], steps)
                memory = step_memory(compiled)
            except Unavailable as e:
                status[name, B, label] = f"unavailable: {e}"
            except Exception as e:  # shown in the report, not fatal
                status[name, B, label] = f"error: {short(e)}"
            else:
                status[name, B, label] = (seconds, where, memory)
                if trainer is not None:
                    cfg = trainer.model.config
                    flops_per_step[name, B] = B * T * flops_per_token(trainer.flop_params, cfg.num_layers, cfg.d_model, T)
            result = status[name, B, label]
            log(f"train  {name:12} {B:3}×{T:<5} {label:14} " + (result if isinstance(result, str) else f"{result[0] * 1e3:.1f} ms"))
    rows = []
    for name, B, T in cases:
        for label in [f"tfm {impl}" for impl in TFM_IMPLS] + ["torch eager", "torch compile"]:
            result = status[name, B, label]
            if isinstance(result, str):
                rows.append([name, f"{B}×{T}", label, "", "", "", "", result])
                continue
            seconds, where, memory = result
            flops = flops_per_step.get((name, B))
            mfu = "n/a" if peak is None or flops is None else f"{flops / seconds / peak:.1%}"
            rows.append([name, f"{B}×{T}", label, f"{seconds * 1e3:.1f}", f"{B * T / seconds:,.0f}", mfu, memory,
                         where])
    lines = [f"One train step (forward, backward, AdamW), bf16, dropout 0 (bert_dropout: 0.1 on hidden states and "
             f"attention, as the paper); fastest of {steps} after a warm-up. "
             f"MFU = 6·N + 12·layers·D·T FLOPs per token (`tfm.train.metrics.flops_per_token`; N the parameters "
             f"a token's matmuls use, `Trainer.flop_params`, for both sides) over the device's dense bf16 peak "
             f"({'%.0f TFLOP/s' % (peak / 1e12) if peak else 'unknown for this device: n/a'}). tfm: bf16 "
             f"computation, fp32 parameters (`ModelConfig.dtype`), per attention impl; torch: Hugging Face "
             f"with autocast bf16, SDPA, fused AdamW on CUDA; eager and `torch.compile`. Memory (GiB per "
             f"device): XLA's figure for the compiled step, as the preflight counts it (arguments + outputs "
             f"- donated + temporaries), then what the device measured: JAX's peak bytes in use so far in "
             f"this process (the step's own for the first tfm run of a `--only train` command), torch's "
             f"peak allocated during its run.", ""]
    return lines + table(["model", "batch", "impl", "ms/step", "tokens/s", "MFU", "memory: compiled / measured",
                          "where"], rows)


def step_memory(compiled) -> str:
    """'compiled / measured' GiB of the step just timed: tfm's compiled figure (its `memory_analysis()`
    given) and JAX's device peak so far, or torch's peak since its run began; "n/a" where a device
    keeps no statistics (CPU)."""
    from tfm.preflight.analysis import memory_bytes
    gib = lambda n: f"{n / 2**30:.3g}"
    if compiled is None:
        torch = sys.modules["torch"]
        return f"— / {gib(torch.cuda.max_memory_allocated())}" if torch.cuda.is_available() else "— / n/a"
    stats = jax.devices()[0].memory_stats()
    measured = gib(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else "n/a"
    return f"{gib(memory_bytes(compiled))} / {measured}"


def train_run(bench, label: str, name: str, B: int, T: int, smoke: bool):
    """(step, where, tfm trainer and its step's memory_analysis() or None, None) for one of TRAIN_RUNS."""
    framework, kind = label.split()
    if framework == "tfm":
        return tfm_train_step(bench, name, B, T, kind, smoke)
    return torch_train_step(bench, name, B, T, kind, smoke)


def tfm_train_step(bench, name: str, B: int, T: int, impl: str, smoke: bool):
    """(step, where, trainer, memory_analysis() of the step) of tfm's bf16 train step with one attention impl."""
    if impl == "cudnn" and jax.default_backend() != "gpu":
        raise Unavailable(f"cuDNN needs a GPU (JAX backend is {jax.default_backend()})")
    if impl == "hopper" and (reason := hopper_missing()):
        raise Unavailable(reason)
    if impl == "cudnn" and name == "bert_dropout":
        raise Unavailable("tfm's cudnn attention has no dropout (the kernels and xla have)")
    tiny = bench.TINY if smoke else {}
    step, trainer, compiled = bench.jax_stepper(name, B, T, dtype="bfloat16", attention_impl=impl, **tiny)
    return step, jax.devices()[0].device_kind, trainer, compiled.memory_analysis()


def torch_train_step(bench, name: str, B: int, T: int, mode: str, smoke: bool):
    """(step, where, None, None) of the Hugging Face model's train step, eager or compiled."""
    device = torch_device(smoke)
    if mode == "compile" and device == "cpu":
        raise Unavailable("torch.compile is timed on CUDA only (its CPU compile outlasts a smoke run)")
    if device == "cuda":
        sys.modules["torch"].cuda.reset_peak_memory_stats()
    step = bench.torch_stepper(name, B, T, device=device, bf16=True, compile=mode == "compile",
                               fused=device == "cuda", tiny=smoke)
    return step, device + (", 1 thread (smoke)" if smoke else ""), None, None


# ---------------------------------------------------------------- 4. decode

def decode(smoke: bool, budget: Budget) -> list[str]:
    """Markdown lines: sentences/s of tfm and HF per batch size and beam."""
    from benchmarks import decode as bench
    size = bench.SMOKE if smoke else bench.BASE
    source_len, max_new, batches, rounds = (8, 6, (2,), 1) if smoke else (20, 30, (1, 32, 256), 2)
    try:
        device, hf_reason = torch_device(smoke), None
    except Unavailable as e:
        device, hf_reason = None, f"unavailable: {e}"
    rows, target = [], "not measured"
    for batch in batches:
        ids = bench.sources(max(batch, 2 if smoke else 8), source_len, size["vocab"])
        for beam in (1, 4):
            release_memory()
            if budget.spent():
                rows.append([batch, beam, "", "", "", budget.skipped()])
                continue
            try:
                rates = decode_rates(bench, size, max_new, beam, device, ids, batch, rounds)
            except Exception as e:  # out of memory, say: shown, not fatal
                rows.append([batch, beam, "", "", "", f"error: {short(e)}"])
                continue
            hf = f"{rates[1]:.1f}" if device else hf_reason
            ratio = rates[0] / rates[1] if device else None
            if (batch, beam) == (32, 4) and ratio is not None:
                target = f"{'met' if ratio >= 3 else 'NOT met'} ({ratio:.2f}×)"
            note = f"HF on {device}" + (", 1 thread (smoke)" if smoke else "") if device else ""
            rows.append([batch, beam, f"{rates[0]:.1f}", hf, "" if ratio is None else f"{ratio:.2f}", note])
            log(f"decode  batch {batch:4} beam {beam}  tfm {rates[0]:.1f} sent/s  hf {hf}")
    lines = [f"Sentences/s, translation Transformer-{'tiny (smoke)' if smoke else 'base'} {size}, random weights, "
             f"fp32; sources {source_len // 2}-{source_len} tokens, at most {max_new} new; tfm "
             f"`decode.translate` under `jax.jit` vs `MarianMTModel.generate` on the same device; best of "
             f"{rounds} interleaved passes after a warm-up.", ""]
    lines += table(["batch", "beam", "tfm (sent/s)", "HF (sent/s)", "tfm / HF", "note"], rows)
    return lines + ["", f"Target tfm ≥ 3× HF for beam 4 at batch 32: {target}."]


def decode_rates(bench, size: dict, max_new: int, beam: int, device, ids: np.ndarray, batch: int,
                 rounds: int) -> list[float]:
    """Sentences/s of tfm, then of HF on `device` (None: tfm only), over ids [n, S] in batches."""
    runs = [bench.over_batches(bench.tfm_translator(size, max_new, beam), ids, batch)[0]]
    if device:
        runs.append(bench.over_batches(bench.hf_translator(size, max_new, beam, device), ids, batch)[0])
    for run in runs:
        run()  # warm-up: compiles tfm's decode
    return [len(ids) / s for s in bench.interleaved(runs, rounds)]


# ---------------------------------------------------------------- 5. auto rules

def winners(rows: list[dict], prefix: str = "tfm ") -> dict[tuple, tuple[str, float]]:
    """{(pass, causal, H, L): (fastest impl named `prefix`..., its TFLOP/s)} over the measured
    points; the prefix is cut from the name."""
    best = {}
    for r in rows:
        if r["impl"].startswith(prefix) and r["tflops"] is not None:
            key = (r["pass"], r["causal"], r["H"], r["L"])
            if key not in best or r["tflops"] > best[key][1]:
                best[key] = (r["impl"][len(prefix):], r["tflops"])
    return best


def proposed_rules(best: dict[tuple, tuple[str, float]]) -> list[str]:
    """One rule line per (causal, H) from the fwd+bwd winners: runs of L with the same impl."""
    lines = []
    for causal, H in sorted({(c, H) for p, c, H, _ in best if p == "fwd+bwd"}):
        runs = []
        for L in sorted(L for p, c, h, L in best if (p, c, h) == ("fwd+bwd", causal, H)):
            impl = best[("fwd+bwd", causal, H, L)][0]
            if runs and runs[-1][0] == impl:
                runs[-1][2] = L
            else:
                runs.append([impl, L, L])
        spans = ", ".join(f"L {a}-{b}: {impl}" if a != b else f"L {a}: {impl}" for impl, a, b in runs)
        lines.append(f"{jax.default_backend()}, {'causal' if causal else 'bidirectional'}, H {H}: {spans}")
    lines.append(f"{jax.default_backend()}, soft-cap or bidirectional window: pallas (cuDNN has neither)")
    lines.append(f"{jax.default_backend()}, segment ids or ALiBi: pallas unless measured otherwise (tfm's cudnn "
                 f"materialises a [B, 1, T, S] mask or [1, N, T, S] bias; the sweep has neither)")
    return lines


def auto(rows: Optional[list[dict]]) -> list[str]:
    if not rows:
        return ["unavailable: the attention section did not run (select it with --only attention,auto)"]
    best = winners(rows)
    if not best:
        return ["unavailable: no tfm attention impl produced a figure"]
    rules = proposed_rules(best)
    for rule in rules:
        log(f"auto  proposed: {rule}")
    overall = winners(rows, prefix="")
    lines = ["Fastest tfm impl per measured point (TFLOP/s), and the fastest of all the impls of section 2. "
             "`tfm/ops/select.py` holds the rules set from the first H100 run (2026-11-24: cudnn wherever it "
             "computes the layer); the rules below are what these figures propose, to compare with it.", ""]
    lines += table(["pass", "causal", "H", "L", "fastest tfm", "TFLOP/s", "fastest of all", "TFLOP/s"],
                   [[*key, impl, f"{tflops:.3f}", overall[key][0], f"{overall[key][1]:.3f}"]
                    for key, (impl, tflops) in sorted(best.items())])
    return lines + ["", "Proposed rules (fwd+bwd winners):", "", "```", *rules, "```"]


# ---------------------------------------------------------------- report

def versions() -> str:
    found = []
    for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "torch", "transformers", "triton"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"n/a ({short(e)})"
    return out.stdout.strip().replace("\n", "; ") or f"n/a (nvidia-smi: {out.stderr.strip()[:80]})"


def header(argv: list[str], smoke: bool) -> list[str]:
    device = jax.devices()[0]
    smoke_note = " (SMOKE: tiny shapes on CPU, Pallas interpreted; no meaning for speed)" if smoke else ""
    return ["# tfm GPU check" + smoke_note,
            "",
            f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            f"- command: `python -m benchmarks.gpu_check {' '.join(argv)}`",
            f"- device: {device.device_kind} (JAX backend {jax.default_backend()}, {jax.device_count()} device(s))",
            f"- driver: {driver()}",
            f"- versions: {versions()}, python {sys.version.split()[0]}{torch_cuda()}"]


def torch_cuda() -> str:
    """The CUDA and cuDNN versions torch was built with, where torch has a GPU; else ""."""
    try:
        import torch
    except ImportError:
        return ""
    if not torch.cuda.is_available():
        return ""
    return f", torch's CUDA {torch.version.cuda} and cuDNN {torch.backends.cudnn.version()}"


def run_section(name: str, smoke: bool, budget: Budget, attention_rows, selection: Selection = Selection()):
    """(markdown lines, failures, attention rows) of one section; an import it lacks makes it unavailable."""
    try:
        if name == "correctness":
            lines, failures = correctness(smoke, budget, selection)
            return lines, failures, attention_rows
        if name == "attention":
            lines, rows = throughput(smoke, budget, selection)
            return lines, [], rows
        if name == "train":
            return train(smoke, budget, selection), [], attention_rows
        if name == "decode":
            return decode(smoke, budget), [], attention_rows
        return auto(attention_rows), [], attention_rows
    except ImportError as e:
        return [f"unavailable: {short(e)} (carry it; see the script's docstring)"], [], attention_rows
    except Exception as e:  # the other sections still run; only correctness decides the exit status
        traceback.print_exc()
        failed = [f"the section raised {short(e)}"] if name == "correctness" else []
        return [f"error: the section raised {short(e)}"], failed, attention_rows


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_check_out", help="directory for report.md and attention.png")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, Pallas interpreted")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every section's time budget")
    parser.add_argument("--cases", help="correctness: only the cases whose name contains one of these (comma-separated)")
    parser.add_argument("--impls", help="attention and correctness (the tfm ones): only these implementations (comma-separated), from "
                        + ", ".join(THROUGHPUT_IMPLS))
    parser.add_argument("--heads", help="attention: only these head dims (comma-separated)")
    parser.add_argument("--lengths", help="attention: only these sequence lengths (comma-separated)")
    parser.add_argument("--models", help="train: only these models (comma-separated: gpt2, bert, bert_dropout, llama1b)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                        help="attention: the inputs' dtype (JAX's Mosaic GPU kernel takes float16 only)")
    args = parser.parse_args(argv)
    split = lambda text, kind=str: None if text is None else tuple(kind(x) for x in text.split(","))
    selection = Selection(split(args.cases), split(args.impls), split(args.heads, int), split(args.lengths, int),
                          args.dtype, split(args.models))
    if selection.impls and set(selection.impls) - set(THROUGHPUT_IMPLS):
        parser.error(f"unknown --impls {sorted(set(selection.impls) - set(THROUGHPUT_IMPLS))}; "
                     f"choose from {THROUGHPUT_IMPLS}")
    selected = args.only.split(",")
    unknown = set(selected) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    os.makedirs(args.out, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.join(args.out, "jax_cache"))  # a rerun compiles less
    report_path = os.path.join(args.out, "report.md")
    lines, failures, attention_rows = header(argv, args.smoke), [], None
    for number, name in enumerate(SECTIONS, 1):
        if name not in selected:
            continue
        log(f"== {number}. {name}")
        start = time.monotonic()
        budget = Budget(BUDGET_S[name] * args.budget_scale * (10 if args.smoke else 1))  # smoke: a busy CPU
        body, failed, attention_rows = run_section(name, args.smoke, budget, attention_rows, selection)
        failures += failed
        lines += ["", f"## {number}. {name} ({time.monotonic() - start:.0f} s)", "", *body]
        with open(report_path, "w") as f:
            f.write("\n".join(lines) + "\n")
    if attention_rows and any(r["tflops"] is not None for r in attention_rows):
        title = f"tfm gpu_check  {jax.devices()[0].device_kind}  jax {jax.__version__}  {args.dtype}{'  SMOKE' * args.smoke}"
        attention_bench.plot([r for r in attention_rows if r["tflops"] is not None],
                             os.path.join(args.out, "attention.png"), title)
    log(f"report written to {report_path}; {len(failures)} correctness failure(s)")
    for failure in failures:
        log(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
