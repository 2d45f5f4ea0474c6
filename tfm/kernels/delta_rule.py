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
Triton, CPU interpret: a loop over chunks). The forward writes the state entering every chunk. The builders,
the custom VJP and the padding (`run_kernels`) take the per-chunk math as a `Family`: this module's
(GATED_DELTA) and tfm.kernels.kda's (a decay per key channel).

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
from typing import Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tfm.kernels.ssd import (Config, chunk_sums, decays, dot, forward_kernel, pad, padded, params, scratch,
                             state_backward_kernel, tiling, views)


def inverse(A):
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
    T = inverse(A)
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


def corrected_gradient(attn, w, k, G, do):
    """dLoss/dW [L, V] of the corrected values W, fp32: attn^T do + (w o k) G, attn [L, L] the decayed q k^T
    (D o q k^T here), w [L, 1] (or [L, K], a decay per key channel)."""
    dtype = k.dtype
    return dot(attn.astype(dtype), do, (0, 0)) + dot((w * k).astype(dtype), G.astype(dtype))


def _state_backward(q, k, v, beta, cs_col, cs_row, st_col, st_row, G, do):
    """dLoss/dS for the state S entering the chunk, given G = dLoss/dS_next: tau G + (e q)^T do - Wk^T dW, fp32."""
    D, e, w, tau, _, _, _, _, Wk, _ = _tiles(q, k, v, beta, cs_col, cs_row, st_col, st_row, None)
    dW = corrected_gradient(D * dot(q, k, (1, 1)), w, k, G, do)
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
    dW = corrected_gradient(attn, w, k, G, do)
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
# Kernels. Refs: the chunk inputs (q, k, v, beta, the decays' and the starts' views), then the forward's h0 or
# the backward's states, do, dh; outputs; scratch (grid driver).
# --------------------------------------------------------------------------------------

class Family(NamedTuple):
    """One chunked delta rule's kernels (hashable: a nondiff argument): `name` their prefix; `inputs` the kinds
    (`_specs`) of the chunk inputs q, k, v, beta, then the decays' views and last the starts' two;
    views(cs, starts) -> the chunk inputs after beta; the per-chunk math on them: chunk_forward(*inputs, S) ->
    (o, S_next), state_backward(*inputs, G, do) -> G, chunk_backward(*inputs, S, G, do) -> the gradients of
    every input but the starts; per_token(L, K, V) -> the forward's (flops, transcendentals) per token."""
    name: str
    inputs: Tuple[str, ...]
    views: Callable
    chunk_forward: Callable
    state_backward: Callable
    chunk_backward: Callable
    per_token: Callable


def _chunk_bwd_kernel(*refs, chunk_backward, num_inputs: int):
    """Grid (B, H, chunks), every chunk independent (its entering state and leaving gradient given)."""
    inputs, (s_ref, g_ref, do_ref), outputs = refs[:num_inputs], refs[num_inputs:num_inputs + 3], \
        refs[num_inputs + 3:]
    grads = chunk_backward(*(ref[...] for ref in inputs), s_ref[...], g_ref[...], do_ref[...])
    for ref, value in zip(outputs, grads):
        ref[...] = value.astype(ref.dtype)


# --------------------------------------------------------------------------------------
# pallas_call builders. Kernel layout: q, k [B, H, Tp, K]; v, o [B, H, Tp, V]; beta [B, H, Tp, 1]; a decay's
# running sums cs [B, H, Tp] as columns and rows (or [B, H, Tp, K] per key channel, `qk`), starts [B, Tp] as
# columns and rows; states [B, H, chunks * K, V] fp32; h [B, H, K, V] fp32.
# --------------------------------------------------------------------------------------

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


def _rows(family: Family):
    """Whether each chunk input is held as a [1, Tp] row (else [Tp, ...])."""
    return tuple(name.endswith("row") for name in family.inputs)


def _call(kernel, cfg: Config, specs: dict, grid, ins, outs, out_shape, name: str, *, K: int, V: int, cost,
          sequential: bool = True):
    """The pallas_call of `kernel` (operands and outputs named by kind, `_specs`); `sequential`: its last grid
    axis carries a state (scratch on the grid driver)."""
    return pl.pallas_call(kernel, grid=grid, in_specs=[specs[n] for n in ins], out_specs=tuple(specs[n] for n in outs),
                          out_shape=out_shape, scratch_shapes=scratch(cfg, K, V) if sequential else (),
                          compiler_params=params(cfg, len(grid), sequential), interpret=cfg.interpret, name=name,
                          cost_estimate=cost)


def per_token_cost(L: int, K: int, V: int):
    """The scalar-decay forward's (flops, transcendentals) per token: about 2 (log2 L) [L, L] products for T, the
    [L, L] x (K or V) and the [K, V] ones, L decays."""
    return 2 * (L * (2 * L.bit_length() + 2 * K + 3 * V) + 3 * K * V), L + 2


def _cost(family: Family, q, v, n: int, passes: int) -> pl.CostEstimate:
    """About `passes` times the forward's work per chunk."""
    Bsz, H, Tp, K = q.shape
    flops, transcendentals = family.per_token(Tp // n, K, v.shape[-1])
    return pl.CostEstimate(flops=passes * Bsz * H * Tp * flops, transcendentals=Bsz * H * Tp * transcendentals,
                           bytes_accessed=passes * (q.dtype.itemsize * Bsz * H * Tp * (2 * K + 2 * v.shape[-1])
                                                    + 4 * Bsz * H * n * K * v.shape[-1]))


def _forward(inputs, h0, cfg: Config, family: Family):
    """-> o [B, H, Tp, V], the state entering every chunk [B, H, chunks * K, V], the final state [B, H, K, V]."""
    q, v = inputs[0], inputs[2]
    Bsz, H, Tp, K = q.shape
    V, n = v.shape[-1], Tp // cfg.chunk
    specs = _specs(cfg, Tp, K, V, n)
    grid = (Bsz, H) if cfg.driver == "loop" else (Bsz, H, n)
    kernel = forward_kernel(cfg, family.chunk_forward, _rows(family))
    out_shape = (jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((Bsz, H, n * K, V), h0.dtype),
                 jax.ShapeDtypeStruct(h0.shape, h0.dtype))
    return _call(kernel, cfg, specs, grid, family.inputs + ("state",), ("v", "states", "state"), out_shape,
                 f"{family.name}_fwd", K=K, V=V, cost=_cost(family, q, v, n, 1))(*inputs, h0)


def _backward(inputs, states, do, dh, cfg: Config, family: Family):
    """Two kernels: the state gradients in reverse chunk order (the loop or grid driver), then every chunk's
    gradients at once (a parallel grid (B, H, chunks) on every backend).
    -> the gradients of the chunk inputs but the starts (each input's shape), dh0; all fp32."""
    q, v = inputs[0], inputs[2]
    Bsz, H, Tp, K = q.shape
    V, n = v.shape[-1], Tp // cfg.chunk
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    specs = _specs(cfg, Tp, K, V, n, reverse=True)
    grid = (Bsz, H) if cfg.driver == "loop" else (Bsz, H, n)
    kernel = state_backward_kernel(cfg, family.state_backward, _rows(family))
    leaving, dh0 = _call(kernel, cfg, specs, grid, family.inputs + ("v", "state"), ("states", "state"),
                         (f32(Bsz, H, n * K, V), f32(Bsz, H, K, V)), f"{family.name}_bwd_state", K=K, V=V,
                         cost=_cost(family, q, v, n, 1))(*inputs, do, dh)
    parallel = cfg._replace(driver="grid")
    specs = _specs(parallel, Tp, K, V, n)
    outs = family.inputs[:-2]  # the starts have none
    kernel = functools.partial(_chunk_bwd_kernel, chunk_backward=family.chunk_backward, num_inputs=len(inputs))
    return _call(kernel, parallel, specs, (Bsz, H, n), family.inputs + ("states", "states", "v"), outs,
                 tuple(f32(*x.shape) for x in inputs[:len(outs)]), f"{family.name}_bwd_chunk", K=K, V=V,
                 cost=_cost(family, q, v, n, 2), sequential=False)(*inputs, states, leaving, do) + (dh0,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _delta(inputs, h0, cfg: Config, family: Family):
    o, _, h = _forward(inputs, h0, cfg, family)
    return o, h


def _delta_fwd(inputs, h0, cfg, family):
    o, states, h = _forward(inputs, h0, cfg, family)
    return (o, h), (inputs, states)


def _delta_bwd(cfg, family, residuals, cotangents):
    inputs, states = residuals
    do, dh = cotangents
    *grads, dh0 = _backward(inputs, states, do.astype(inputs[2].dtype), dh.astype(jnp.float32), cfg, family)
    return tuple(d.astype(x.dtype) for d, x in zip(grads, inputs)) + (None, None), dh0.astype(states.dtype)


_delta.defvjp(_delta_fwd, _delta_bwd)


def run_kernels(family: Family, q, k, v, g, beta, reset, h0, *, chunk: int, backend: Optional[str],
                interpret: Optional[bool], kernel: str):
    """`family`'s kernels on the arguments as `chunked_gated_delta_rule` takes them, g [B, T, H] or (a decay per
    key channel, padded as k) [B, T, H, K]; kernel: the family's name in errors."""
    backend, interpret, tiles, L = tiling(q.shape[1], chunk, backend, interpret, kernel)
    Bsz, T, H, K = q.shape
    V = v.shape[-1]
    Tp, Kp, Vp = -(-T // L) * L, padded(K, tiles), padded(V, tiles)
    acc = jnp.promote_types(v.dtype, jnp.float32)
    q, k = (pad(a.astype(v.dtype), Tp - T, 0, Kp - K).transpose(0, 2, 1, 3) for a in (q, k))  # [B, H, Tp, Kp]
    v = pad(v, Tp - T, 0, Vp - V).transpose(0, 2, 1, 3)
    beta = pad(beta.astype(acc), Tp - T, 0).transpose(0, 2, 1)[..., None]  # [B, H, Tp, 1]
    cs, starts = chunk_sums(pad(g.astype(acc), 0, 0, *(Kp - K,) * (g.ndim - 3)), reset, L, Tp)
    h0 = jnp.zeros((Bsz, H, K, V), acc) if h0 is None else h0.astype(acc)
    cfg = Config(L, 1, "grid" if backend == "tpu" else "loop", backend, interpret)
    o, h = _delta((q, k, v, beta) + family.views(cs, starts), pad(h0, 0, Kp - K, Vp - V), cfg, family)
    return o.transpose(0, 2, 1, 3)[:, :T, :, :V], h[:, :, :K, :V]


GATED_DELTA = Family("gated_delta", ("qk", "qk", "v", "col", "col", "row", "st_col", "st_row"), views,
                     _chunk_forward, _state_backward, _chunk_backward, per_token_cost)


def chunked_gated_delta_rule(q, k, v, g, beta, reset, h0=None, *, chunk: int, backend: Optional[str] = None,
                             interpret: Optional[bool] = None):
    """The gated delta rule by the Pallas kernels (module docstring), differentiable.

    q, k [B, T, H, K] (q already scaled, both L2-normalised by the caller, in the compute dtype), v [B, T, H, V];
    g [B, T, H] log decays (<= 0; 0 at padding); beta [B, T, H] (0 at padding); reset [B, T] bool, True where a
    sequence starts (the state carried into that token is dropped); h0 [B, H, K, V] or None (zeros).
    chunk, backend, interpret as `tfm.kernels.ssd.chunked_ssd` takes them.
    Returns o [B, T, H, V] in v.dtype and the final state [B, H, K, V] (float32; float64 for float64 v).
    """
    return run_kernels(GATED_DELTA, q, k, v, g, beta, reset, h0, chunk=chunk, backend=backend, interpret=interpret,
                       kernel="gated delta rule")
