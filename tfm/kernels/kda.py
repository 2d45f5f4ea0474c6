"""Pallas kernels for Kimi Delta Attention (KDA, Kimi Linear 2025): the gated delta rule with a decay per key
channel, forward and backward (tested against `tfm.ops.delta_rule`'s chunked form).

Letters as in tfm.kernels.delta_rule, whose drivers (grid: TPU; loop: GPU Triton, CPU interpret), pallas_call
builders, custom VJP and padding these kernels share (a `Family`). Per batch row, head and chunk of L tokens:
q, k [L, K], v [L, V], beta [L, 1], cs [L, K] the running sums of the log decays g (<= 0) of each key channel
within the chunk, S [K, V] the state entering it. D_ij = exp(cs_i - cs_j) [K] for j <= i in one sequence (a
decay per channel, 0 across a sequence start); e, w, tau [K] as the scalar kernel's, per channel
(`tfm.kernels.ssd.state_decays`): e_i = exp(cs_i) before the chunk's first start, w_j = exp(cs_last - cs_j) in
its last sequence, tau = exp(cs_last) without a start. Then

  kk_ij = sum_c k_i[c] D_ij[c] k_j[c]  (j < i)      attn_ij = sum_c q_i[c] D_ij[c] k_j[c]  (j <= i)
  A = beta o kk   T = (I + A)^-1   U = T (beta v)   Wk = T (beta e o k)   W = U - Wk S
  o = (e o q) S + attn W                            S_next = diag(tau) S + (w o k)^T W

The decays inside attn and kk: the dyadic split. D is not exp(cs_i) exp(-cs_j) over the chunk (exp(-cs_j)
overflows: KDA's log decays can be very negative). A pair j < i is split at the highest bit in which i and j
differ, its level l: both lie in one block of 2^(l+1) tokens, i in its upper half, j in its lower; with b the
last token of that lower half, D_ij = exp(cs_i - cs_b) exp(cs_b - cs_j), both factors <= 1. So each row r has
one factor per level, f_l[r] = exp(cs_r - cs_b) in an upper half and exp(cs_b - cs_r) in a lower one (cs is
non-increasing: the exponent is <= 0 either way), and each level is one product on the matrix units, kept on
its pairs:

  sum_c x_i[c] D_ij[c] y_j[c] = sum_l [(x o f_l) (y o f_l)^T]_ij  over the level-l pairs (i, j)

log2 L products per [L, L] tile, cs_b [L, K] gathered by a 0/1 [L, L] product (exact in fp32). Nothing positive
is exponentiated, entries off a level's pairs are finite (factors <= 1) and dropped, no [L, L, K] pairwise
decays are formed; attn's diagonal is q_i.k_i. This is flash-linear-attention's sub-chunk factorisation (a
boundary between the sub-chunks of i and j) applied down to single tokens, so that no diagonal sub-chunk needs
its decays pairwise. kk, A, T, U, Wk, W and the state stay fp32; attn's, the output's, the state update's and the
backward's level products take the input dtype (fp32 accumulation).

Backward, as tfm.kernels.delta_rule's: kda_bwd_state G <- diag(tau) G + (e o q)^T do - Wk^T dW, and kda_bwd_chunk
(dattn = do W^T; dRv, dRk, dA as there; dkk = beta o dA). Through a level's product P = X Y^T on its pairs, with
X = x o f_l (upper rows), Y = y o f_l (lower rows): dX = dP Y, dY = dP^T X, dx = dX o f_l, dy = dY o f_l, and with
m = dX o X - dY o Y (the exponents' gradients, signed as cs enters them) dcs = m - E^T m, E the 0/1 gather of
cs_b. e, w and tau add de o e, -dw o w and, at the last token, sum_j dw_j o w_j + tau o sum_V G o S.

Compiled, compile-only: by Mosaic for a v5p at K = V = 128, chunk 128 (tests/test_kernel_compile.py); by Triton
for an H100 (ptxas -v) the three kernels fit the registers at K = V = 16, chunk 16 (the test; `_over_levels`), at
32 the forward and state kernels spill a few bytes, at 64 and 128 all three spill, and at 128 with chunk 64 the
forward exceeds shared memory.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jax import lax

from tfm.kernels.delta_rule import Family, corrected_gradient, inverse, per_token_cost, run_kernels
from tfm.kernels.ssd import div, dot, state_decays


def _f32(x):
    return x.astype(jnp.float32)


def _grid(n: int):
    """The row and the column indices of an [n, n] tile."""
    return tuple(lax.broadcasted_iota(jnp.int32, (n, n), axis) for axis in (0, 1))


def _transposed(x):
    """A row [1, K] as a column [K, 1], or a column as a row (a masked sum: it lowers everywhere)."""
    i, j = _grid(max(x.shape))
    return jnp.sum(jnp.where(i == j, x, 0.0), axis=1 if x.shape[0] == 1 else 0, keepdims=True)


def _upper_half(index, half):
    """Whether each int32 index lies in the upper half of its block of 2 half tokens."""
    return div(index, half) - 2 * div(index, 2 * half) == 1


def _level(cs, half):
    """The level of the dyadic split (module docstring) at blocks of 2 half tokens (half an int32 power of two) of a
    chunk's cs [L, K]: pairs [L, L] bool (i in the upper half and j in the lower half of one block), gather [L, L]
    fp32 (1 at (i, b_i), b_i the last token of the lower half of i's block) and the factors [L, K] fp32,
    exp(cs_i - cs_b) on upper rows and exp(cs_b - cs_j) on lower ones (both <= 1)."""
    L = cs.shape[0]
    i, j = _grid(L)
    pairs = (div(i, 2 * half) == div(j, 2 * half)) & _upper_half(i, half) & ~_upper_half(j, half)
    gather = jnp.where(j == div(i, 2 * half) * (2 * half) + half - 1, 1.0, 0.0)
    at_b = dot(gather, cs)
    upper = _upper_half(lax.broadcasted_iota(jnp.int32, (L, 1), 0), half)
    return pairs, gather, jnp.exp(jnp.where(upper, cs - at_b, at_b - cs))


def _over_levels(L: int, body, init, unrolled: bool):
    """`body(half, carry) -> carry` over the dyadic split's levels, half = 1, 2, ..., L / 2: unrolled (a Python
    loop) or a fori_loop (one level's tiles live at a time). Unrolled in the forward and state kernels, loops in
    the chunk backward: so each fits an H100's registers at K = V = 16, chunk 16 (compile-only; the other ways
    round, one kernel or another spilled)."""
    if unrolled:
        for level in range(L.bit_length() - 1):
            init = body(1 << level, init)
        return init
    return lax.fori_loop(0, L.bit_length() - 1, lambda level, carry: body(jnp.left_shift(1, level), carry), init)


def _decayed_products(q, k, cs, st_col, st_row, unrolled: bool):
    """attn [L, L] = sum_c q_i[c] D_ij[c] k_j[c] for j <= i and kk [L, L] the same of k_i and k_j for j < i, in
    one sequence (0 elsewhere), by the dyadic split (its levels `unrolled` or not, `_over_levels`); fp32."""
    dtype, L = q.dtype, q.shape[0]
    qf, kf = _f32(q), _f32(k)
    i, j = _grid(L)

    def level(half, tiles):
        attn, kk = tiles
        pairs, _, factor = _level(cs, half)
        k_factor = kf * factor
        return (attn + jnp.where(pairs, dot((qf * factor).astype(dtype), k_factor.astype(dtype), (1, 1)), 0.0),
                kk + jnp.where(pairs, dot(k_factor, k_factor, (1, 1)), 0.0))

    attn, kk = _over_levels(L, level, (jnp.where(i == j, jnp.sum(qf * kf, axis=1, keepdims=True), 0.0),
                                       jnp.zeros((L, L), jnp.float32)), unrolled)
    same = st_col == st_row
    return jnp.where(same, attn, 0.0), jnp.where(same, kk, 0.0)


def _decayed_products_backward(q, k, cs, st_col, st_row, dattn, dkk, grads):
    """grads (dq, dk, dcs [L, K], fp32) plus the gradients of `_decayed_products` given dattn and dkk [L, L] (fp32)."""
    dtype, L = q.dtype, q.shape[0]
    qf, kf = _f32(q), _f32(k)
    i, j = _grid(L)
    same = st_col == st_row
    dattn, dkk = jnp.where(same, dattn, 0.0), jnp.where(same, dkk, 0.0)

    def level(half, grads):  # the pairs' rows: dq_up, dk_up on upper rows, dk_down on lower ones
        dq, dk, dcs = grads
        pairs, gather, factor = _level(cs, half)
        q_factor, k_factor = qf * factor, kf * factor
        dattn_l, dkk_l = jnp.where(pairs, dattn, 0.0).astype(dtype), jnp.where(pairs, dkk, 0.0).astype(dtype)
        dq_up = dot(dattn_l, k_factor.astype(dtype))
        dk_up = dot(dkk_l, k_factor.astype(dtype))
        dk_down = dot(dattn_l, q_factor.astype(dtype), (0, 0)) + dot(dkk_l, k_factor.astype(dtype), (0, 0))
        m = dq_up * q_factor + (dk_up - dk_down) * k_factor  # d(cs_i - cs_b) up, -d(cs_b - cs_j) down
        return dq + dq_up * factor, dk + (dk_up + dk_down) * factor, dcs + m - dot(gather, m, (0, 0))

    on_diagonal = jnp.sum(jnp.where(i == j, dattn, 0.0), axis=1, keepdims=True)
    dq, dk, dcs = grads
    return _over_levels(L, level, (dq + on_diagonal * kf, dk + on_diagonal * qf, dcs), unrolled=False)


def _tiles(q, k, v, beta, cs, st_col, st_row, S, unrolled: bool = True):
    """The chunk's forward tiles (module docstring): attn, kk, e, w, tau [1, K], T, U, Wk, W (None without S),
    fp32; the dyadic split's levels `unrolled` or not (`_over_levels`)."""
    e, w, tau = state_decays(cs, st_col)
    attn, kk = _decayed_products(q, k, cs, st_col, st_row, unrolled)
    T = inverse(beta * kk)
    U = dot(T, beta * _f32(v))
    Wk = dot(T, beta * e * _f32(k))
    return attn, kk, e, w, tau, T, U, Wk, None if S is None else U - dot(Wk, S)


def _chunk_forward(q, k, v, beta, cs, st_col, st_row, S):
    """-> o [L, V] fp32, S_next [K, V] fp32."""
    dtype = q.dtype
    attn, _, e, w, tau, _, _, _, W = _tiles(q, k, v, beta, cs, st_col, st_row, S)
    W_in = W.astype(dtype)
    o = dot((e * q).astype(dtype), S.astype(dtype)) + dot(attn.astype(dtype), W_in)
    return o, _transposed(tau) * S + dot((w * k).astype(dtype), W_in, (0, 0))


def _state_backward(q, k, v, beta, cs, st_col, st_row, G, do):
    """dLoss/dS for the state S entering the chunk, given G = dLoss/dS_next: diag(tau) G + (e o q)^T do - Wk^T dW,
    fp32."""
    attn, _, e, w, tau, _, _, Wk, _ = _tiles(q, k, v, beta, cs, st_col, st_row, None)
    dW = corrected_gradient(attn, w, k, G, do)
    return _transposed(tau) * G + dot((e * q).astype(q.dtype), do, (0, 0)) - dot(Wk, dW, (0, 0))


def _chunk_backward(q, k, v, beta, cs, st_col, st_row, S, G, do):
    """The chunk's gradients given S (entering) and G = dLoss/dS_next: dq, dk [L, K], dv [L, V], dbeta [L, 1] and
    dcs [L, K], fp32. The terms outside the [L, L] tiles come first: few tiles live on into the levels' loop."""
    dtype, L = q.dtype, q.shape[0]
    attn, kk, e, w, tau, T, U, Wk, W = _tiles(q, k, v, beta, cs, st_col, st_row, S, unrolled=False)
    kf = _f32(k)
    dW = corrected_gradient(attn, w, k, G, do)
    dattn = dot(do, W.astype(dtype), (1, 1))
    dRv, dRk = dot(T, dW, (0, 0)), dot(T, -dot(dW, S, (1, 1)), (0, 0))  # T^T [dU | dWk]
    i, j = _grid(L)
    dA = jnp.where(i > j, -(dot(dRv, U, (1, 1)) + dot(dRk, Wk, (1, 1))), 0.0)
    dbeta = (jnp.sum(_f32(v) * dRv, axis=1, keepdims=True) + jnp.sum(e * kf * dRk, axis=1, keepdims=True)
             + jnp.sum(dA * kk, axis=1, keepdims=True))
    from_state = dot(do, S.astype(dtype), (1, 1))  # [L, K]: do S^T
    WG = dot(W.astype(dtype), G.astype(dtype), (1, 1))  # [L, K]: W G^T
    to_state = kf * WG * w  # dw o w
    through = _transposed(jnp.sum(G * S, axis=1, keepdims=True)) * tau  # [1, K]: dtau o tau
    last = lax.broadcasted_iota(jnp.int32, (L, 1), 0) == L - 1
    dcs = ((_f32(q) * from_state + beta * kf * dRk) * e - to_state  # de o e - dw o w
           + jnp.where(last, jnp.sum(to_state, axis=0, keepdims=True) + through, 0.0))
    dq, dk, dcs = _decayed_products_backward(q, k, cs, st_col, st_row, dattn, beta * dA,
                                             (e * from_state, w * WG + beta * e * dRk, dcs))
    return dq, dk, beta * dRv, dbeta, dcs


def _views(cs, starts):
    """cs [B, H, Tp, K], starts [B, Tp] -> cs and the starts' column and row views (free reshapes)."""
    return cs, starts[..., None], starts[:, None, :]


def _per_token_cost(L: int, K: int, V: int):
    """The forward's (flops, transcendentals) per token: the scalar kernel's products, and per level of the dyadic
    split a gather, two [L, K] x [K, L] products and the [L, K] factors; e and w."""
    flops, _ = per_token_cost(L, K, V)
    levels = L.bit_length() - 1
    return flops + 6 * levels * L * K, (levels + 2) * K


KDA = Family("kda", ("qk", "qk", "v", "col", "qk", "st_col", "st_row"), _views, _chunk_forward, _state_backward,
             _chunk_backward, _per_token_cost)


def chunked_kda(q, k, v, g, beta, reset, h0=None, *, chunk: int, backend: Optional[str] = None,
                interpret: Optional[bool] = None):
    """KDA by the Pallas kernels (module docstring), differentiable; the arguments and results as
    `tfm.kernels.delta_rule.chunked_gated_delta_rule`'s, but g [B, T, H, K]: log decays per key channel (<= 0;
    0 at padding)."""
    return run_kernels(KDA, q, k, v, g, beta, reset, h0, chunk=chunk, backend=backend, interpret=interpret,
                       kernel="KDA")
