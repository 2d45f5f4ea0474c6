"""The Triton kernels' launch parameters and tiles, chosen by timing them on the GPU at hand.

    python -m benchmarks.triton_sweep --out triton_sweep_out   # any CUDA GPU (A100, L4, H100): ~8 min
    python -m benchmarks.triton_sweep --smoke --out DIR         # CPU: tiny grid, Pallas interpreted

What is timed: tfm's flash kernels on their Triton driver, `dot_product_attention(impl="pallas",
block_sizes=...)` under `jax.jit` on q, k, v [B, L, N, H] bf16 (B*L = 16k tokens, N*H = 2048; H 64
and 128, L 2048 and 8192, causal and not): the forward alone, and forward+backward (the gradients of
sum(o) w.r.t. q, k, v: the forward, dQ and dK/dV kernels). Milliseconds per step are the mean of
--iters steps after a warm-up; TFLOP/s follow FlashAttention-2's convention (`benchmarks.attention.flops`:
forward 4*B*L*L*N*H, halved when causal; forward+backward 3.5x that), so masked-out tiles count for
nothing and the figures compare with FlashAttention's and cuDNN's.

What is swept (`tfm.kernels.tiles.BlockSizes`): each kernel's tiles in {32, 64, 128} and its Launch,
num_warps in {4, 8} x num_stages in {1, 2, 3}. The whole product is far too big for one command, so
for each (H, causal) at the sweep length (L 2048) it descends one coordinate group at a time, each
step starting from the best so far (from `BlockSizes.default("gpu", H)`, which each pass also
times as the baseline), a configuration measured once only; the backward's steps keep the best
forward:

    fwd tiles     block_q x block_kv, the forward timed alone                      (9)
    fwd launch    the forward's Launch                                             (6)
    bwd tiles     block_q_bwd x block_kv_bwd for dQ and dK/dV alike, fwd+bwd timed (9)
    dkv tiles     block_q_dkv x block_kv_dkv, dQ's kept                            (9)
    dq launch     launch_bwd, dK/dV's kept                                         (6)
    dkv launch    launch_dkv                                                       (6)
    long          at L 8192: the defaults and each pass's three best at L 2048

Configurations are compiled with XLA's refusal of register spills: one that spills or fails to
compile (shared memory, say) is listed with its reason and not timed. At the sweep length each
result is compared with the xla backend's in fp32 on the same (bf16-rounded) inputs, the output or
the three gradients of batch row 0, max|x - ref| / max|ref| <= 2e-2 (`gpu_check.TOLERANCE`); a
configuration that differs is listed, never chosen, and the command exits 1. Each step has a share of BUDGET_S (about 7
minutes in all, times --budget-scale); what a spent share leaves is listed as skipped.

Writes DIR/report.md (device, versions, date, the command; the best configuration per shape and pass
beside the defaults; every configuration's TFLOP/s; the ones skipped) and DIR/sweep.json (the same
rows), printing a line per configuration as it goes. --smoke runs H 32, L 32 (and 64 for the long
step) with tiles {8, 16}, warps {4, 8} and 2 stages in the Pallas interpreter, where the launch
parameters reach no kernel and the times mean nothing, but every configuration's result is checked.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import gpu_check
from benchmarks.attention import Shape, flops, step_fn
from benchmarks.gpu_check import Budget, log, short, table
from benchmarks.gpu_registers import REFUSE_SPILLS
from tfm.kernels.tiles import BlockSizes, Launch
from tfm.ops.attention import dot_product_attention


class Grid(NamedTuple):
    """The values swept and the shapes they are swept on."""
    blocks: tuple[int, ...]
    warps: tuple[int, ...]
    stages: tuple[int, ...]
    heads: tuple[int, ...]
    length: int       # the sweep length
    long: int         # the length of the last step
    tokens: int = 16384  # B * L
    width: int = 2048    # N * H
    finalists: int = 3   # per pass, at the long length
    smoke: bool = False  # start from tiles of the grid, not the GPU defaults

    def start(self, H: int) -> BlockSizes:
        """Where the descent starts, and what the best is compared with."""
        return BlockSizes(16, 16, 16, 8) if self.smoke else BlockSizes.default("gpu", H)


GRID = Grid(blocks=(32, 64, 128), warps=(4, 8), stages=(1, 2, 3), heads=(64, 128), length=2048, long=8192)
SMOKE = Grid(blocks=(8, 16), warps=(4, 8), stages=(2,), heads=(32,), length=32, long=64, tokens=64, width=64,
             finalists=1, smoke=True)
# Seconds per step of the descent; a step may use what the ones before it left.
BUDGET_S = {"fwd tiles": 45, "fwd launch": 30, "bwd tiles": 70, "dkv tiles": 70, "dq launch": 50,
            "dkv launch": 50, "long": 90}
TOLERANCE = gpu_check.TOLERANCE["bfloat16"]


def shape(grid: Grid, H: int, L: int, causal: bool) -> Shape:
    return Shape(grid.tokens // L, L, grid.width // H, H, causal)


def steps(grid: Grid) -> dict:
    """{step: (backward?, best BlockSizes -> the candidates)} in the descent's order (the long step aside)."""
    tiles = [(a, b) for a in grid.blocks for b in grid.blocks]
    launches = [Launch(w, s) for w in grid.warps for s in grid.stages]
    replace = dataclasses.replace
    return {
        "fwd tiles": (False, lambda best: [replace(best, block_q=a, block_kv=b) for a, b in tiles]),
        "fwd launch": (False, lambda best: [replace(best, launch=x) for x in launches]),
        "bwd tiles": (True, lambda best: [replace(best, block_q_bwd=a, block_kv_bwd=b, block_q_dkv=None,
                                                  block_kv_dkv=None) for a, b in tiles]),
        "dkv tiles": (True, lambda best: [replace(best, block_q_dkv=a, block_kv_dkv=b) for a, b in tiles]),
        "dq launch": (True, lambda best: [replace(best, launch_bwd=x, launch_dkv=best.launches[2])
                                          for x in launches]),
        "dkv launch": (True, lambda best: [replace(best, launch_dkv=x) for x in launches]),
    }


def describe(blocks: BlockSizes, backward: bool) -> str:
    """'fwd 128x64 w8s2' (+ '; dq 64x32 w8s2; dkv 64x32 w4s3' for fwd+bwd): tiles, warps, stages."""
    kernels = zip(("fwd", "dq", "dkv"), ((blocks.block_q, blocks.block_kv), blocks.backward, blocks.dkv),
                  blocks.launches)
    parts = [f"{name} {q}x{kv} w{x.num_warps}s{x.num_stages}" for name, (q, kv), x in kernels]
    return "; ".join(parts if backward else parts[:1])


def settings(blocks: BlockSizes) -> dict:
    """The configuration as plain fields (the JSON's), launches as [num_warps, num_stages] per kernel."""
    fwd, dq, dkv = blocks.launches
    return dict(block_q=blocks.block_q, block_kv=blocks.block_kv, block_q_bwd=blocks.backward[0],
                block_kv_bwd=blocks.backward[1], block_q_dkv=blocks.dkv[0], block_kv_dkv=blocks.dkv[1],
                launch=[fwd.num_warps, fwd.num_stages], launch_bwd=[dq.num_warps, dq.num_stages],
                launch_dkv=[dkv.num_warps, dkv.num_stages])


def inputs(s: Shape):
    """q, k, v [B, L, N, H] bf16, as `benchmarks.attention.measure_forward` draws them."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return tuple(jax.random.normal(key, (s.B, s.L, s.N, s.H), jnp.bfloat16) for key in keys)


def results(out, backward: bool) -> dict[str, np.ndarray]:
    """Batch row 0 of the output (forward) or of the three gradients, fp32."""
    names = ("dq", "dk", "dv") if backward else ("o",)
    return {n: np.asarray(x[:1], np.float32) for n, x in zip(names, out if backward else (out,))}


def reference(s: Shape, backward: bool) -> Optional[dict[str, np.ndarray]]:
    """The xla backend's output or gradients in fp32 for batch row 0 of the bf16 inputs (rows are
    independent; one keeps the [N, L, L] logits small), or None where it cannot run."""
    attend = lambda q, k, v: dot_product_attention(q, k, v, causal=s.causal, impl="xla")
    try:
        return results(step_fn(attend, backward)(*(x[:1].astype(jnp.float32) for x in inputs(s))), backward)
    except Exception as e:  # out of memory, say: the configurations go unchecked, and say so
        log(f"the xla reference for {s} ({'fwd+bwd' if backward else 'fwd'}) failed, results unchecked: {short(e)}")
        return None


class Sweep:
    """The measured rows, a row per (shape, pass, configuration), and the references they are checked by."""

    def __init__(self, grid: Grid, iters: int):
        self.grid, self.iters, self.rows, self.refs = grid, iters, {}, {}
        self.options = REFUSE_SPILLS if jax.default_backend() == "gpu" else None

    def measure(self, s: Shape, backward: bool, blocks: BlockSizes, step: str) -> dict:
        """The row of one configuration, measured unless it was already."""
        key = (s, backward, blocks)
        if key in self.rows:
            return self.rows[key]
        row = self.rows[key] = self.row(s, backward, blocks, step, "ok")
        attend = lambda q, k, v: dot_product_attention(q, k, v, causal=s.causal, impl="pallas", block_sizes=blocks)
        args = inputs(s)
        try:
            compiled = step_fn(attend, backward).lower(*args).compile(compiler_options=self.options)
        except Exception as e:  # a spill refused by XLA, shared memory exceeded, a lowering error
            row["status"] = ("spills: " if "spill" in str(e).lower() else "does not compile: ") + short(e)
            log(f"{step:10} {self.label(row)}  {row['status']}")
            return row
        try:
            out = jax.block_until_ready(compiled(*args))
            start = time.perf_counter()
            for _ in range(self.iters):
                timed = compiled(*args)
            jax.block_until_ready(timed)
            seconds = (time.perf_counter() - start) / self.iters
        except Exception as e:  # a launch the device refuses
            row["status"] = "does not run: " + short(e)
            log(f"{step:10} {self.label(row)}  {row['status']}")
            return row
        row.update(ms=seconds * 1e3, tflops=flops(s, backward) / seconds / 1e12)
        if s.L == self.grid.length:
            if (s, backward) not in self.refs:
                self.refs[s, backward] = reference(s, backward)
            if self.refs[s, backward] is not None:
                errors, problems = gpu_check.compare(results(out, backward), self.refs[s, backward], TOLERANCE)
                row["error"] = max(errors.values())
                if problems:
                    row["status"] = "WRONG: " + "; ".join(problems)
        error = "" if row["error"] is None else f"  err {row['error']:.1e}"
        log(f"{step:10} {self.label(row)}  {row['ms']:9.3f} ms {row['tflops']:8.4g} TFLOP/s{error}"
            + ("" if row["status"] == "ok" else f"  {row['status']}"))
        return row

    @staticmethod
    def row(s: Shape, backward: bool, blocks: BlockSizes, step: str, status: str) -> dict:
        """A row not yet timed (ms, TFLOP/s and the error vs xla None)."""
        return dict(step=step, H=s.H, L=s.L, B=s.B, N=s.N, causal=s.causal,
                    **{"pass": "fwd+bwd" if backward else "fwd"}, config=describe(blocks, backward), settings=settings(blocks), ms=None, tflops=None, error=None,
                    status=status)

    @staticmethod
    def label(row: dict) -> str:
        causal = "causal" if row["causal"] else "bidir"
        return f"H {row['H']:3} L {row['L']:5} {causal:6} {row['pass']:7} {row['config']}"

    def skip(self, s: Shape, backward: bool, blocks: BlockSizes, step: str, reason: str) -> None:
        self.rows.setdefault((s, backward, blocks), self.row(s, backward, blocks, step, reason))

    def ranked(self, s: Shape, backward: bool) -> list[tuple[BlockSizes, dict]]:
        """(configuration, row) of `s` and the pass that measured correct, fastest first."""
        found = [(key[2], row) for key, row in self.rows.items()
                 if key[:2] == (s, backward) and row["status"] == "ok" and row["tflops"] is not None]
        return sorted(found, key=lambda item: -item[1]["tflops"])


def run(grid: Grid, iters: int, budget_scale: float) -> Sweep:
    """The descent over every (H, causal) at the sweep length, then the long step."""
    sweep = Sweep(grid, iters)
    groups = [(H, causal) for H in grid.heads for causal in (False, True)]
    best = {g: grid.start(g[0]) for g in groups}
    deadline = time.monotonic()
    for step, (backward, candidates) in steps(grid).items():
        deadline += BUDGET_S[step] * budget_scale
        budget = Budget(max(0.0, deadline - time.monotonic()))
        todo = {g: list(dict.fromkeys([grid.start(g[0]), best[g], *candidates(best[g])])) for g in groups}
        for i in range(max(map(len, todo.values()))):  # round-robin: a spent budget cuts every group alike
            for g in groups:
                if i >= len(todo[g]):
                    continue
                s = shape(grid, g[0], grid.length, g[1])
                if budget.spent():
                    sweep.skip(s, backward, todo[g][i], step, budget.skipped())
                else:
                    sweep.measure(s, backward, todo[g][i], step)
        for g in groups:
            ranked = sweep.ranked(shape(grid, g[0], grid.length, g[1]), backward)
            if ranked:
                best[g] = ranked[0][0]
    deadline += BUDGET_S["long"] * budget_scale
    budget = Budget(max(0.0, deadline - time.monotonic()))
    for backward in (False, True):
        for g in groups:
            ranked = sweep.ranked(shape(grid, g[0], grid.length, g[1]), backward)
            finalists = [grid.start(g[0])] + [blocks for blocks, _ in ranked[:grid.finalists]]
            s = shape(grid, g[0], grid.long, g[1])
            for blocks in dict.fromkeys(finalists):
                if budget.spent():
                    sweep.skip(s, backward, blocks, "long", budget.skipped())
                else:
                    sweep.measure(s, backward, blocks, "long")
    return sweep


def report(sweep: Sweep, argv: list[str], smoke: bool, seconds: float) -> tuple[list[str], list[dict]]:
    """(markdown lines, best rows: one per shape and pass)."""
    device = jax.devices()[0]
    smoke_note = " (SMOKE: tiny shapes on CPU, Pallas interpreted; launch parameters unused, times meaningless)"
    lines = [f"# tfm Triton sweep{smoke_note if smoke else ''}", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             f"- command: `python -m benchmarks.triton_sweep {' '.join(argv)}` ({seconds:.0f} s)",
             f"- device: {device.device_kind} (JAX backend {jax.default_backend()})",
             f"- driver: {gpu_check.driver()}",
             f"- versions: {gpu_check.versions()}, python {sys.version.split()[0]}",
             f"- measured: `dot_product_attention(impl=\"pallas\", block_sizes=...)` under `jax.jit`, bf16, B*L = "
             f"{sweep.grid.tokens}, N*H = {sweep.grid.width}; mean of {sweep.iters} steps after a warm-up; TFLOP/s "
             f"in FlashAttention-2's convention (forward 4*B*L*L*N*H, halved when causal; fwd+bwd 3.5x). "
             f"Results checked against xla (fp32) at L {sweep.grid.length}, tolerance {TOLERANCE:.0e}.",
             "", "## Best per shape", ""]
    shapes = sorted({(key[0], key[1]) for key in sweep.rows}, key=lambda k: (k[1], k[0].H, k[0].L, k[0].causal))
    best_rows, cells = [], []
    for s, backward in shapes:
        ranked = sweep.ranked(s, backward)
        default = sweep.rows.get((s, backward, sweep.grid.start(s.H)))
        base = default["tflops"] if default and default["status"] == "ok" else None
        if not ranked:
            cells.append([s.H, s.L, s.causal, "fwd+bwd" if backward else "fwd", "none measured", "", "", ""])
            continue
        blocks, row = ranked[0]
        best_rows.append(row)
        cells.append([s.H, s.L, s.causal, row["pass"], f"`{row['config']}`", f"{row['tflops']:.4g}",
                      "" if base is None else f"{base:.4g}", "" if base is None else f"{row['tflops'] / base:.2f}"])
    lines += table(["H", "L", "causal", "pass", "best configuration", "TFLOP/s", "default's TFLOP/s",
                    "best / default"], cells)
    lines += ["", "As `BlockSizes` (the fwd+bwd best at the sweep length; its forward part is the forward's best "
              "then):", "", "```"]
    for row in best_rows:
        if row["pass"] == "fwd+bwd" and row["L"] == sweep.grid.length:
            fields = {k: tuple(v) if k.startswith("launch") else v for k, v in row["settings"].items()}
            lines.append(f"H {row['H']} {'causal' if row['causal'] else 'bidirectional'}: "
                         f"BlockSizes({', '.join(f'{k}={v}' for k, v in fields.items())})")
    lines += ["```", "", "## Every configuration", ""]
    ordered = sorted(sweep.rows.values(), key=lambda r: (r["pass"], r["H"], r["L"], r["causal"], -(r["tflops"] or 0)))
    lines += table(["step", "H", "L", "causal", "pass", "configuration", "ms", "TFLOP/s", "max rel. error", "status"],
                   [[r["step"], r["H"], r["L"], r["causal"], r["pass"], f"`{r['config']}`",
                     "" if r["ms"] is None else f"{r['ms']:.3f}", "" if r["tflops"] is None else f"{r['tflops']:.4g}",
                     "" if r["error"] is None else f"{r['error']:.1e}", r["status"]] for r in ordered])
    left_out = [r for r in ordered if r["status"] != "ok"]
    count = lambda *starts: sum(r["status"].startswith(starts) for r in left_out)
    lines += ["", f"## Left out: {len(left_out)} configuration(s)", "",
              f"{count('spills')} spill registers, {count('does not')} do not compile or run, {count('WRONG')} differ "
              f"from xla, {count('skipped')} were skipped when their step's budget was spent.", ""]
    lines += table(["step", "H", "L", "causal", "pass", "configuration", "status"],
                   [[r["step"], r["H"], r["L"], r["causal"], r["pass"], f"`{r['config']}`", r["status"]]
                    for r in left_out])
    return lines, best_rows


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="triton_sweep_out", help="directory for report.md and sweep.json")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny grid, Pallas interpreted")
    parser.add_argument("--iters", type=int, default=None, help="timed steps per configuration (default 10, smoke 1)")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="multiplies every step's time budget")
    args = parser.parse_args(argv)
    if not args.smoke and jax.default_backend() != "gpu":
        parser.error(f"the sweep times Triton kernels on a GPU (JAX backend is {jax.default_backend()}); "
                     f"on CPU run --smoke")
    os.makedirs(args.out, exist_ok=True)
    if not args.smoke:
        jax.config.update("jax_compilation_cache_dir", os.path.join(args.out, "jax_cache"))  # a rerun compiles less
    grid = SMOKE if args.smoke else GRID
    start = time.monotonic()
    sweep = run(grid, args.iters or (1 if args.smoke else 10), args.budget_scale * (10 if args.smoke else 1))
    lines, best = report(sweep, argv, args.smoke, time.monotonic() - start)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(), smoke=args.smoke,
                       date=f"{datetime.date.today()}", command=" ".join(["python -m benchmarks.triton_sweep", *argv]),
                       grid=grid._asdict(), rows=list(sweep.rows.values()), best=best), f, indent=1)
    wrong = [r for r in sweep.rows.values() if r["status"].startswith("WRONG")]
    log(f"report written to {os.path.join(args.out, 'report.md')} and sweep.json; {len(wrong)} configuration(s) wrong")
    for row in wrong:
        log(f"WRONG: {Sweep.label(row)}: {row['status']}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
