"""Pallas kernel for the diagonal linear recurrence h_t = a_t * h_{t-1} + b_t (Griffin's RG-LRU), forward and
backward; tested against `tfm.ops.linear_scan`'s other forms.

The recurrence is elementwise over channels, so a kernel is a sequential loop over time, each step one row of
`lanes` channels (a [1, lanes] load, a multiply-add, a store), the state carried in fp32. The channels are cut
into blocks of `lanes` (128: a TPU vector register's lanes, a GPU block's width), each block a program:
  grid  (TPU Mosaic; interpreted too)  grid (B, channel blocks, chunks), the chunk axis sequential
                      ("arbitrary"), `chunk` rows per block (VMEM), the state in VMEM scratch between chunks.
  loop  (GPU Triton, CPU interpret)  grid (B, channel blocks), whole-row blocks, one loop over every row.
Backward (`jax.custom_vjp`): the cotangent g_t of h_t is the same recurrence run from the last token,
g_t = a_{t+1} g_{t+1} + dh_t (the final state's cotangent entering after the last token), by the same kernel
reading its rows in reverse; then db = g, da_t = g_t h_{t-1} and dh_{-1} = a_0 g_0, elementwise in XLA.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

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


def _rows(a_ref, b_ref, h_ref, state, reverse: bool):
    """The recurrence over the refs' rows (from the last when `reverse`), from `state` [1, lanes] fp32; writes
    each row's state to h_ref and returns the last."""
    count = h_ref.shape[0]

    def step(i, h):
        row = pl.ds(count - 1 - i if reverse else i, 1)
        h = a_ref[row, :] * h + b_ref[row, :]
        h_ref[row, :] = h
        return h

    return lax.fori_loop(0, count, step, state)


def _loop_kernel(a_ref, b_ref, h0_ref, h_ref, final_ref, *, reverse: bool):
    final_ref[...] = _rows(a_ref, b_ref, h_ref, h0_ref[...], reverse)


def _grid_kernel(a_ref, b_ref, h0_ref, h_ref, final_ref, state_ref, *, reverse: bool):
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _init():
        state_ref[...] = h0_ref[...]

    state_ref[...] = _rows(a_ref, b_ref, h_ref, state_ref[...], reverse)

    @pl.when(c == pl.num_programs(2) - 1)
    def _finish():
        final_ref[...] = state_ref[...]


def _scan(a, b, h0, cfg: Config, reverse: bool):
    """a, b [B, Tp, Wp] fp32, h0 [B, 1, Wp] -> (h [B, Tp, Wp], final [B, 1, Wp]), fp32; `reverse` runs from
    the last row (h then holds each row's state from the end)."""
    Bsz, Tp, Wp = a.shape
    blocks, lanes = Wp // cfg.lanes, cfg.lanes
    if cfg.driver == "loop":
        grid, rows = (Bsz, blocks), pl.BlockSpec((None, Tp, lanes), lambda i, w: (i, 0, w))
        state = pl.BlockSpec((None, 1, lanes), lambda i, w: (i, 0, w))
        kernel, scratch, params = functools.partial(_loop_kernel, reverse=reverse), (), None
        if not cfg.interpret:
            from jax.experimental.pallas import triton as pltriton
            params = pltriton.CompilerParams(num_warps=1, num_stages=1)
    else:
        from jax.experimental.pallas import tpu as pltpu
        n = Tp // cfg.chunk
        chunk = (lambda k: n - 1 - k) if reverse else (lambda k: k)
        grid = (Bsz, blocks, n)
        rows = pl.BlockSpec((None, cfg.chunk, lanes), lambda i, w, k: (i, chunk(k), w))
        state = pl.BlockSpec((None, 1, lanes), lambda i, w, k: (i, 0, w))
        kernel, scratch = functools.partial(_grid_kernel, reverse=reverse), (pltpu.VMEM((1, lanes), jnp.float32),)
        params = None if cfg.interpret else pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[rows, rows, state], out_specs=(rows, state),
        out_shape=(f32(Bsz, Tp, Wp), f32(Bsz, 1, Wp)), scratch_shapes=scratch, compiler_params=params,
        interpret=cfg.interpret, name="linear_scan_bwd" if reverse else "linear_scan_fwd",
        cost_estimate=pl.CostEstimate(flops=2 * Bsz * Tp * Wp, transcendentals=0, bytes_accessed=12 * Bsz * Tp * Wp),
    )(a, b, h0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _linear_scan(a, b, h0, cfg: Config):
    return _scan(a, b, h0, cfg, reverse=False)


def _linear_scan_fwd(a, b, h0, cfg):
    h, final = _scan(a, b, h0, cfg, reverse=False)
    return (h, final), (a, h, h0)


def _linear_scan_bwd(cfg, residuals, cotangents):
    a, h, h0 = residuals
    dh, dfinal = cotangents
    a_next = jnp.concatenate([a[:, 1:], jnp.ones_like(a[:, :1])], axis=1)  # what carries g_{t+1} back to t
    g, _ = _scan(a_next, dh, dfinal, cfg, reverse=True)
    h_before = jnp.concatenate([h0, h[:, :-1]], axis=1)
    return g * h_before, g, a[:, :1] * g[:, :1]


_linear_scan.defvjp(_linear_scan_fwd, _linear_scan_bwd)


def check_chunk(chunk: int, backend: str) -> None:
    """Raises a one-line ValueError unless `chunk` is a row count the TPU driver's blocks take (a multiple of 8)."""
    if backend == "tpu" and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < SUBLANES
                             or chunk % SUBLANES):
        raise ValueError(f"mixer_chunk_size={chunk!r}: the Pallas linear-scan kernel on tpu reads that many rows per "
                         f"block and needs a multiple of {SUBLANES}; set ModelConfig.execution.mixer_chunk_size to one")


def linear_scan(a, b, h0=None, *, chunk: int, backend: Optional[str] = None, interpret: Optional[bool] = None):
    """h_t = a_t * h_{t-1} + b_t by the Pallas kernel (module docstring), differentiable.

    a, b [B, T, ...] (any trailing channel dims, flattened); h0 [B, ...] or None (zeros), the state before t = 0.
    chunk: rows per block on TPU (a multiple of 8; shrunk for a shorter T); the loop driver takes whole rows.
    backend "tpu" (grid driver), "gpu" (loop driver, Triton) or "cpu"; default JAX's. interpret: the Pallas
    interpreter; default on cpu. Returns (h [B, T, ...], final state [B, ...]), float32."""
    backend = kernel_backend(backend, "linear-scan kernel")
    interpret = backend == "cpu" if interpret is None else interpret
    check_chunk(chunk, backend)
    Bsz, T = b.shape[:2]
    channels = b.shape[2:]
    W = math.prod(channels)
    lanes = W if interpret else LANES
    Wp = -(-W // lanes) * lanes
    driver = "grid" if backend == "tpu" else "loop"
    L = min(chunk, -(-T // SUBLANES) * SUBLANES) if driver == "grid" else T
    Tp = -(-T // L) * L
    flat = lambda x, fill: jnp.pad(x.astype(jnp.float32).reshape(Bsz, T, W), ((0, 0), (0, Tp - T), (0, Wp - W)),
                                   constant_values=fill)
    a, b = flat(a, 1.0), flat(b, 0.0)  # padded steps leave the state as it is
    h0 = jnp.zeros((Bsz, 1, Wp), jnp.float32) if h0 is None else jnp.pad(
        h0.astype(jnp.float32).reshape(Bsz, 1, W), ((0, 0), (0, 0), (0, Wp - W)))
    cfg = Config(L, lanes, driver, interpret)
    h, final = _linear_scan(a, b, h0, cfg)
    return h[:, :T, :W].reshape(b.shape[:1] + (T,) + channels), final[:, 0, :W].reshape((Bsz,) + channels)
