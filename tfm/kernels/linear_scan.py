"""Pallas kernel for the diagonal linear recurrence h_t = a_t * h_{t-1} + b_t (Griffin's RG-LRU), forward and
backward; tested against `tfm.ops.linear_scan`'s other forms.

The recurrence is elementwise over channels: a sequential loop over time (tfm.kernels.row_loop's drivers), each
step one row of channels (a [1, lanes] load, a multiply-add, a store), the state carried in fp32.
Backward (`jax.custom_vjp`): the cotangent g_t of h_t is the same recurrence run from the last token,
g_t = a_{t+1} g_{t+1} + dh_t (the final state's cotangent entering after the last token), by the same kernel
reading its rows in reverse; then db = g, da_t = g_t h_{t-1} and dh_{-1} = a_0 g_0, elementwise in XLA.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tfm.kernels.row_loop import Config, row_loop, settings


def _step(rows, carry):
    (a, b), (h,) = rows, carry
    h = a * h + b
    return (h,), (h,)


def _scan(a, b, h0, cfg: Config, reverse: bool):
    """a, b [B, Tp, Wp] fp32, h0 [B, 1, Wp] -> (h [B, Tp, Wp], final [B, 1, Wp]), fp32; `reverse` runs from
    the last row (h then holds each row's state from the end)."""
    Bsz, Tp, Wp = a.shape
    (h,), (final,) = row_loop(
        _step, (a, b), (h0,), 1, cfg, reverse=reverse, name="linear_scan_bwd" if reverse else "linear_scan_fwd",
        cost=pl.CostEstimate(flops=2 * Bsz * Tp * Wp, transcendentals=0, bytes_accessed=12 * Bsz * Tp * Wp))
    return h, final


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


def linear_scan(a, b, h0=None, *, chunk: int, backend: Optional[str] = None, interpret: Optional[bool] = None):
    """h_t = a_t * h_{t-1} + b_t by the Pallas kernel (module docstring), differentiable.

    a, b [B, T, ...] (any trailing channel dims, flattened); h0 [B, ...] or None (zeros), the state before t = 0.
    chunk: rows per block on TPU (a multiple of 8; shrunk for a shorter T); the loop driver takes whole rows.
    backend "tpu" (grid driver), "gpu" (loop driver, Triton) or "cpu"; default JAX's. interpret: the Pallas
    interpreter; default on cpu. Returns (h [B, T, ...], final state [B, ...]), float32."""
    Bsz, T = b.shape[:2]
    channels = b.shape[2:]
    W = math.prod(channels)
    cfg, Tp, Wp = settings(T, W, chunk, backend, interpret, "linear-scan")
    flat = lambda x, fill: jnp.pad(x.astype(jnp.float32).reshape(Bsz, T, W), ((0, 0), (0, Tp - T), (0, Wp - W)),
                                   constant_values=fill)
    a, b = flat(a, 1.0), flat(b, 0.0)  # padded steps leave the state as it is
    h0 = jnp.zeros((Bsz, 1, Wp), jnp.float32) if h0 is None else jnp.pad(
        h0.astype(jnp.float32).reshape(Bsz, 1, W), ((0, 0), (0, 0), (0, Wp - W)))
    h, final = _linear_scan(a, b, h0, cfg)
    return h[:, :T, :W].reshape(b.shape[:1] + (T,) + channels), final[:, 0, :W].reshape((Bsz,) + channels)
