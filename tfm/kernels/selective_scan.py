"""Pallas kernel for Mamba's selective scan (S6; tfm.ops.ssd.selective_scan), forward and backward, fused: the
decays and inputs [T, E, S] are never built. Per channel e and state entry s,

  h_t[e, s] = exp(dt_t[e] A[e, s]) h_{t-1}[e, s] + dt_t[e] x_t[e] B_t[s]      y_t[e] = sum_s C_t[s] h_t[e, s]

a recurrence elementwise over channels: a sequential loop over time (tfm.kernels.row_loop's drivers) whose carry
is the S rows h[:, s] of a block of channels (fp32), each step reading x_t and dt_t (rows of channels) and B_t[s],
C_t[s] (per-token values), the S entries unrolled. The forward also writes each state before its token when the
backward will read it.

Backward (`jax.custom_vjp`), the same loop from the last token, carrying the cotangents g_s of h[:, s] (G = dLoss/dh
after the last token to start): with the cotangent dy_t of y_t and the state h_{t-1} the forward wrote,
  g_s <- g_s + C_t[s] dy_t      dC_t[s] = sum_e h_t dy_t      dB_t[s] = sum_e g_s u_t   (u_t = dt_t x_t)
  du_t = sum_s g_s B_t[s]       dx_t = du_t dt_t              ddt_t = du_t x_t + sum_s g_s h_{t-1} a_s A[:, s]
  dA[:, s] += g_s h_{t-1} a_s dt_t                            g_s <- a_s g_s      (a_s = exp(dt_t A[:, s]))
the sums over channels taken in XLA from per-channel rows. A sequence start drops the state before its token (and
so the costate past it); padding is dt = 0 (the caller's), which leaves the state as it is.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tfm.kernels.row_loop import Config, row_loop, settings

# GPU: 4 warps a program, so that each thread holds one channel of each of the backward's 3 S carried rows (the
# state's cotangent, dA, A) and 3 S rows read: with 1 warp (4 channels a thread) it spilled at S = 16 on an H100.
WARPS = 4


def _forward_step(S: int, save: bool):
    """The forward's step over rows (x, dt, reset, B_0.., C_0..) and carry (h_0.., A_0..); outs y (and with
    `save` each state before the token)."""
    def step(rows, carry):
        (x, dt, reset), B, C = rows[:3], rows[3:3 + S], rows[3 + S:]
        h, A = carry[:S], carry[S:]
        u, keep = dt * x, reset < 0.5
        y, before, after = 0.0, [], []
        for s in range(S):
            h_s = jnp.where(keep, h[s], 0.0)
            before.append(h_s)
            h_s = jnp.exp(dt * A[s]) * h_s + u * B[s]
            y = y + C[s] * h_s
            after.append(h_s)
        return (y,) + (tuple(before) if save else ()), tuple(after) + tuple(A)
    return step


def _backward_step(S: int):
    """The backward's step over rows (x, dt, reset, dy, B_0.., C_0.., h_before_0..) and carry (g_0.., dA_0..,
    A_0..); outs dx, ddt, then per-channel terms of dB_0.. and dC_0.."""
    def step(rows, carry):
        (x, dt, reset, dy), B, C, before = rows[:4], rows[4:4 + S], rows[4 + S:4 + 2 * S], rows[4 + 2 * S:]
        g, dA, A = carry[:S], carry[S:2 * S], carry[2 * S:]
        u, keep = dt * x, reset < 0.5
        du, ddt, dB, dC, g_next, dA_next = 0.0, 0.0, [], [], [], []
        for s in range(S):
            a = jnp.exp(dt * A[s])
            h = a * before[s] + u * B[s]
            g_s = g[s] + C[s] * dy
            dC.append(h * dy)
            dB.append(g_s * u)
            du = du + g_s * B[s]
            decayed = g_s * before[s] * a  # dLoss / d(dt A[:, s])
            ddt = ddt + decayed * A[s]
            dA_next.append(dA[s] + decayed * dt)
            g_next.append(jnp.where(keep, a * g_s, 0.0))
        return (du * dt, ddt + du * x) + tuple(dB) + tuple(dC), tuple(g_next) + tuple(dA_next) + tuple(A)
    return step


def _cost(x, S: int, passes: int) -> pl.CostEstimate:
    return pl.CostEstimate(flops=6 * passes * S * x.size, transcendentals=passes * S * x.size,
                           bytes_accessed=4 * x.size * (3 + (S if passes == 1 else 4 * S)))


def _token_rows(a):
    return tuple(a[..., s:s + 1] for s in range(a.shape[-1]))


def _channel_rows(a):
    return tuple(a[:, None, :, s] for s in range(a.shape[-1]))


def _forward(x, dt, reset, B, C, A, h0, cfg: Config, save: bool):
    """(y, the final state [B, Ep, S], the states before each token: S rows [B, Tp, Ep] with `save`, else ())."""
    S = B.shape[-1]
    (y, *before), final = row_loop(_forward_step(S, save), (x, dt, reset) + _token_rows(B) + _token_rows(C),
                                   _channel_rows(h0) + _channel_rows(A), 1 + S * save, cfg, reverse=False,
                                   name="selective_scan_fwd", cost=_cost(x, S, 1))
    return y, jnp.stack([h[:, 0] for h in final[:S]], -1), tuple(before)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _scan(x, dt, reset, B, C, A, h0, cfg: Config):
    return _forward(x, dt, reset, B, C, A, h0, cfg, save=False)[:2]


def _scan_fwd(x, dt, reset, B, C, A, h0, cfg):
    y, h, before = _forward(x, dt, reset, B, C, A, h0, cfg, save=True)
    return (y, h), (x, dt, reset, B, C, A, before)


def _scan_bwd(cfg, residuals, cotangents):
    x, dt, reset, B, C, A, before = residuals
    dy, dh = cotangents
    S = B.shape[-1]
    zeros = tuple(jnp.zeros_like(a) for a in _channel_rows(A))
    (dx, ddt, *terms), carry = row_loop(
        _backward_step(S), (x, dt, reset, dy) + _token_rows(B) + _token_rows(C) + before,
        _channel_rows(dh) + zeros + _channel_rows(A), 2 + 2 * S, cfg, reverse=True, name="selective_scan_bwd",
        cost=_cost(x, S, 2))
    over_channels = lambda rows: jnp.stack([r.sum(-1) for r in rows], -1)  # [B, T, S]
    stacked = lambda rows: jnp.stack([r[:, 0] for r in rows], -1)  # [B, E, S]
    return (dx, ddt, jnp.zeros_like(reset), over_channels(terms[:S]), over_channels(terms[S:]),
            stacked(carry[S:2 * S]), stacked(carry[:S]))


_scan.defvjp(_scan_fwd, _scan_bwd)


def selective_scan(x, dt, A, B, C, reset, h0, *, chunk: int, backend: Optional[str] = None,
                   interpret: Optional[bool] = None):
    """Mamba's selective scan by the fused Pallas kernel (module docstring), differentiable.

    x, dt [B, T, E] (dt 0 at padding); A [B, E, S] (each row's copy of the layer's A); B, C [B, T, S]; reset [B, T]
    bool, True where a sequence starts (the state before that token is dropped, t = 0 too); h0 [B, E, S]. chunk:
    rows per block on TPU (a multiple of 8; shrunk for a shorter T); the loop driver takes whole rows. backend,
    interpret as tfm.kernels.linear_scan's. Returns (y [B, T, E], final state [B, E, S]), float32."""
    Bsz, T, E = x.shape
    cfg, Tp, Ep = settings(T, E, chunk, backend, interpret, "selective-scan", warps=WARPS)
    f32 = lambda a: a.astype(jnp.float32)
    tokens = lambda a, width=0: jnp.pad(f32(a), ((0, 0), (0, Tp - T), (0, width)))  # padded tokens: dt 0, no reset
    channels = lambda a: jnp.pad(f32(a), ((0, 0), (0, Ep - E), (0, 0)))  # padded channels: x, dt, A, h0 all 0
    y, h = _scan(tokens(x, Ep - E), tokens(dt, Ep - E), tokens(reset[..., None]), tokens(B), tokens(C), channels(A),
                 channels(h0), cfg)
    return y[:, :T, :E], h[:, :E]
