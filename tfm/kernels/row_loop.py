"""A sequential loop over time as a Pallas kernel, for recurrences that are elementwise over channels (the
linear-time mixers' diagonal scans: tfm.kernels.linear_scan, selective_scan, wkv).

Each step reads one row of every sequence (a [1, lanes] slice of channels, or a [1, 1] per-token value
broadcast over them) and the carry ([1, lanes] rows, fp32), and writes one row of every output. The channels
are cut into blocks of `lanes` (128: a TPU vector register's lanes, a GPU block's width), each block a program:
  grid  (TPU Mosaic; interpreted too)  grid (B, channel blocks, chunks), the chunk axis sequential
                      ("arbitrary"), `chunk` rows per block (VMEM), the carry in VMEM scratch between chunks.
  loop  (GPU Triton, CPU interpret)  grid (B, channel blocks), whole-row blocks, one loop over every row.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tfm.kernels.tiles import kernel_backend

LANES = 128  # channels per program on TPU and GPU (interpreted: every channel in one)
SUBLANES = 8  # TPU rows per vector register: the grid driver's chunk is a multiple


class Config(NamedTuple):
    """Static settings of one call (hashable: a nondiff argument)."""
    chunk: int  # rows per block (grid driver); the loop driver's blocks are whole rows
    lanes: int
    driver: str  # "grid" | "loop"
    interpret: bool
    warps: int = 1  # GPU: warps per program (lanes / (32 warps) channels per thread in every row)


def check_chunk(chunk: int, backend: str, kernel: str) -> None:
    """Raises a one-line ValueError unless `chunk` is a row count the TPU driver's blocks take (a multiple of 8)."""
    if backend == "tpu" and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < SUBLANES
                             or chunk % SUBLANES):
        raise ValueError(f"mixer_chunk_size={chunk!r}: the Pallas {kernel} kernel on tpu reads that many rows per "
                         f"block and needs a multiple of {SUBLANES}; set ModelConfig.execution.mixer_chunk_size to one")


def settings(T: int, W: int, chunk: int, backend: Optional[str], interpret: Optional[bool], kernel: str,
             warps: int = 1) -> tuple[Config, int, int]:
    """(cfg, Tp, Wp) for `kernel`'s T rows of W channels: backend (None: JAX's) and interpret (None: on cpu)
    resolved and `chunk` checked (`check_chunk`); the loop driver but on TPU, `chunk` rows a block there (shrunk
    for a shorter T), `LANES` channels a program compiled, all W interpreted; `warps` per program on GPU (a
    kernel carrying many rows spreads them over more threads). Tp, Wp: T and W rounded up to the rows and lanes."""
    backend = kernel_backend(backend, f"{kernel} kernel")
    interpret = backend == "cpu" if interpret is None else interpret
    check_chunk(chunk, backend, kernel)
    driver = "grid" if backend == "tpu" else "loop"
    rows = min(chunk, -(-T // SUBLANES) * SUBLANES) if driver == "grid" else T
    cfg = Config(rows, W if interpret else LANES, driver, interpret, warps)
    return cfg, -(-T // cfg.chunk) * cfg.chunk, -(-W // cfg.lanes) * cfg.lanes


def _rows(step, seq_refs, out_refs, carry, reverse: bool):
    """step over the refs' rows (from the last when `reverse`) from `carry`; returns the last carry."""
    count = out_refs[0].shape[0]

    def body(i, carry):
        row = pl.ds(count - 1 - i if reverse else i, 1)
        outs, carry = step(tuple(ref[row, :] for ref in seq_refs), carry)
        for ref, out in zip(out_refs, outs):
            ref[row, :] = out
        return carry

    return lax.fori_loop(0, count, body, carry)


def _loop_kernel(*refs, step, counts, reverse):
    n_seq, n_carry, n_out = counts
    seq_refs, carry_refs = refs[:n_seq], refs[n_seq:n_seq + n_carry]
    out_refs, final_refs = refs[n_seq + n_carry:n_seq + n_carry + n_out], refs[n_seq + n_carry + n_out:]
    carry = _rows(step, seq_refs, out_refs, tuple(ref[...] for ref in carry_refs), reverse)
    for ref, value in zip(final_refs, carry):
        ref[...] = value


def _grid_kernel(*refs, step, counts, reverse):
    n_seq, n_carry, n_out = counts
    seq_refs, carry_refs = refs[:n_seq], refs[n_seq:n_seq + n_carry]
    out_refs = refs[n_seq + n_carry:n_seq + n_carry + n_out]
    final_refs = refs[n_seq + n_carry + n_out:n_seq + 2 * n_carry + n_out]
    scratch = refs[n_seq + 2 * n_carry + n_out:]
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _init():
        for state, ref in zip(scratch, carry_refs):
            state[...] = ref[...]

    carry = _rows(step, seq_refs, out_refs, tuple(ref[...] for ref in scratch), reverse)
    for state, value in zip(scratch, carry):
        state[...] = value

    @pl.when(c == pl.num_programs(2) - 1)
    def _finish():
        for ref, state in zip(final_refs, scratch):
            ref[...] = state[...]


def row_loop(step: Callable, sequences, carry, n_out: int, cfg: Config, *, reverse: bool, name: str,
             cost: pl.CostEstimate):
    """step(rows, carry) -> (outs, carry) over every row of `sequences`.

    sequences: fp32 [B, Tp, Wp] (a row [1, lanes] of channels) or [B, Tp, 1] (a row [1, 1]: a per-token value);
    carry: fp32 [B, 1, Wp] each, the carry before the first row (the last when `reverse`); n_out outputs [B, Tp, Wp].
    Returns (outputs, final carry [B, 1, Wp] each), fp32."""
    Bsz, Tp, Wp = sequences[0].shape
    blocks, lanes = Wp // cfg.lanes, cfg.lanes
    counts = (len(sequences), len(carry), n_out)
    width = lambda x: lanes if x.shape[2] == Wp else 1
    if cfg.driver == "loop":
        grid = (Bsz, blocks)
        rows = lambda x: pl.BlockSpec((None, Tp, width(x)), lambda i, w: (i, 0, w if width(x) == lanes else 0))
        state = pl.BlockSpec((None, 1, lanes), lambda i, w: (i, 0, w))
        kernel, scratch, params = functools.partial(_loop_kernel, step=step, counts=counts, reverse=reverse), (), None
        if not cfg.interpret:
            from jax.experimental.pallas import triton as pltriton
            params = pltriton.CompilerParams(num_warps=cfg.warps, num_stages=1)
    else:
        from jax.experimental.pallas import tpu as pltpu
        n = Tp // cfg.chunk
        chunk = (lambda k: n - 1 - k) if reverse else (lambda k: k)
        grid = (Bsz, blocks, n)
        rows = lambda x: pl.BlockSpec((None, cfg.chunk, width(x)),
                                      lambda i, w, k: (i, chunk(k), w if width(x) == lanes else 0))
        state = pl.BlockSpec((None, 1, lanes), lambda i, w, k: (i, 0, w))
        kernel = functools.partial(_grid_kernel, step=step, counts=counts, reverse=reverse)
        scratch = tuple(pltpu.VMEM((1, lanes), jnp.float32) for _ in carry)
        params = None if cfg.interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    out_spec = rows(sequences[0])
    outs = pl.pallas_call(
        kernel, grid=grid, in_specs=[rows(x) for x in sequences] + [state] * len(carry),
        out_specs=[out_spec] * n_out + [state] * len(carry),
        out_shape=[f32(Bsz, Tp, Wp)] * n_out + [f32(Bsz, 1, Wp)] * len(carry), scratch_shapes=scratch,
        compiler_params=params, interpret=cfg.interpret, name=name, cost_estimate=cost,
    )(*sequences, *carry)
    return tuple(outs[:n_out]), tuple(outs[n_out:])
