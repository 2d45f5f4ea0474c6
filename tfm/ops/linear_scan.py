"""A diagonal linear recurrence h_t = a_t * h_{t-1} + b_t (Griffin's RG-LRU, De et al. 2024), pure JAX.

Three forms of one recurrence: `reference` scans over time (a decode step); `chunked`, the parallel
training form (tfm.capabilities.MIXER's name for it), is `jax.lax.associative_scan` over time in float32
(O(log T) depth; a diagonal recurrence needs no chunks); `pallas` is tfm.kernels.linear_scan's sequential
kernel (one pass over the sequence, the state in registers), on each device's batch rows and heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tfm.kernels import linear_scan as kernel
from tfm.ops import context_scan, shard
from tfm.parallel.mesh import current_platform

IMPLS = ("reference", "chunked", "pallas")


def linear_scan(a, b, *, segment_ids=None, initial_state=None, impl="chunked", chunk_size=256):
    """h_t = a_t * h_{t-1} + b_t elementwise. a, b [B, T, ...] (a in [0, 1], e.g. RG-LRU's decay);
    initial_state [B, ...] (None = zeros) is h_{-1}.
    segment_ids [B, T] int, 0 = padding: h_{t-1} is dropped (taken as 0) where a sequence starts
    (tfm.ops.segments); padding tokens act as a = 1, b = 0, so they leave the state as it is. Computed in
    float32 whatever the input dtype.
    impl: "reference" (lax.scan over time), "chunked" (lax.associative_scan) or "pallas" (the kernel, reading
    chunk_size rows per block on TPU).
    Returns (h [B, T, ...] in b.dtype, final_state [B, ...] float32)."""
    _check(a, b, segment_ids, initial_state, impl)
    h0 = (jnp.zeros((b.shape[0],) + b.shape[2:], jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))

    def run(sequences, params, real, starts, h0):
        a, b = _steps(*sequences, real, starts)
        if impl == "reference":
            def step(h, x):
                h = x[0] * h + x[1]
                return h, h

            final, h = jax.lax.scan(step, h0, (jnp.moveaxis(a, 1, 0), jnp.moveaxis(b, 1, 0)))
            h = jnp.moveaxis(h, 0, 1)
        elif impl == "pallas":
            h, final = _by_kernel(a, b, h0, chunk_size)
        else:
            b = b.at[:, 0].add(a[:, 0] * h0)  # h_0 = a_0 h_{-1} + b_0: the state enters as the first input

            def combine(earlier, later):  # composes two affine maps h -> a h + b, `earlier` applied first
                return earlier[0] * later[0], later[0] * earlier[1] + later[1]

            _, h = jax.lax.associative_scan(combine, (a, b), axis=1)
            final = h[:, -1]
        return h.astype(sequences[1].dtype), final

    def chunk_map(sequences, params, real, starts):  # the state decays by the product of the share's a
        decay = jnp.prod(_steps(*sequences, real, starts)[0], axis=1)
        return decay, run(sequences, params, real, starts, jnp.zeros(h0.shape, jnp.float32))[1]

    return context_scan.scan(run, chunk_map, context_scan.DIAGONAL, (a, b), (), segment_ids, h0)


def _by_kernel(a, b, h0, chunk_size):
    """h_t = a_t * h_{t-1} + b_t from h0 by tfm.kernels.linear_scan (float32 a, b [B, T, ...], h0 [B, ...]; chunk_size
    rows per block on TPU) on each device's batch rows and, for [B, T, N, ...], heads N (split as attention's: an
    opaque kernel in a sharded jit needs an explicit shard_map boundary). Returns (h, final state), float32."""
    backend = current_platform()
    scan = lambda a, b, h0: kernel.linear_scan(a, b, h0, chunk=chunk_size, backend=backend)
    heads = b.ndim > 2
    return shard.per_device_heads(scan, (a, b, h0), heads_dims=(2, 2, 1) if heads else (None,) * 3,
                                  out_heads_dims=(2, 1) if heads else (None, None))


def _steps(a, b, real, starts):
    """a, b [B, T, ...] in float32 with padding (real [B, T] False) an identity step (a = 1, b = 0) and a
    = 0 where a sequence starts (starts [B, T])."""
    shape = real.shape + (1,) * (b.ndim - 2)
    real, starts = real.reshape(shape), starts.reshape(shape)
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return jnp.where(starts, 0.0, jnp.where(real, a, 1.0)), jnp.where(real, b, 0.0)


def _check(a, b, segment_ids, initial_state, impl):
    if impl not in IMPLS:
        raise ValueError(f"linear_scan: impl={impl!r}; expected one of {IMPLS}")
    if b.ndim < 2 or b.shape[1] < 1:
        raise ValueError(f"linear_scan: b has shape {b.shape}; expected [B, T, ...] with T >= 1")
    if a.shape != b.shape:
        raise ValueError(f"linear_scan: a has shape {a.shape}; expected b's {b.shape}")
    if segment_ids is not None and segment_ids.shape != b.shape[:2]:
        raise ValueError(f"linear_scan: segment_ids has shape {segment_ids.shape}; expected [B, T] = {b.shape[:2]}")
    state_shape = (b.shape[0],) + b.shape[2:]
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"linear_scan: initial_state has shape {initial_state.shape}; "
                         f"expected [B, ...] = {state_shape}")
