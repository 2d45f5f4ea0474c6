"""Pallas kernels for the chunked gated delta rule (gated DeltaNet), forward and backward (tested against
`tfm.ops.delta_rule`'s chunked form).

Letters as in tfm.ops.delta_rule: H heads, K the query/key head dim, V the value head dim. Per batch row and
head the sequence is cut into chunks of L tokens; with q, k [L, K], v [L, V], beta [L, 1], the running sums cs
of the log decays g (<= 0) within the chunk and the state S [K, V] entering it, the decays D, e, w, tau are
Mamba-2's (`tfm.kernels.ssd.decays`: D[i, j] = exp(cs_i - cs_j) for j <= i in one sequence, e from the
entering state, w to the leaving one, tau through the chunk) and

  A = strict lower part of beta_i D_ij k_i.k_j      T = (I + A)^-1
  U = T (beta v)       Wk = T (beta e k)            W = U - Wk S   (the corrected values)
  o = e (q S) + (D o q k^T) W                      S_next = tau S + (w k)^T W

T is formed on the matrix units by doubling: A is nilpotent, so (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...,
2 (log2 L - 1) products of [L, L] tiles. T, U, Wk and W stay fp32; the other products take their operands in
the input dtype (fp32 accumulation).

Drivers as tfm.kernels.ssd's: grid (TPU: a sequential chunk axis, the state in VMEM scratch) and loop (GPU
Triton, CPU interpret: a loop over chunks). The forward writes the state entering every chunk.

Backward (`jax.custom_vjp`), two Pallas kernels, each recomputing the chunk's tiles. With G = dLoss/dS_next
(the final state's cotangent after the last chunk) and dW = (D o q k^T)^T do + (w k) G:
  gated_delta_bwd_state  the chunks in reverse (loop or grid driver): G <- tau G + (e q)^T do - Wk^T dW,
                         writing each chunk's G and, past the first chunk, dh0.
  gated_delta_bwd_chunk  every chunk at once (grid (B, H, chunks), parallel), from its entering S and leaving G,
                         with [dRv | dRk] = T^T [dW | -dW S^T]:
  dq = (dattn o D) k + e (do S^T)              dattn = do W^T
  dv = beta dRv        dA = -(dRv U^T + dRk Wk^T) on the strict lower part
  dk = (dattn o D)^T q + w (W G^T) + beta e dRk + (dkk + dkk^T) k,  dkk = dA o beta D
  dbeta = <v, dRv> + e <k, dRk> + sum_j dA_ij D_ij k_i.k_j
  dcs from (dattn o q k^T + dA o beta k k^T) o D (rows minus columns), e, w and tau, as in the SSD kernels.
On an H100 these fit the registers only at small head dims (16 at chunk 16, 64 at chunk 16 for the forward):
at K = V = 128 every kernel spills, the forward even at chunk 16, and (tried, compile-only) still with V split
into blocks of 16 columns per program (the state's columns are independent), with 2 or 4 warps, or with every
product in bf16; the cause is not yet found.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tfm.kernels.ssd import (Config, chunk_sums, decays, dot, forward_kernel, pad, padded, params, scratch,
                             state_backward_kernel, tiling, views)


def _inverse(A):
    """(I + A)^-1 for a strictly lower-triangular fp32 A [L, L] (L a power of two), by doubling."""
    L = A.shape[0]
    i, j = (lax.broadcasted_iota(jnp.int32, (L, L), axis) for axis in (0, 1))
    power = -A
    T = jnp.where(i == j, 1.0, 0.0) + power
    for _ in range(L.bit_length() - 2):  # T covers the powers below 2^(step + 1); A^L = 0
        power = dot(power, power)
        T = T + dot(T, power)
    return T


def _tiles(q, k, v, beta, cs_col, cs_row, st_col, st_row, S):
    """The chunk's forward tiles: D, e, w, tau, k k^T, A, T, U, Wk, W (module docstring; W None without S), fp32."""
    L = q.shape[0]
    D, e, w, tau = decays(cs_col, cs_row, st_col, st_row)
    i, j = (lax.broadcasted_iota(jnp.int32, (L, L), axis) for axis in (0, 1))
    kk = dot(k, k, (1, 1))
    A = jnp.where(i > j, beta * D * kk, 0.0)
    T = _inverse(A)
    kf = k.astype(jnp.float32)
    U = dot(T, beta * v.astype(jnp.float32))
    Wk = dot(T, (beta * e) * kf)
    return D, e, w, tau, kk, A, T, U, Wk, None if S is None else U - dot(Wk, S)


def _chunk_forward(q, k, v, beta, cs_col, cs_row, st_col, st_row, S):
    """-> o [L, V] fp32, S_next [K, V] fp32."""
    dtype = q.dtype
    D, e, w, tau, _, _, _, _, _, W = _tiles(q, k, v, beta, cs_col, cs_row, st_col, st_row, S)
    W_in = W.astype(dtype)
    o = e * dot(q, S.astype(dtype)) + dot((D * dot(q, k, (1, 1))).astype(dtype), W_in)
    return o, tau * S + dot((w * k).astype(dtype), W_in, (0, 0))


def _dW(attn, w, k, G, do):
    """dLoss/dW [L, V], fp32: (D o q k^T)^T do + (w k) G."""
    dtype = k.dtype
    return dot(attn.astype(dtype), do, (0, 0)) + dot((w * k).astype(dtype), G.astype(dtype))


def _state_backward(q, k, v, beta, cs_col, cs_row, st_col, st_row, G, do):
    """dLoss/dS for the state S entering the chunk, given G = dLoss/dS_next: tau G + (e q)^T do - Wk^T dW, fp32."""
    D, e, w, tau, _, _, _, _, Wk, _ = _tiles(q, k, v, beta, cs_col, cs_row, st_col, st_row, None)
    dW = _dW(D * dot(q, k, (1, 1)), w, k, G, do)
    return tau * G + dot((e * q).astype(q.dtype), do, (0, 0)) - dot(Wk, dW, (0, 0))


def _chunk_backward(q, k, v, beta, cs_col, cs_row, st_col, st_row, S, G, do):
    """The chunk's gradients given S (entering) and G = dLoss/dS_next: dq, dk, dv, dbeta [L, 1], dcs_col [L, 1]
    and dcs_row [1, L], fp32."""
    dtype = q.dtype
    L = q.shape[0]
    D, e, w, tau, kk, A, T, U, Wk, W = _tiles(q, k, v, beta, cs_col, cs_row, st_col, st_row, S)
    f32 = lambda x: x.astype(jnp.float32)
    qk = dot(q, k, (1, 1))
    attn = D * qk
    S_in, G_in = S.astype(dtype), G.astype(dtype)
    dW = _dW(attn, w, k, G, do)
    dattn = dot(do, W.astype(dtype), (1, 1))  # [L, L]
    dq = dot((dattn * D).astype(dtype), k) + e * dot(do, S_in, (1, 1))
    dk = dot((dattn * D).astype(dtype), q, (0, 0))
    de = jnp.sum(f32(do) * dot(q, S_in), axis=1, keepdims=True)
    WG = dot(W.astype(dtype), G_in, (1, 1))  # [L, K]
    dk = dk + w * WG
    dw = jnp.sum(f32(k) * WG, axis=1, keepdims=True)
    dtau = jnp.sum(jnp.sum(G * S, axis=1, keepdims=True), axis=0, keepdims=True)
    dWk = -dot(dW, S, (1, 1))  # [L, K], fp32
    dRv, dRk = dot(T, dW, (0, 0)), dot(T, dWk, (0, 0))  # T^T [dU | dWk]
    i, j = (lax.broadcasted_iota(jnp.int32, (L, L), axis) for axis in (0, 1))
    dA = jnp.where(i > j, -(dot(dRv, U, (1, 1)) + dot(dRk, Wk, (1, 1))), 0.0)
    dv = beta * dRv
    k_dRk = jnp.sum(f32(k) * dRk, axis=1, keepdims=True)
    dk = dk + (beta * e) * dRk
    dbeta = jnp.sum(f32(v) * dRv, axis=1, keepdims=True) + e * k_dRk + jnp.sum(dA * D * kk, axis=1, keepdims=True)
    de = de + beta * k_dRk
    dkk = dA * beta * D
    dk = dk + dot(dkk, f32(k)) + dot(dkk, f32(k), (0, 0))
    Q = (dattn * qk + dA * beta * kk) * D  # d (cs_i - cs_j)
    to_state = dw * w
    last = lax.broadcasted_iota(jnp.int32, (L, 1), 0) == L - 1
    dcs_col = (jnp.sum(Q, axis=1, keepdims=True) + de * e - to_state
               + jnp.where(last, jnp.sum(to_state, axis=0, keepdims=True) + dtau * tau, 0.0))
    return dq, dk, dv, dbeta, dcs_col, -jnp.sum(Q, axis=0, keepdims=True)


# --------------------------------------------------------------------------------------
# Kernels. Refs: q, k, v, beta, cs_col, cs_row, st_col, st_row, then the forward's h0 or the backward's
# states, do, dh; outputs; scratch (grid driver).
# --------------------------------------------------------------------------------------

_NUM_INPUTS = 8


def _chunk_bwd_kernel(*refs):
    """Grid (B, H, chunks), every chunk independent (its entering state and leaving gradient given)."""
    inputs, (s_ref, g_ref, do_ref), outputs = refs[:_NUM_INPUTS], refs[_NUM_INPUTS:_NUM_INPUTS + 3], \
        refs[_NUM_INPUTS + 3:]
    grads = _chunk_backward(*(ref[...] for ref in inputs), s_ref[...], g_ref[...], do_ref[...])
    for ref, value in zip(outputs, grads):
        ref[...] = value.astype(ref.dtype)


# --------------------------------------------------------------------------------------
# pallas_call builders. Kernel layout: q, k [B, H, Tp, K]; v, o [B, H, Tp, V]; beta [B, H, Tp, 1]; cs [B, H, Tp]
# as columns and rows, starts [B, Tp] likewise; states [B, H, chunks * K, V] fp32; h [B, H, K, V] fp32.
# --------------------------------------------------------------------------------------

_INPUT_NAMES = ("qk", "qk", "v", "col", "col", "row", "st_col", "st_row")
_ROWS = tuple(name.endswith("row") for name in _INPUT_NAMES)  # the inputs held as [1, Tp] rows
_OUTPUT_NAMES = ("qk", "qk", "v", "col", "col", "row")


def _specs(cfg: Config, Tp: int, K: int, V: int, n: int, reverse: bool = False) -> dict:
    """Block specs by operand kind for the driver's grid ((B, H) or (B, H, chunks)); reverse: the grid's chunk
    k reads chunk n - 1 - k (the backward)."""
    L = cfg.chunk
    if cfg.driver == "loop":
        whole = lambda *shape: pl.BlockSpec((None, None) + shape, lambda b, h: (b, h) + (0,) * len(shape))
        batch = lambda *shape: pl.BlockSpec((None,) + shape, lambda b, h: (b,) + (0,) * len(shape))
        return dict(qk=whole(Tp, K), v=whole(Tp, V), col=whole(Tp, 1), row=whole(1, Tp), st_col=batch(Tp, 1),
                    st_row=batch(1, Tp), state=whole(K, V), states=whole(n * K, V))
    chunk = (lambda k: n - 1 - k) if reverse else (lambda k: k)
    at = lambda shape, where: pl.BlockSpec((None, None) + shape, lambda b, h, k: where(b, h, chunk(k)))
    return dict(qk=at((L, K), lambda b, h, c: (b, h, c, 0)), v=at((L, V), lambda b, h, c: (b, h, c, 0)),
                col=at((L, 1), lambda b, h, c: (b, h, c, 0)), row=at((1, L), lambda b, h, c: (b, h, 0, c)),
                st_col=pl.BlockSpec((None, L, 1), lambda b, h, k: (b, chunk(k), 0)),
                st_row=pl.BlockSpec((None, 1, L), lambda b, h, k: (b, 0, chunk(k))),
                state=at((K, V), lambda b, h, c: (b, h, 0, 0)), states=at((K, V), lambda b, h, c: (b, h, c, 0)))


def _call(kernel, cfg: Config, specs: dict, grid, ins, outs, out_shape, name: str, *, K: int, V: int, cost,
          sequential: bool = True):
    """The pallas_call of `kernel` (operands and outputs named by kind, `_specs`); `sequential`: its last grid
    axis carries a state (scratch on the grid driver)."""
    return pl.pallas_call(kernel, grid=grid, in_specs=[specs[n] for n in ins], out_specs=tuple(specs[n] for n in outs),
                          out_shape=out_shape, scratch_shapes=scratch(cfg, K, V) if sequential else (),
                          compiler_params=params(cfg, len(grid), sequential), interpret=cfg.interpret, name=name,
                          cost_estimate=cost)


def _cost(q, v, n: int, passes: int) -> pl.CostEstimate:
    """Matrix products per chunk: about `passes` times the forward's [L, L] x (K or V) and [K, V] ones."""
    Bsz, H, Tp, K = q.shape
    V, L = v.shape[-1], Tp // n
    per_token = 2 * (L * (2 * L.bit_length() + 2 * K + 3 * V) + 3 * K * V)
    return pl.CostEstimate(flops=passes * Bsz * H * Tp * per_token, transcendentals=Bsz * H * Tp * (L + 2),
                           bytes_accessed=passes * (q.dtype.itemsize * Bsz * H * Tp * (2 * K + 2 * V)
                                                    + 4 * Bsz * H * n * K * V))


def _forward(q, k, v, beta, cs, starts, h0, cfg: Config):
    Bsz, H, Tp, K = q.shape
    V, n = v.shape[-1], Tp // cfg.chunk
    specs = _specs(cfg, Tp, K, V, n)
    grid = (Bsz, H) if cfg.driver == "loop" else (Bsz, H, n)
    kernel = forward_kernel(cfg, _chunk_forward, _ROWS)
    out_shape = (jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((Bsz, H, n * K, V), h0.dtype),
                 jax.ShapeDtypeStruct(h0.shape, h0.dtype))
    return _call(kernel, cfg, specs, grid, _INPUT_NAMES + ("state",), ("v", "states", "state"), out_shape,
                 "gated_delta_fwd", K=K, V=V, cost=_cost(q, v, n, 1))(q, k, v, beta, *views(cs, starts), h0)


def _backward(q, k, v, beta, cs, starts, states, do, dh, cfg: Config):
    """Two kernels: the state gradients in reverse chunk order (the loop or grid driver), then every chunk's
    gradients at once (a parallel grid (B, H, chunks) on every backend).
    -> dq, dk, dv, dbeta [B, H, Tp, 1], dcs_col [B, H, Tp, 1], dcs_row [B, H, 1, Tp], dh0, all fp32."""
    Bsz, H, Tp, K = q.shape
    V, n = v.shape[-1], Tp // cfg.chunk
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    operands = (q, k, v, beta, *views(cs, starts))
    specs = _specs(cfg, Tp, K, V, n, reverse=True)
    grid = (Bsz, H) if cfg.driver == "loop" else (Bsz, H, n)
    kernel = state_backward_kernel(cfg, _state_backward, _ROWS)
    leaving, dh0 = _call(kernel, cfg, specs, grid, _INPUT_NAMES + ("v", "state"), ("states", "state"),
                         (f32(Bsz, H, n * K, V), f32(Bsz, H, K, V)), "gated_delta_bwd_state", K=K, V=V,
                         cost=_cost(q, v, n, 1))(*operands, do, dh)
    parallel = cfg._replace(driver="grid")
    specs = _specs(parallel, Tp, K, V, n)
    out_shape = (f32(*q.shape), f32(*q.shape), f32(*v.shape), f32(*beta.shape), f32(*beta.shape), f32(Bsz, H, 1, Tp))
    return _call(_chunk_bwd_kernel, parallel, specs, (Bsz, H, n), _INPUT_NAMES + ("states", "states", "v"),
                 _OUTPUT_NAMES, out_shape, "gated_delta_bwd_chunk", K=K, V=V, cost=_cost(q, v, n, 2),
                 sequential=False)(*operands, states, leaving, do) + (dh0,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _delta(q, k, v, beta, cs, starts, h0, cfg: Config):
    o, _, h = _forward(q, k, v, beta, cs, starts, h0, cfg)
    return o, h


def _delta_fwd(q, k, v, beta, cs, starts, h0, cfg):
    o, states, h = _forward(q, k, v, beta, cs, starts, h0, cfg)
    return (o, h), (q, k, v, beta, cs, starts, states)


def _delta_bwd(cfg, residuals, cotangents):
    q, k, v, beta, cs, starts, states = residuals
    do, dh = cotangents
    dq, dk, dv, dbeta, dcs_col, dcs_row, dh0 = _backward(q, k, v, beta, cs, starts, states, do.astype(v.dtype),
                                                         dh.astype(jnp.float32), cfg)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbeta.astype(beta.dtype),
            (dcs_col[..., 0] + dcs_row[..., 0, :]).astype(cs.dtype), None, dh0.astype(states.dtype))


_delta.defvjp(_delta_fwd, _delta_bwd)


def chunked_gated_delta_rule(q, k, v, g, beta, reset, h0=None, *, chunk: int, backend: Optional[str] = None,
                             interpret: Optional[bool] = None):
    """The gated delta rule by the Pallas kernels (module docstring), differentiable.

    q, k [B, T, H, K] (q already scaled, both L2-normalised by the caller, in the compute dtype), v [B, T, H, V];
    g [B, T, H] log decays (<= 0; 0 at padding); beta [B, T, H] (0 at padding); reset [B, T] bool, True where a
    sequence starts (the state carried into that token is dropped); h0 [B, H, K, V] or None (zeros).
    chunk, backend, interpret as `tfm.kernels.ssd.chunked_ssd` takes them.
    Returns o [B, T, H, V] in v.dtype and the final state [B, H, K, V] (float32; float64 for float64 v).
    """
    backend, interpret, tiles, L = tiling(q.shape[1], chunk, backend, interpret, "gated delta rule")
    Bsz, T, H, K = q.shape
    V = v.shape[-1]
    Tp, Kp, Vp = -(-T // L) * L, padded(K, tiles), padded(V, tiles)
    acc = jnp.promote_types(v.dtype, jnp.float32)
    q, k = (pad(a.astype(v.dtype), Tp - T, 0, Kp - K).transpose(0, 2, 1, 3) for a in (q, k))  # [B, H, Tp, Kp]
    v = pad(v, Tp - T, 0, Vp - V).transpose(0, 2, 1, 3)
    beta = pad(beta.astype(acc), Tp - T, 0).transpose(0, 2, 1)[..., None]  # [B, H, Tp, 1]
    cs, starts = chunk_sums(g.astype(acc), reset, L, Tp)
    h0 = jnp.zeros((Bsz, H, K, V), acc) if h0 is None else h0.astype(acc)
    cfg = Config(L, 1, "grid" if backend == "tpu" else "loop", backend, interpret)
    o, h = _delta(q, k, v, beta, cs, starts, pad(h0, 0, Kp - K, Vp - V), cfg)
    return o.transpose(0, 2, 1, 3)[:, :T, :, :V], h[:, :, :K, :V]
