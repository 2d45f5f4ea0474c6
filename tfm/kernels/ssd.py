"""Pallas kernels for Mamba-2's chunked SSD, forward and backward (tested against `tfm.ops.ssd`'s chunked form).

Per batch row and head, the sequence is cut into chunks of L tokens. With X = x * dt [L, P] (P head dim),
B, C [L, S] (S state size, the head's group), cs the running sum of the log decays dt * A (<= 0) within the
chunk, and the state H [P, S] entering the chunk:

  y      = ((C B^T) o D) X + e o (C H^T)        D[i, j] = exp(cs_i - cs_j), j <= i in one sequence, else 0
  H_next = tau H + (w o X)^T B                  e_i = exp(cs_i) while no sequence has started in the chunk
                                                w_j = exp(cs_{L-1} - cs_j) in the chunk's last sequence
                                                tau = e_{L-1}

The two products by (C B^T) o D and the state products run on the matrix units (fp32 accumulation, the
operands in the input dtype); states and decays are fp32. Exponents are differences of non-increasing
running sums taken in the order that makes them <= 0, and masked entries are chosen before `exp`.
Segments enter as `starts`, the number of sequence starts so far within the chunk (0 = the chunk's first
sequence, the one continuing the entering state).

The per-chunk decays (`decays`), tiles (`check_chunk`) and padding are shared with the gated delta rule's kernels
(tfm.kernels.delta_rule). The chunks of a row run in order, carrying the state. Two drivers share the per-chunk math:
  grid  (TPU Mosaic)  grid (B, N, chunks), the chunk axis sequential ("arbitrary"), the state in VMEM scratch.
  loop  (GPU Triton, CPU interpret)  grid (B, N), a `fori_loop` over chunks carrying the state.
The forward also writes the state entering every chunk [B, N, chunks * P, S] fp32, which the backward reads.

Backward (`jax.custom_vjp`), three Pallas kernels. With G = dLoss/dH_next (the final state's cotangent after
the last chunk), M = (C B^T) o D, dM = dy X^T and Q = dM o M:
  ssd_bwd_state   the chunks in reverse (loop or grid driver, as the forward): G <- tau G + dy^T (e o C),
                  writing each chunk's G and, past the first chunk, dh0.
  ssd_bwd_intra   every chunk at once (grid (B, N, chunks), parallel): dX = M^T dy, dC = (dM o D) B,
                  dB = (dM o D)^T C, and dcs_i = sum_j Q_ij - sum_j Q_ji (as a column and a row).
  ssd_bwd_across  every chunk at once, from its entering H and leaving G: dX = w o (B G^T), dC = e o (dy H),
                  dB = w o (X G), dcs_i = e_i <dy_i, (C H^T)_i> - w_i <X_i, (B G^T)_i>, and at i = L - 1
                  also sum_j w_j <X_j, (B G^T)_j> + tau <G, H>.
The two per-chunk kernels are apart so that each fits the registers of an H100 at P 64, S 128, L 64 (one
spilled). Their parts are added outside, dB and dC (per head) summed over the heads of a group. Everything
before the kernels (x * dt, the log decays, their running sums) is differentiated by JAX.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tfm.kernels.tiles import Launch, kernel_backend

FLOORS = {"tpu": 128, "gpu": 16, "cpu": 8}  # the smallest chunk per backend (`check_chunk`)
NEG = -1e30  # finite: exp() of it is 0, and nothing masked can make inf - inf


def check_chunk(chunk: int, backend: str, kernel: str = "SSD") -> None:
    """Raises a one-line ValueError unless `chunk` is a tile the `kernel` kernels lower on `backend`: a power
    of two >= 8 (cpu, interpreted), >= 16 (gpu: Triton's dot), a multiple of 128 (tpu: a lane dimension). On an
    H100 the backward fits its registers up to chunk 64 at P 64, S 128 (compiled, not yet timed); larger ones spill."""
    floor = FLOORS[backend]
    ok = isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= floor and not chunk & (chunk - 1)
    if not ok or (backend == "tpu" and chunk % 128):
        need = "a multiple of 128 (and a power of two)" if backend == "tpu" else f"a power of two >= {floor}"
        raise ValueError(f"mixer_chunk_size={chunk!r}: the Pallas {kernel} kernel on {backend} needs {need}; "
                         f"set ModelConfig.execution.mixer_chunk_size to one")


class Config(NamedTuple):
    """Static settings of one call (hashable: a nondiff argument)."""
    chunk: int
    heads_per_group: int  # SSD: heads reading one group of B and C
    driver: str  # "grid" | "loop"
    backend: str
    interpret: bool


# --------------------------------------------------------------------------------------
# Per-chunk math, shared by both drivers. Columns [L, 1] index the token as a row of X, rows [1, L]
# as a column of the [L, L] tiles; starts are int32.
# --------------------------------------------------------------------------------------

def dot(a, b, contract=(1, 0)):
    """a @ b contracting a's dim contract[0] with b's dim contract[1]; fp32 result."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _last(col):
    """col [L, 1] -> its last entry [1, 1] (a masked sum: a reduction lowers everywhere)."""
    rows = lax.broadcasted_iota(jnp.int32, col.shape, 0)
    return jnp.sum(jnp.where(rows == col.shape[0] - 1, col, jnp.zeros_like(col)), axis=0, keepdims=True)


def state_decays(cs_col, st_col):
    """e [L, 1], w [L, 1], tau [1, 1] (module docstring), fp32."""
    cs_last, st_last = _last(cs_col), _last(st_col)
    e = jnp.exp(jnp.where(st_col == 0, cs_col, NEG))
    w = jnp.exp(jnp.where(st_col == st_last, cs_last - cs_col, NEG))
    tau = jnp.exp(jnp.where(st_last == 0, cs_last, NEG))
    return e, w, tau


def decays(cs_col, cs_row, st_col, st_row):
    """D [L, L] and `_state_decays`, fp32."""
    L = cs_col.shape[0]
    i = lax.broadcasted_iota(jnp.int32, (L, L), 0)
    j = lax.broadcasted_iota(jnp.int32, (L, L), 1)
    within = (i >= j) & (st_col == st_row)
    return (jnp.exp(jnp.where(within, cs_col - cs_row, NEG)),) + state_decays(cs_col, st_col)


def _chunk_forward(X, B, C, cs_col, cs_row, st_col, st_row, H):
    """X [L, P], B, C [L, S] (input dtype), H [P, S] fp32 -> y [L, P] fp32, H_next [P, S] fp32."""
    dtype = X.dtype
    D, e, w, tau = decays(cs_col, cs_row, st_col, st_row)
    M = dot(C, B, (1, 1)) * D
    y = dot(M.astype(dtype), X) + e * dot(C, H.astype(dtype), (1, 1))
    H_next = tau * H + dot((w * X).astype(dtype), B, (0, 0))
    return y, H_next


def _intra_backward(X, B, C, cs_col, cs_row, st_col, st_row, dy):
    """The gradients of the chunk's y through (C B^T) o D: dX, dB, dC [L, .], dcs_col [L, 1], dcs_row [1, L]
    (the row and the column sums of Q), fp32."""
    dtype = X.dtype
    D = decays(cs_col, cs_row, st_col, st_row)[0]
    scores = dot(C, B, (1, 1))
    dS = dot(dy, X, (1, 1)) * D  # d scores = dM o D
    Q = dS * scores  # d (cs_i - cs_j)
    dX = dot((scores * D).astype(dtype), dy, (0, 0))
    dC = dot(dS.astype(dtype), B)
    dB = dot(dS.astype(dtype), C, (0, 0))
    return dX, dB, dC, jnp.sum(Q, axis=1, keepdims=True), -jnp.sum(Q, axis=0, keepdims=True)


def _across_backward(X, B, C, cs_col, st_col, H, G, dy):
    """The gradients through the entering state H and into the leaving one (G = dLoss/dH_next): dX, dB, dC
    [L, .] and dcs_col [L, 1], fp32."""
    dtype = X.dtype
    L = X.shape[0]
    e, w, tau = state_decays(cs_col, st_col)
    H_in, G_in = H.astype(dtype), G.astype(dtype)  # as the matrix units take them
    BG = dot(B, G_in, (1, 1))  # [L, P]
    dX = w * BG
    dC = e * dot(dy, H_in)
    dB = w * dot(X, G_in)
    to_state = w * jnp.sum(X.astype(jnp.float32) * BG, axis=1, keepdims=True)  # [L, 1]: dw o w
    through = jnp.sum(jnp.sum(G * H, axis=1, keepdims=True), axis=0, keepdims=True) * tau  # [1, 1]
    last = lax.broadcasted_iota(jnp.int32, (L, 1), 0) == L - 1
    from_state = e * jnp.sum(dy.astype(jnp.float32) * dot(C, H_in, (1, 1)), axis=1, keepdims=True)
    dcs_col = from_state - to_state + jnp.where(last, jnp.sum(to_state, axis=0, keepdims=True) + through, 0.0)
    return dX, dB, dC, dcs_col


def _state_backward(C, cs_col, st_col, G, dy):
    """dLoss/dH for the state H entering a chunk, given G = dLoss/dH_next: tau G + dy^T (e o C), fp32."""
    e, _, tau = state_decays(cs_col, st_col)
    return tau * G + dot(dy, (e * C).astype(C.dtype), (0, 0))


# --------------------------------------------------------------------------------------
# Kernels. Refs: xdt, B, C, cs_col, cs_row, st_col, st_row, then the forward's h0 or the backward's
# states, dy, dh; outputs; scratch (grid driver).
# --------------------------------------------------------------------------------------

def chunk_views(refs, rows, c, L: int):
    """Chunk c of the loop driver's whole-row refs: a [Tp, ...] ref by its rows, a [1, Tp] ref (rows[i]) by
    its columns."""
    span = pl.ds(pl.multiple_of(c * L, L), L)
    return tuple(ref[:, span] if row else ref[span, :] for ref, row in zip(refs, rows))


def _forward_grid(*refs, chunk_forward, rows):
    """Grid (B, heads, chunks), chunks sequential; blocks are one chunk's. refs: the inputs, h0; out, states,
    h; the state's scratch."""
    n = len(rows)
    inputs, h0_ref, (o_ref, states_ref, h_ref, acc) = refs[:n], refs[n], refs[n + 1:]
    c = pl.program_id(2)

    @pl.when(c == 0)
    def _init():
        acc[...] = h0_ref[...].astype(jnp.float32)

    state = acc[...]
    states_ref[...] = state
    o, state = chunk_forward(*(ref[...] for ref in inputs), state)
    o_ref[...] = o.astype(o_ref.dtype)
    acc[...] = state

    @pl.when(c == pl.num_programs(2) - 1)
    def _finish():
        h_ref[...] = state.astype(h_ref.dtype)


def _forward_loop(*refs, chunk_forward, rows, chunk: int):
    """Grid (B, heads); whole-row blocks, a loop over chunks. refs as the grid driver's, less the scratch."""
    n = len(rows)
    inputs, h0_ref, (o_ref, states_ref, h_ref) = refs[:n], refs[n], refs[n + 1:]
    L, R = chunk, h0_ref.shape[0]

    def body(c, state):
        states_ref[pl.ds(pl.multiple_of(c * R, R), R), :] = state
        o, state = chunk_forward(*chunk_views(inputs, rows, c, L), state)
        o_ref[pl.ds(pl.multiple_of(c * L, L), L), :] = o.astype(o_ref.dtype)
        return state

    h_ref[...] = lax.fori_loop(0, o_ref.shape[0] // L, body, h0_ref[...].astype(jnp.float32)).astype(h_ref.dtype)


def _state_backward_grid(*refs, state_backward, rows):
    """Grid (B, heads, chunks), chunks sequential from the last (the index maps reverse them): writes each
    chunk's G (the gradient of the state leaving it) and, at the first chunk, dh0. refs: the inputs, dout,
    dh; G, dh0; the gradient's scratch."""
    n = len(rows)
    inputs, (do_ref, dh_ref, g_ref, dh0_ref, acc) = refs[:n], refs[n:]
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc[...] = dh_ref[...].astype(jnp.float32)

    g_ref[...] = acc[...]
    G = state_backward(*(ref[...] for ref in inputs), acc[...], do_ref[...])
    acc[...] = G

    @pl.when(k == pl.num_programs(2) - 1)
    def _finish():
        dh0_ref[...] = G.astype(dh0_ref.dtype)


def _state_backward_loop(*refs, state_backward, rows, chunk: int):
    """Grid (B, heads); whole-row blocks, a loop over chunks from the last. refs as the grid driver's, less
    the scratch."""
    n = len(rows)
    inputs, (do_ref, dh_ref, g_ref, dh0_ref) = refs[:n], refs[n:]
    L, R = chunk, dh_ref.shape[0]
    count = do_ref.shape[0] // L

    def body(step, G):
        c = count - 1 - step
        g_ref[pl.ds(pl.multiple_of(c * R, R), R), :] = G
        return state_backward(*chunk_views(inputs, rows, c, L), G, do_ref[pl.ds(pl.multiple_of(c * L, L), L), :])

    dh0_ref[...] = lax.fori_loop(0, count, body, dh_ref[...].astype(jnp.float32)).astype(dh0_ref.dtype)


def forward_kernel(cfg: Config, chunk_forward, rows):
    """The forward's kernel on cfg's driver: `chunk_forward(*chunk inputs, state) -> (out, state)` over the
    chunks of each row, the state carried in fp32; rows[i]: input i is a [1, Tp] row (else [Tp, ...])."""
    if cfg.driver == "loop":
        return functools.partial(_forward_loop, chunk_forward=chunk_forward, rows=rows, chunk=cfg.chunk)
    return functools.partial(_forward_grid, chunk_forward=chunk_forward, rows=rows)


def state_backward_kernel(cfg: Config, state_backward, rows):
    """The backward's state pass on cfg's driver: `state_backward(*chunk inputs, G, dout) -> G` over the
    chunks from the last, G the gradient of the state leaving each chunk."""
    if cfg.driver == "loop":
        return functools.partial(_state_backward_loop, state_backward=state_backward, rows=rows, chunk=cfg.chunk)
    return functools.partial(_state_backward_grid, state_backward=state_backward, rows=rows)


def _intra_bwd_kernel(x_ref, b_ref, c_ref, csc_ref, csr_ref, stc_ref, str_ref, dy_ref,
                      dx_ref, db_ref, dc_ref, dcsc_ref, dcsr_ref):
    """Grid (B, N, chunks), every chunk independent."""
    grads = _intra_backward(x_ref[...], b_ref[...], c_ref[...], csc_ref[...], csr_ref[...], stc_ref[...],
                            str_ref[...], dy_ref[...])
    for ref, value in zip((dx_ref, db_ref, dc_ref, dcsc_ref, dcsr_ref), grads):
        ref[...] = value.astype(ref.dtype)


def _across_bwd_kernel(x_ref, b_ref, c_ref, csc_ref, stc_ref, h_ref, g_ref, dy_ref, dx_ref, db_ref, dc_ref, dcsc_ref):
    """Grid (B, N, chunks), every chunk independent (its entering state and leaving gradient given)."""
    grads = _across_backward(x_ref[...], b_ref[...], c_ref[...], csc_ref[...], stc_ref[...], h_ref[...], g_ref[...],
                             dy_ref[...])
    for ref, value in zip((dx_ref, db_ref, dc_ref, dcsc_ref), grads):
        ref[...] = value.astype(ref.dtype)


# --------------------------------------------------------------------------------------
# pallas_call builders. Kernel layout: xdt, y [B, N, Tp, P]; B, C [B, G, Tp, S]; cs [B, N, Tp] as
# columns [B, N, Tp, 1] and rows [B, N, 1, Tp]; starts [B, Tp] as [B, Tp, 1] and [B, 1, Tp];
# states [B, N, chunks * P, S] fp32; h [B, N, P, S] fp32.
# --------------------------------------------------------------------------------------

def div(x, d: int):
    """x // d for a non-negative int32 x (lax.div lowers on every backend)."""
    return lax.div(jnp.asarray(x, jnp.int32), jnp.int32(d))


def _specs(cfg: Config, Tp: int, P: int, S: int, n: int, reverse: bool = False) -> dict:
    """Block specs by operand kind for the driver's grid ((B, N) or (B, N, chunks)); reverse: the grid's
    chunk k reads chunk n - 1 - k (the backward)."""
    L, R = cfg.chunk, cfg.heads_per_group
    if cfg.driver == "loop":
        whole = lambda *shape: pl.BlockSpec((None, None) + shape, lambda b, h: (b, h) + (0,) * len(shape))
        batch = lambda *shape: pl.BlockSpec((None,) + shape, lambda b, h: (b,) + (0,) * len(shape))
        return dict(x=whole(Tp, P), bc=pl.BlockSpec((None, None, Tp, S), lambda b, h: (b, div(h, R), 0, 0)),
                    head_s=whole(Tp, S), cs_col=whole(Tp, 1), cs_row=whole(1, Tp), st_col=batch(Tp, 1),
                    st_row=batch(1, Tp), state=whole(P, S), states=whole(n * P, S))
    chunk = (lambda k: n - 1 - k) if reverse else (lambda k: k)
    at = lambda shape, where: pl.BlockSpec((None, None) + shape, lambda b, h, k: where(b, h, chunk(k)))
    return dict(x=at((L, P), lambda b, h, c: (b, h, c, 0)), bc=at((L, S), lambda b, h, c: (b, div(h, R), c, 0)),
                head_s=at((L, S), lambda b, h, c: (b, h, c, 0)),
                cs_col=at((L, 1), lambda b, h, c: (b, h, c, 0)), cs_row=at((1, L), lambda b, h, c: (b, h, 0, c)),
                st_col=pl.BlockSpec((None, L, 1), lambda b, h, k: (b, chunk(k), 0)),
                st_row=pl.BlockSpec((None, 1, L), lambda b, h, k: (b, 0, chunk(k))),
                state=at((P, S), lambda b, h, c: (b, h, 0, 0)), states=at((P, S), lambda b, h, c: (b, h, c, 0)))


def params(cfg: Config, num_axes: int, sequential: bool = True):
    """TPU: the last grid axis sequential (it carries the state) unless not `sequential`; GPU: Triton's."""
    if cfg.interpret:
        return None
    if cfg.backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.CompilerParams(dimension_semantics=("parallel",) * (num_axes - 1)
                                    + ("arbitrary" if sequential else "parallel",))
    from jax.experimental.pallas import triton as pltriton
    launch = Launch()
    return pltriton.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages)


def scratch(cfg: Config, P: int, S: int):
    """The grid driver's fp32 state [P, S] in VMEM; the loop driver's lives in the loop."""
    if cfg.driver == "loop":
        return ()
    from jax.experimental.pallas import tpu as pltpu
    return (pltpu.VMEM((P, S), jnp.float32),)


def views(cs, starts):
    """cs [B, N, Tp], starts [B, Tp] -> their column and row views (free reshapes)."""
    return cs[..., None], cs[..., None, :], starts[..., None], starts[:, None, :]


def _inputs(specs):
    return [specs[name] for name in ("x", "bc", "bc", "cs_col", "cs_row", "st_col", "st_row")]


def _forward(xdt, B, C, cs, starts, h0, cfg: Config):
    """-> y [B, N, Tp, P] (xdt.dtype), states [B, N, chunks * P, S], h [B, N, P, S] (h0.dtype)."""
    Bsz, N, Tp, P = xdt.shape
    S, n = B.shape[-1], Tp // cfg.chunk
    specs = _specs(cfg, Tp, P, S, n)
    grid = (Bsz, N) if cfg.driver == "loop" else (Bsz, N, n)
    kernel = forward_kernel(cfg, _chunk_forward, rows=(False, False, False, False, True, False, True))
    out_shape = (jax.ShapeDtypeStruct(xdt.shape, xdt.dtype), jax.ShapeDtypeStruct((Bsz, N, n * P, S), h0.dtype),
                 jax.ShapeDtypeStruct(h0.shape, h0.dtype))
    L = cfg.chunk
    flops = 2 * Bsz * N * Tp * (L * (S + P) + 3 * P * S)
    return pl.pallas_call(
        kernel, grid=grid, in_specs=_inputs(specs) + [specs["state"]],
        out_specs=(specs["x"], specs["states"], specs["state"]), out_shape=out_shape,
        scratch_shapes=scratch(cfg, P, S), compiler_params=params(cfg, len(grid)), interpret=cfg.interpret,
        name="ssd_fwd", cost_estimate=pl.CostEstimate(
            flops=flops, transcendentals=Bsz * N * Tp * (L + 2),
            bytes_accessed=xdt.dtype.itemsize * Bsz * Tp * (2 * N * P + 2 * B.shape[1] * S) + 4 * Bsz * N * n * P * S),
    )(xdt, B, C, *views(cs, starts), h0)


def _backward(xdt, B, C, cs, starts, states, dy, dh, cfg: Config):
    """Two kernels: the state gradients in reverse chunk order (the loop or grid driver), then every chunk's
    gradients at once (a parallel grid (B, N, chunks) on every backend).
    -> dxdt [B, N, Tp, P], dB, dC per head [B, N, Tp, S], dcs_col [B, N, Tp, 1], dcs_row [B, N, 1, Tp],
    dh0 [B, N, P, S], all fp32."""
    Bsz, N, Tp, P = xdt.shape
    S, n, L = B.shape[-1], Tp // cfg.chunk, cfg.chunk
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    cs_col, cs_row, st_col, st_row = views(cs, starts)

    specs = _specs(cfg, Tp, P, S, n, reverse=True)
    grid = (Bsz, N) if cfg.driver == "loop" else (Bsz, N, n)
    kernel = state_backward_kernel(cfg, _state_backward, rows=(False, False, False))
    leaving, dh0 = pl.pallas_call(
        kernel, grid=grid, in_specs=[specs[name] for name in ("bc", "cs_col", "st_col", "x", "state")],
        out_specs=(specs["states"], specs["state"]), out_shape=(f32(Bsz, N, n * P, S), f32(Bsz, N, P, S)),
        scratch_shapes=scratch(cfg, P, S), compiler_params=params(cfg, len(grid)), interpret=cfg.interpret,
        name="ssd_bwd_state", cost_estimate=pl.CostEstimate(
            flops=2 * Bsz * N * Tp * P * S, transcendentals=Bsz * N * Tp,
            bytes_accessed=xdt.dtype.itemsize * Bsz * Tp * (N * P + B.shape[1] * S) + 4 * Bsz * N * n * P * S),
    )(C, cs_col, st_col, dy, dh)

    specs = _specs(cfg._replace(driver="grid"), Tp, P, S, n)
    sizes = lambda *widths: tuple(f32(Bsz, N, Tp, width) for width in widths)
    per_chunk = dict(grid=(Bsz, N, n), compiler_params=params(cfg, 3, sequential=False), interpret=cfg.interpret)
    intra = pl.pallas_call(
        _intra_bwd_kernel, in_specs=_inputs(specs) + [specs["x"]],
        out_specs=(specs["x"], specs["head_s"], specs["head_s"], specs["cs_col"], specs["cs_row"]),
        out_shape=sizes(P, S, S, 1) + (f32(Bsz, N, 1, Tp),), name="ssd_bwd_intra", **per_chunk,
        cost_estimate=pl.CostEstimate(flops=2 * Bsz * N * Tp * L * (2 * S + 3 * P), transcendentals=Bsz * N * Tp * L,
                                      bytes_accessed=xdt.dtype.itemsize * Bsz * Tp * (2 * N * P + 2 * B.shape[1] * S)
                                      + 4 * Bsz * N * Tp * (P + 2 * S + 2)),
    )(xdt, B, C, cs_col, cs_row, st_col, st_row, dy)
    across = pl.pallas_call(
        _across_bwd_kernel, in_specs=[specs[name] for name in ("x", "bc", "bc", "cs_col", "st_col", "states", "states",
                                                               "x")],
        out_specs=(specs["x"], specs["head_s"], specs["head_s"], specs["cs_col"]), out_shape=sizes(P, S, S, 1),
        name="ssd_bwd_across", **per_chunk,
        cost_estimate=pl.CostEstimate(flops=2 * Bsz * N * Tp * 4 * P * S, transcendentals=Bsz * N * Tp * 2,
                                      bytes_accessed=xdt.dtype.itemsize * Bsz * Tp * (2 * N * P + 2 * B.shape[1] * S)
                                      + 4 * Bsz * N * (2 * n * P * S + Tp * (P + 2 * S + 1))),
    )(xdt, B, C, cs_col, st_col, states, leaving, dy)
    grads = tuple(a + b for a, b in zip(intra, across)) + intra[4:]
    return grads + (dh0,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ssd(xdt, B, C, cs, starts, h0, cfg: Config):
    y, _, h = _forward(xdt, B, C, cs, starts, h0, cfg)
    return y, h


def _ssd_fwd(xdt, B, C, cs, starts, h0, cfg):
    y, states, h = _forward(xdt, B, C, cs, starts, h0, cfg)
    return (y, h), (xdt, B, C, cs, starts, states)


def _ssd_bwd(cfg, residuals, cotangents):
    xdt, B, C, cs, starts, states = residuals
    dy, dh = cotangents
    dx, dB, dC, dcs_col, dcs_row, dh0 = _backward(xdt, B, C, cs, starts, states, dy.astype(xdt.dtype),
                                                  dh.astype(jnp.float32), cfg)
    Bsz, G, Tp, S = B.shape
    per_group = lambda d: d.reshape(Bsz, G, cfg.heads_per_group, Tp, S).sum(2).astype(B.dtype)
    return (dx.astype(xdt.dtype), per_group(dB), per_group(dC), (dcs_col[..., 0] + dcs_row[..., 0, :]).astype(cs.dtype),
            None, dh0.astype(states.dtype))


_ssd.defvjp(_ssd_fwd, _ssd_bwd)


def padded(size: int, backend: str) -> int:
    """Head dim P and state size S as the kernel takes them: as they are when interpreted, else a power of
    two >= 16 (Triton's dot; zero padding changes nothing)."""
    return size if backend == "cpu" else max(16, pl.next_power_of_2(size))


def tiling(T: int, chunk: int, backend: Optional[str], interpret: Optional[bool], kernel: str = "SSD"):
    """(backend, interpret, the backend whose tiles apply: "cpu" when interpreted, the chunk for T tokens:
    `chunk` checked, shrunk to the power of two covering a shorter T, not below that backend's floor)."""
    backend = kernel_backend(backend, "SSD kernel")
    interpret = backend == "cpu" if interpret is None else interpret
    tiles = "cpu" if interpret else backend  # the interpreter takes any power-of-two chunk >= 8
    check_chunk(chunk, tiles, kernel)
    return backend, interpret, tiles, min(chunk, max(FLOORS[tiles], pl.next_power_of_2(T)))


def chunked_ssd(xdt, log_decay, B, C, reset, h0=None, *, chunk: int, backend: Optional[str] = None,
                interpret: Optional[bool] = None):
    """Mamba-2's SSD by the Pallas kernels (module docstring), differentiable.

    xdt [B, T, N, P]: x * dt, in the compute dtype (bf16 feeds the matrix units); log_decay [B, T, N]: dt * A,
    <= 0 (0 at padding); B, C [B, T, G, S] (head n reads group n // (N // G)); reset [B, T] bool, True where a
    sequence starts (the state carried into that token is dropped); h0 [B, N, P, S] or None (zeros).
    chunk: tokens per chunk (`tiling`). backend "tpu" (grid driver), "gpu" (loop driver, Triton) or "cpu";
    default JAX's.
    interpret: the Pallas interpreter; default on cpu.
    Returns y [B, T, N, P] in xdt.dtype and the final state [B, N, P, S] (float32; float64 for float64 xdt).
    """
    backend, interpret, tiles, L = tiling(xdt.shape[1], chunk, backend, interpret)
    Bsz, T, N, P = xdt.shape
    G, S = B.shape[2:]
    Tp, Pp, Sp = -(-T // L) * L, padded(P, tiles), padded(S, tiles)
    acc = jnp.promote_types(xdt.dtype, jnp.float32)
    xdt = pad(xdt, Tp - T, 0, Pp - P).transpose(0, 2, 1, 3)  # [B, N, Tp, Pp]
    B, C = (pad(a, Tp - T, 0, Sp - S).transpose(0, 2, 1, 3) for a in (B, C))  # [B, G, Tp, Sp]
    cs, starts = chunk_sums(log_decay.astype(acc), reset, L, Tp)
    h0 = jnp.zeros((Bsz, N, P, S), acc) if h0 is None else h0.astype(acc)
    cfg = Config(L, N // G, "grid" if backend == "tpu" else "loop", backend, interpret)
    y, h = _ssd(xdt, B, C, cs, starts, pad(h0, 0, Pp - P, Sp - S), cfg)
    return y.transpose(0, 2, 1, 3)[:, :T, :, :P], h[:, :, :P, :S]


def pad(a, *widths):
    """a padded at the end of its dims 1, 2, ... by `widths` (zeros)."""
    return jnp.pad(a, [(0, 0)] + [(0, w) for w in widths])


def chunk_sums(log_decay, reset, L: int, Tp: int):
    """log_decay [B, T, N, ...] (a decay per head, or per head and channel), reset [B, T] -> (cs [B, N, Tp, ...]:
    the running sums of the log decays within each chunk of L tokens, starts [B, Tp] int32: the sequence starts so
    far within the chunk), T padded to Tp."""
    (Bsz, T, N), channels = log_decay.shape[:3], log_decay.shape[3:]
    per_head = jnp.moveaxis(pad(log_decay, Tp - T, *(0,) * (log_decay.ndim - 2)), 1, 2)  # [B, N, Tp, ...]
    cs = jnp.cumsum(per_head.reshape((Bsz, N, Tp // L, L) + channels), 3)
    starts = jnp.cumsum(pad(reset, Tp - T).reshape(Bsz, Tp // L, L), -1, dtype=jnp.int32)
    return cs.reshape((Bsz, N, Tp) + channels), starts.reshape(Bsz, Tp)
