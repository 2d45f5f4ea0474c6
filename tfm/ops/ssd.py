"""State-space scans: Mamba-2's SSD (one scalar decay per head) and Mamba-1's selective scan (S6).

Each scan has two implementations of one function: "reference", the recurrence as a `lax.scan`
over time (what a decode step runs), and "chunked", the parallel form for training.

Shape letters of this file: B batch, T length, N heads, P head dim, G groups of the B/C
projections (R = N // G heads read one group), S state size, E channels (Mamba-1); inside the
chunked forms c chunks of L tokens.

States and decays are float32 whatever the input dtype (float64 for float64 inputs); outputs come
back in x's dtype. Every `exp` sees a non-positive argument (dt >= 0 and A < 0, and sums of such
log decays), and masked entries are chosen with `where`, so no value or gradient meets inf or inf * 0.

Segments: `segment_ids` [B, T] int, 0 = padding. A non-padding token whose id differs from the
previous token's starts a new sequence: the state carried into it is dropped (never at t = 0, which
continues from `initial_state`, so a prompt continued from a cache equals the whole prompt). A
padding token is a step with dt = 0: no decay, no input. So a packed row computes each of its
sequences as if run alone, and padding on either side leaves every state as it was (the outputs at
padding positions mean nothing).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from tfm.kernels import selective_scan as selective_kernel
from tfm.kernels import ssd as ssd_kernels
from tfm.ops import context_scan, shard
from tfm.parallel.mesh import current_platform

__all__ = ["selective_scan", "ssd"]

_IMPLS = ("reference", "chunked", "pallas")


@functools.partial(jax.named_call, name="ssd")
def ssd(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, *,
        segment_ids: Optional[jax.Array] = None, initial_state: Optional[jax.Array] = None,
        impl: str = "chunked", chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """Mamba-2's scan: per head h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t (h [P, S]).

    x [B, T, N, P]; dt [B, T, N] positive (softplus'd and clamped by the caller); A [N] negative;
    B, C [B, T, G, S], head n reading group n // (N // G); segment_ids [B, T] int (0 = padding);
    initial_state [B, N, P, S] (None: zeros). impl "reference" (recurrent) or "chunked" (chunk_size
    tokens per chunk; "pallas": the chunked form's kernels, tfm.kernels.ssd, on each device's batch rows and heads,
    chunk_size a tile they take). Returns y [B, T, N, P] in x.dtype and the final state [B, N, P, S] float32.
    """
    _check_impl(impl, chunk_size)
    if x.ndim != 4:
        raise ValueError(f"x: shape {x.shape}, expected [B, T, N, P]")
    b, t, n, p = x.shape
    _check_shape("dt", dt, (b, t, n), "[B, T, N] from x")
    _check_shape("A", A, (n,), "[N] from x")
    if B.ndim != 4 or B.shape[:2] != (b, t) or n % B.shape[2]:
        raise ValueError(f"B: shape {B.shape}, expected [B, T, G, S] with [B, T] = {(b, t)} from x, G dividing N={n}")
    _check_shape("C", C, B.shape, "[B, T, G, S] like B")
    s = B.shape[3]
    _check_shape("segment_ids", segment_ids, (b, t), "[B, T] from x")
    _check_shape("initial_state", initial_state, (b, n, p, s), "[B, N, P, S] from x and B")
    acc = jnp.result_type(x.dtype, jnp.float32)
    h0 = jnp.zeros((b, n, p, s), acc) if initial_state is None else initial_state.astype(acc)
    run = (functools.partial(_ssd_pallas, chunk_size) if impl == "pallas"
           else functools.partial(_ssd_run, impl, chunk_size))

    def chunk_map(sequences, params, real, starts):  # the state decays by exp(A sum dt) per head
        dt, A = _steps(sequences[1].astype(acc), real), params[0].astype(acc)
        decay = jnp.where(starts.any(1)[:, None], 0, jnp.exp(dt.sum(1) * A))  # [B, N]
        return decay[..., None, None], run(sequences, params, real, starts, jnp.zeros(h0.shape, acc))[1]

    return context_scan.scan(run, chunk_map, context_scan.DIAGONAL, (x, dt, B, C), (A,), segment_ids, h0)


def _ssd_run(impl, chunk_size, sequences, params, real, starts, h0):
    """ssd on x, dt, B, C (sequences) and A (params) from h0 [B, N, P, S], real / starts [B, T] as
    tfm.ops.segments reads the segment ids (starts may include t = 0)."""
    x, dt, B, C = sequences
    b, t, n, p = x.shape
    g, s = B.shape[2:]
    acc = h0.dtype
    dt = _steps(dt.astype(acc), real)
    args = (x.astype(acc).reshape(b, t, g, n // g, p), dt.reshape(b, t, g, n // g),
            params[0].astype(acc).reshape(g, n // g), B.astype(acc), C.astype(acc), starts, h0.reshape(b, g, n // g, p, s))
    if impl == "reference":
        y, h = _ssd_reference(*args)
    else:
        y, h = _ssd_chunked(*args, chunk=min(chunk_size, t))
    return y.reshape(b, t, n, p).astype(x.dtype), h.reshape(b, n, p, s)


@functools.partial(jax.named_call, name="selective_scan")
def selective_scan(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, *,
                   segment_ids: Optional[jax.Array] = None, initial_state: Optional[jax.Array] = None,
                   impl: str = "chunked", chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """Mamba-1's scan: per channel e, h_t[e] = exp(dt_t[e] A[e]) h_{t-1}[e] + dt_t[e] x_t[e] B_t, y_t[e] = h_t[e] . C_t.

    x, dt [B, T, E] (dt positive); A [E, S] negative; B, C [B, T, S]; segment_ids [B, T] int
    (0 = padding); initial_state [B, E, S] (None: zeros). impl "reference" (recurrent), "chunked" (a scan over
    chunks of chunk_size tokens, each an associative scan, holding O(L E S) at a time) or "pallas" (the same
    chunks, each by tfm.kernels.selective_scan's fused kernel: one pass, the decays and inputs never built;
    chunk_size rows per block on TPU; the chunks' O(L E S) states kept for the backward pass).
    Returns y [B, T, E] in x.dtype and the final state [B, E, S] float32.
    """
    _check_impl(impl, chunk_size)
    if x.ndim != 3:
        raise ValueError(f"x: shape {x.shape}, expected [B, T, E]")
    b, t, e = x.shape
    _check_shape("dt", dt, (b, t, e), "[B, T, E] like x")
    if A.ndim != 2 or A.shape[0] != e:
        raise ValueError(f"A: shape {A.shape}, expected [E, S] with E={e} from x")
    s = A.shape[1]
    _check_shape("B", B, (b, t, s), "[B, T, S] from x and A")
    _check_shape("C", C, (b, t, s), "[B, T, S] from x and A")
    _check_shape("segment_ids", segment_ids, (b, t), "[B, T] from x")
    _check_shape("initial_state", initial_state, (b, e, s), "[B, E, S] from x and A")

    acc = jnp.result_type(x.dtype, jnp.float32)
    h0 = jnp.zeros((b, e, s), acc) if initial_state is None else initial_state.astype(acc)
    run = functools.partial(_selective_run, impl, chunk_size)

    def chunk_map(sequences, params, real, starts):  # the state decays by exp(A sum dt) per channel and entry
        dt, A = _steps(sequences[1].astype(acc), real), params[0].astype(acc)
        decay = jnp.where(starts.any(1)[:, None, None], 0, jnp.exp(dt.sum(1)[..., None] * A))  # [B, E, S]
        return decay, run(sequences, params, real, starts, jnp.zeros(h0.shape, acc))[1]

    return context_scan.scan(run, chunk_map, context_scan.DIAGONAL, (x, dt, B, C), (A,), segment_ids, h0)


def _selective_run(impl, chunk_size, sequences, params, real, starts, h0):
    """selective_scan on x, dt, B, C (sequences) and A (params) from h0 [B, E, S], real / starts as in _ssd_run."""
    x, dt, B, C = sequences
    acc = h0.dtype
    args = (x.astype(acc), _steps(dt.astype(acc), real), params[0].astype(acc), B.astype(acc), C.astype(acc), starts,
            h0)
    if impl == "reference":
        y, h = _selective_reference(*args)
    elif impl == "pallas":
        y, h = _selective_chunked(*args, chunk=min(chunk_size, x.shape[1]),
                                  chunk_scan=functools.partial(_selective_pallas, chunk_size))
    else:
        y, h = _selective_chunked(*args, chunk=min(chunk_size, x.shape[1]))
    return y.astype(x.dtype), h


def _check_impl(impl, chunk_size):
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {_IMPLS}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r}: expected a positive int")


def _check_shape(name, array, shape, meaning):
    if array is not None and tuple(array.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(array.shape)}, expected {meaning} = {tuple(shape)}")


def _steps(dt, real):
    """dt [B, T, ...] -> dt, 0 at padding (real [B, T] bool False)."""
    return jnp.where(real.reshape(real.shape + (1,) * (dt.ndim - 2)), dt, 0)


def _pad_time(chunk, *arrays):
    """Pads axis 1 (T) of each array with zeros (dt = 0, no reset: steps that change nothing) to a multiple of chunk."""
    pad = -arrays[0].shape[1] % chunk
    return [jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in arrays]


def _time_major(*arrays):
    return tuple(jnp.moveaxis(a, 1, 0) for a in arrays)


def _ssd_reference(x, dt, A, B, C, reset, h0):
    """x [B, T, G, R, P], dt [B, T, G, R], A [G, R], B/C [B, T, G, S], reset [B, T], h0 [B, G, R, P, S]."""
    def step(h, inputs):
        x_t, dt_t, b_t, c_t, reset_t = inputs
        decay = jnp.where(reset_t[:, None, None], 0, jnp.exp(dt_t * A))  # [B, G, R]
        h = decay[..., None, None] * h + jnp.einsum("bgrp,bgs->bgrps", dt_t[..., None] * x_t, b_t)
        return h, jnp.einsum("bgrps,bgs->bgrp", h, c_t)

    h, y = jax.lax.scan(step, h0, _time_major(x, dt, B, C, reset))
    return jnp.moveaxis(y, 0, 1), h


def _ssd_chunked(x, dt, A, B, C, reset, h0, *, chunk):
    """The chunked SSD on the arguments of `_ssd_reference`: exact within chunks, a scan of states across them."""
    b, t = x.shape[:2]
    x, dt, B, C, reset = _pad_time(chunk, x, dt, B, C, reset)
    c = x.shape[1] // chunk
    split = lambda a: a.reshape((b, c, chunk) + a.shape[2:])
    x, dt, B, C, reset = map(split, (x, dt, B, C, reset))  # [B, c, L, ...]
    xdt = x * dt[..., None]  # [B, c, L, G, R, P]
    log_decay = jnp.moveaxis(dt * A, 2, -1)  # [B, c, G, R, L], <= 0
    starts = jnp.cumsum(reset, axis=2)  # [B, c, L]: sequence starts within the chunk up to each token

    # segsum[..., i, j] = sum of log_decay over (j, i]: a running sum of non-positive terms (0 where i <= j).
    i, j = jnp.arange(chunk)[:, None], jnp.arange(chunk)[None, :]
    segsum = jnp.cumsum(jnp.where(i > j, log_decay[..., :, None], 0), axis=-2)  # [B, c, G, R, L, L]
    same = (i >= j) & (starts[..., :, None] == starts[..., None, :])  # [B, c, L, L]: j reaches i
    decay = jnp.where(same[:, :, None, None], jnp.exp(segsum), 0)

    scores = jnp.einsum("bcigs,bcjgs->bcgij", C, B)
    y_within = jnp.einsum("bcgij,bcgrij,bcjgrp->bcigrp", scores, decay, xdt)

    # Each chunk's contribution to the state at its end, and its decay of the state entering it.
    states = jnp.einsum("bcgrj,bcjgs,bcjgrp->bcgrps", decay[..., -1, :], B, xdt)  # [B, c, G, R, P, S]
    from_start = jnp.where((starts == 0)[:, :, None, None], jnp.exp(jnp.cumsum(log_decay, axis=-1)), 0)  # [B,c,G,R,L]

    def step(h, inputs):
        chunk_decay, chunk_state = inputs
        return chunk_decay[..., None, None] * h + chunk_state, h

    h, entering = jax.lax.scan(step, h0, _time_major(from_start[..., -1], states))  # entering [c, B, G, R, P, S]
    y_across = jnp.einsum("bcigs,cbgrps,bcgri->bcigrp", C, entering, from_start)
    y = (y_within + y_across).reshape((b, c * chunk) + x.shape[3:])
    return y[:, :t], h


def _selective_reference(x, dt, A, B, C, reset, h0):
    """x, dt [B, T, E], A [E, S], B/C [B, T, S], reset [B, T], h0 [B, E, S]."""
    def step(h, inputs):
        x_t, dt_t, b_t, c_t, reset_t = inputs
        decay = jnp.where(reset_t[:, None, None], 0, jnp.exp(dt_t[..., None] * A))  # [B, E, S]
        h = decay * h + (dt_t * x_t)[..., None] * b_t[:, None, :]
        return h, jnp.einsum("bes,bs->be", h, c_t)

    h, y = jax.lax.scan(step, h0, _time_major(x, dt, B, C, reset))
    return jnp.moveaxis(y, 0, 1), h


def _associative(x, dt, B, C, reset, A, h):
    """A chunk of L tokens (x, dt [B, L, E], B, C [B, L, S], reset [B, L]) from the state h [B, E, S] entering it:
    an associative scan of its (decay, input) pairs [B, L, E, S]. Returns (the state leaving it, y [B, L, E])."""
    def combine(earlier, later):
        (decay_1, h_1), (decay_2, h_2) = earlier, later
        return decay_1 * decay_2, decay_2 * h_1 + h_2

    decay = jnp.where(reset[..., None, None], 0, jnp.exp(dt[..., None] * A))  # [B, L, E, S]
    added = (dt * x)[..., None] * B[:, :, None, :]
    decay, added = jax.lax.associative_scan(combine, (decay, added), axis=1)
    states = decay * h[:, None] + added  # [B, L, E, S]
    return states[:, -1], jnp.einsum("bles,bls->ble", states, C)


def _selective_pallas(chunk_size, x, dt, B, C, reset, A, h):
    """`_associative`'s chunk by the fused kernel (tfm.kernels.selective_scan) on each device's batch rows and
    channels (split as attention's heads: an opaque kernel in a sharded jit needs an explicit shard_map boundary)."""
    backend = current_platform()

    def kernel(x, dt, B, C, reset, A, h):
        y, h = selective_kernel.selective_scan(x, dt, A, B, C, reset, h, chunk=chunk_size, backend=backend)
        return h, y

    A = jnp.broadcast_to(A, h.shape)
    return shard.per_device_heads(kernel, (x, dt, B, C, reset, A, h), heads_dims=(2, 2, None, None, None, 1, 1),
                                  out_heads_dims=(1, 2))


def _selective_chunked(x, dt, A, B, C, reset, h0, *, chunk, chunk_scan=_associative):
    """The selective scan on the arguments of `_selective_reference`, one chunk of L tokens at a time, each by
    `chunk_scan(x, dt, B, C, reset, A, h) -> (h, y)` (`_associative`, or the fused kernel) from the state entering
    it, recomputed in the backward pass (`jax.checkpoint`), so only the [B, E, S] state between chunks is kept."""
    b, t = x.shape[:2]
    x, dt, B, C, reset = _pad_time(chunk, x, dt, B, C, reset)
    c = x.shape[1] // chunk
    chunks = _time_major(*(a.reshape((b, c, chunk) + a.shape[2:]) for a in (x, dt, B, C, reset)))  # [c, B, L, ...]

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def step(h, inputs):
        x_c, dt_c, b_c, c_c, reset_c = inputs
        return chunk_scan(x_c, dt_c, b_c, c_c, reset_c, A, h)

    h, y = jax.lax.scan(step, h0, chunks)  # y [c, B, L, E]
    return jnp.moveaxis(y, 0, 1).reshape(b, c * chunk, -1)[:, :t], h


def _ssd_pallas(chunk_size, sequences, params, real, starts, h0):
    """_ssd_run by the Pallas kernels: dt 0 at padding, x * dt in x's dtype and the log decays dt * A prepared
    here, the kernels run on each device's batch rows and heads (`shard.per_device_heads`: an opaque kernel in a
    sharded jit needs an explicit shard_map boundary)."""
    x, dt, B, C = sequences
    acc = h0.dtype
    dt = _steps(dt.astype(acc), real)
    backend = current_platform()

    def kernel(xdt, log_decay, B, C, reset, h0):
        return ssd_kernels.chunked_ssd(xdt, log_decay, B, C, reset, h0, chunk=chunk_size, backend=backend)

    xdt = (x.astype(acc) * dt[..., None]).astype(x.dtype)
    return shard.per_device_heads(kernel, (xdt, dt * params[0].astype(acc), B.astype(x.dtype), C.astype(x.dtype),
                                           starts, h0),
                                  heads_dims=(2, 2, 2, 2, None, 1), out_heads_dims=(2, 1), grouped=(2, 3))
