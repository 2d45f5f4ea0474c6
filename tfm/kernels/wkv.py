"""Pallas kernel for RWKV-4's WKV time mixing (tfm.ops.wkv), forward and backward; tested against its chunked
form. Per channel, in transformers' stable form: the state (num, den, max) stands for the sums S = num e^max and
D = den e^max of the earlier tokens' e^{k_i} v_i and e^{k_i}, decayed by e^{-w} a token, and

  out_t = (S + e^{u + k_t} v_t) / (D + e^{u + k_t})      S <- e^{-w} S + e^{k_t} v_t,  D <- e^{-w} D + e^{k_t}

each exponent lowered by the running max before it is taken. Elementwise over channels, so a sequential loop over
time (tfm.kernels.row_loop's drivers); the forward also writes the state before every token when the backward
will read it.

Backward (`jax.custom_vjp`), the same loop from the last token with the cotangents of S and D (lambda_S, lambda_D)
as its state, kept as (alpha_S, alpha_D, rho) = lambda e^{-rho}: with Z_t = D + e^{u + k_t} and g_t the output's
cotangent, lambda_S <- g_t / Z_t + e^{-w} lambda_S and lambda_D <- -g_t out_t / Z_t + e^{-w} lambda_D, and
rho <- max(-top_t, rho - w) (top_t: the exponent that scaled Z_t), so that e^{k_t + rho} and e^{rho + max - w} never
exceed 1 (the forward's max bounds every earlier k). Per token
  dv_t = e^{u + k_t} g_t / Z_t + e^{k_t} lambda_S
  dk_t = e^{u + k_t} g_t (v_t - out_t) / Z_t + e^{k_t} (v_t lambda_S + lambda_D)
  du  += e^{u + k_t} g_t (v_t - out_t) / Z_t            dw  -= e^{-w} (lambda_S S + lambda_D D)
A sequence start drops the costates (its state was dropped). The final max is max(max - w, k_t) along the way, a
path of its own: its cotangent (dmax - dnum num - dden den: num and den are S and D scaled by e^-max) goes back
along that max to the token that set it (dk) through the decays it met (dw), halved at a tie as `jnp.maximum`'s.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tfm.kernels.row_loop import Config, row_loop, settings

EMPTY_MAX = -1e38  # the max exponent of the empty state, as in transformers (tfm.ops.wkv)


def _flags(f):
    """A token's flag row [1, 1] (0 padding, 1 a token, 2 a token starting a sequence) -> (real, start)."""
    return f > 0.5, f > 1.5


def _output(k, v, n, d, m, u):
    """out_t from the state before it, with the exponent top that scaled its denominator Z e^-top and e^{u+k-top}."""
    top = jnp.maximum(m, u + k)
    old, new = jnp.exp(m - top), jnp.exp(u + k - top)
    z = old * d + new
    return (old * n + new * v) / z, z, top, new


def _forward_step(save: bool):
    """The forward's step over rows (k, v, flag) and carry (num, den, max, w, u); outs the output (and with `save`
    the state before the token: num, den, max)."""
    def step(rows, carry):
        (k, v, f), (n, d, m, w, u) = rows, carry
        real, start = _flags(f)
        n, d, m = jnp.where(start, 0.0, n), jnp.where(start, 0.0, d), jnp.where(start, EMPTY_MAX, m)
        out = _output(k, v, n, d, m, u)[0]
        m2 = jnp.maximum(m - w, k)
        old, new = jnp.exp(m - w - m2), jnp.exp(k - m2)
        keep = lambda updated, before: jnp.where(real, updated, before)
        carry = (keep(old * n + new * v, n), keep(old * d + new, d), keep(m2, m), w, u)
        return (jnp.where(real, out, 0.0),) + ((n, d, m) if save else ()), carry
    return step


def _backward_step(rows, carry):
    (k, v, g, f, n, d, m), (a_s, a_d, rho, gam, dw, du, w, u) = rows, carry
    real, start = _flags(f)
    out, z, top, new = _output(k, v, n, d, m, u)
    direct = g * new / z  # e^{u + k} g / Z
    ek = jnp.exp(k + rho)  # e^k, times the costates' scale
    taken = jnp.where(k > m - w, 1.0, jnp.where(k == m - w, 0.5, 0.0))  # how much of the max k set
    dv = direct + ek * a_s
    dk = direct * (v - out) + ek * (v * a_s + a_d) + gam * taken
    dw2 = dw - jnp.exp(rho + m - w) * (a_s * n + a_d * d) - gam * (1.0 - taken)
    rho2 = jnp.maximum(-top, rho - w)
    s_new, s_old = jnp.exp(-top - rho2), jnp.exp(rho - w - rho2)
    a_s2, a_d2 = g / z * s_new + a_s * s_old, -g * out / z * s_new + a_d * s_old
    dropped = lambda x, empty: jnp.where(start, empty, x)
    carry2 = (dropped(a_s2, 0.0), dropped(a_d2, 0.0), dropped(rho2, EMPTY_MAX), dropped(gam * (1.0 - taken), 0.0),
              dw2, du + direct * (v - out))
    keep = lambda updated, before: jnp.where(real, updated, before)
    carry = tuple(keep(x2, x) for x2, x in zip(carry2, (a_s, a_d, rho, gam, dw, du))) + (w, u)
    return (keep(dk, 0.0), keep(dv, 0.0)), carry


def _cost(k, passes: int) -> pl.CostEstimate:
    size = k.size
    return pl.CostEstimate(flops=20 * passes * size, transcendentals=4 * passes * size,
                           bytes_accessed=4 * size * (5 if passes == 1 else 9))


def _forward(k, v, f, w, u, n0, d0, m0, cfg, save: bool):
    """(out, the final state (num, den, max), the states before each token (num, den, max) with `save`, else ())."""
    (out, *before), final = row_loop(_forward_step(save), (k, v, f), (n0, d0, m0, w, u), 1 + 3 * save, cfg,
                                     reverse=False, name="wkv_fwd", cost=_cost(k, 1))
    return out, final[:3], tuple(before)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _wkv(k, v, f, w, u, n0, d0, m0, cfg: Config):
    return _forward(k, v, f, w, u, n0, d0, m0, cfg, save=False)[:2]


def _wkv_fwd(k, v, f, w, u, n0, d0, m0, cfg):
    out, final, before = _forward(k, v, f, w, u, n0, d0, m0, cfg, save=True)
    return (out, final), (k, v, f, w, u, n0, d0, m0, before, final)


def _wkv_bwd(cfg, residuals, cotangents):
    k, v, f, w, u, n0, d0, m0, before, (n, d, m) = residuals
    g, (gn, gd, gm) = cotangents
    start = (gn, gd, -m, gm - gn * n - gd * d, jnp.zeros_like(w), jnp.zeros_like(u), w, u)
    (dk, dv), (a_s, a_d, rho, gam, dw, du, _, _) = row_loop(
        _backward_step, (k, v, g, f) + before, start, 2, cfg, reverse=True, name="wkv_bwd", cost=_cost(k, 2))
    scale = jnp.exp(rho + m0)  # the costates of S and D before the first token, per unit of num and den
    return dk, dv, jnp.zeros_like(f), dw, du, a_s * scale, a_d * scale, scale * (a_s * n0 + a_d * d0) + gam


_wkv.defvjp(_wkv_fwd, _wkv_bwd)


def wkv(w, u, k, v, real, starts, state, *, chunk: int, backend: Optional[str] = None,
        interpret: Optional[bool] = None):
    """RWKV-4's WKV by the Pallas kernel (module docstring), differentiable.

    w, u [B, C] (each row's decay rate and bonus, tfm.ops.wkv's w and u); k, v [B, T, C]; real, starts [B, T] bool
    (padding leaves the state as it is and outputs 0; a start empties the state before its token, t = 0 too);
    state (num, den, max) [B, C] each. chunk: rows per block on TPU (a multiple of 8; shrunk for a shorter T); the
    loop driver takes whole rows. backend, interpret as tfm.kernels.linear_scan's. Returns (out [B, T, C],
    (num, den, max) [B, C]), float32."""
    Bsz, T, C = k.shape
    cfg, Tp, Cp = settings(T, C, chunk, backend, interpret, "WKV")
    seq = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, Tp - T), (0, Cp - C)))
    row = lambda x: jnp.pad(x.astype(jnp.float32), ((0, 0), (0, Cp - C)))[:, None]
    flags = jnp.pad(real.astype(jnp.float32) + starts.astype(jnp.float32), ((0, 0), (0, Tp - T)))[..., None]
    out, final = _wkv(seq(k), seq(v), flags, row(w), row(u), *(row(s) for s in state), cfg)
    return out[:, :T, :C], tuple(s[:, 0, :C] for s in final)
