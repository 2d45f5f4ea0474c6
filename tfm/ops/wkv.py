"""RWKV-4's WKV time mixing (Peng et al. 2023), pure JAX.

Letters: B batch, T time, C channels; n chunks of L tokens.

Three forms of one recurrence. `reference` scans over time in the numerically stable form of
transformers' `rwkv_linear_attention_cpu` (a decode step). `chunked` is the training form: within
a chunk each output is a masked weighted sum of the chunk's values and the carried state, its log
weights lowered by their row's maximum before they are exponentiated (so every exponent is <= 0
and every denominator >= 1); a scan over chunks carries the stable state. Masked log weights are
-inf before exp, so no inf meets a zero in values or gradients. `pallas` is tfm.kernels.wkv's sequential
kernel (the reference's recurrence in one pass, the state in registers), on each device's rows and channels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tfm.kernels import wkv as kernel
from tfm.ops import context_scan, shard
from tfm.parallel.mesh import current_platform

IMPLS = ("reference", "chunked", "pallas")
EMPTY_MAX = -1e38  # the max exponent of the empty state, as in transformers


def wkv(w, u, k, v, *, segment_ids=None, initial_state=None, impl="chunked", chunk_size=64):
    """RWKV-4's time mixing. w [C] the per-channel decay rate (> 0): the state is multiplied by
    exp(-w) per token. transformers keeps log w as `time_decay` and uses -exp(time_decay) as the log
    decay, so pass w = exp(time_decay). u [C] the bonus of the current token (transformers'
    `time_first`); k, v [B, T, C].
        wkv_t = (sum_{i<t} e^{-(t-1-i) w + k_i} v_i + e^{u + k_t} v_t) / (sum_{i<t} e^{-(t-1-i) w + k_i} + e^{u + k_t})
    State: (num, den, max) [B, C] float32, transformers' stable form: the sums above are num * e^max
    and den * e^max, and max follows max_t = max(max_{t-1} - w, k_t), so the tuple is comparable entry
    by entry with transformers' state of one layer (`state[2:5]`, each `[:, :, layer]`). The empty
    state (initial_state None) is (0, 0, -1e38).
    segment_ids [B, T] int, 0 = padding: the state is emptied where a sequence starts
    (tfm.ops.segments); padding tokens leave it as it is, count as no step of decay, and output 0.
    impl: "reference" (a scan over time, for decoding), "chunked" (for training: a scan over chunks
    of chunk_size tokens, O(B chunk_size^2 C) memory) or "pallas" (the kernel; chunk_size rows per block on TPU).
    Computed in float32 whatever the input dtype.
    Returns (out [B, T, C] in v.dtype, final_state)."""
    _check(w, u, k, v, segment_ids, initial_state, impl, chunk_size)
    B, T, C = k.shape
    f32 = jnp.float32
    state = _empty(B, C) if initial_state is None else tuple(s.astype(f32) for s in initial_state)

    def run(sequences, params, real, starts, state):
        (k, v), (w, u) = sequences, params
        w, u, k, vf = (x.astype(f32) for x in (w, u, k, v))
        if impl == "reference":
            out, state = _recurrent(w, u, k, vf, real, starts, state)
        elif impl == "pallas":
            out, state = _pallas(w, u, k, vf, real, starts, state, chunk_size)
        else:
            out, state = _chunked(w, u, k, vf, real, starts, state, min(chunk_size, k.shape[1]))
        return out.astype(v.dtype), state

    def chunk_map(sequences, params, real, starts):  # each real token decays the state by exp(-w)
        log_decay = -params[0].astype(f32) * real.sum(1, dtype=f32)[:, None]  # [B, C]
        return (log_decay, 1.0 - starts.any(1).astype(f32)), run(sequences, params, real, starts, _empty(*real.shape[:1], C))[1]

    return context_scan.scan(run, chunk_map, _ALGEBRA, (k, v), (w, u), segment_ids, state)


def _empty(B, C):
    """The empty state (num, den, max), each [B, C]."""
    return jnp.zeros((B, C), jnp.float32), jnp.zeros((B, C), jnp.float32), jnp.full((B, C), EMPTY_MAX, jnp.float32)


def _apply(transfer, state):
    """A share's transfer (log decay [B, C], survives [B]: 1.0 where no sequence starts in it, else 0.0) on a state."""
    log_decay, survives = transfer
    num, den, top = state
    alive = survives[:, None] > 0
    return (jnp.where(alive, num, 0.0), jnp.where(alive, den, 0.0), jnp.where(alive, top + log_decay, EMPTY_MAX))


def _add(a, b):
    """The sum of two states in the stable form: num and den rescaled to the larger max (a scale
    the value does not depend on, so it takes no gradient)."""
    top = jax.lax.stop_gradient(jnp.maximum(jnp.maximum(a[2], b[2]), EMPTY_MAX))
    sa, sb = jnp.exp(a[2] - top), jnp.exp(b[2] - top)
    return a[0] * sa + b[0] * sb, a[1] * sa + b[1] * sb, top


# The WKV state's maps under context parallelism (tfm.ops.context_scan): num e^max and den e^max decay
# by exp(-w) per real token, and a sequence starting in a share empties what enters it.
_ALGEBRA = context_scan.Algebra(apply=_apply, add=_add,
                                compose=lambda a, b: (a[0] + b[0], a[1] * b[1]))


def _pallas(w, u, k, v, real, starts, state, chunk_size):
    """The kernel on each device's batch rows and channels (split as attention's heads, `shard.per_device_heads`: an
    opaque kernel in a sharded jit needs an explicit shard_map boundary), w and u repeated per row."""
    backend = current_platform()
    rows = lambda x: jnp.broadcast_to(x, k.shape[:1] + x.shape)

    def run(k, v, w, u, real, starts, *state):
        out, state = kernel.wkv(w, u, k, v, real, starts, state, chunk=chunk_size, backend=backend)
        return (out,) + state

    out, *state = shard.per_device_heads(run, (k, v, rows(w), rows(u), real, starts) + tuple(state),
                                         heads_dims=(2, 2, 1, 1, None, None, 1, 1, 1), out_heads_dims=(2, 1, 1, 1))
    return out, tuple(state)


def _recurrent(w, u, k, v, real, reset, state):
    """Token by token in transformers' stable form; reset [B, T] empties the state before its token."""
    def step(carry, x):
        kt, vt, rt, st = x  # [B, C], [B, C], [B], [B]
        empty = (0.0, 0.0, EMPTY_MAX)
        num, den, top = (jnp.where(st[:, None], e, s) for e, s in zip(empty, carry))
        m = jnp.maximum(top, u + kt)
        old, new = jnp.exp(top - m), jnp.exp(u + kt - m)
        out = (old * num + new * vt) / (old * den + new)
        m = jnp.maximum(top - w, kt)
        old, new = jnp.exp(top - w - m), jnp.exp(kt - m)
        updated = (old * num + new * vt, old * den + new, m)
        carry = tuple(jnp.where(rt[:, None], a, b) for a, b in zip(updated, (num, den, top)))
        return carry, jnp.where(rt[:, None], out, 0.0)

    state, out = jax.lax.scan(step, state, [jnp.moveaxis(x, 1, 0) for x in (k, v, real, reset)])
    return jnp.moveaxis(out, 0, 1), state


def _chunked(w, u, k, v, real, reset, state, L):
    """Chunks of L tokens; T is padded to a multiple of L with padding tokens (no reset), which
    leave the state as it is. Each chunk is rematerialised in the backward pass, so memory is
    O(B L^2 C) beside the inputs and the per-chunk states."""
    B, T, C = k.shape
    pad = -T % L
    n = (T + pad) // L

    def chunks(x):  # [B, T, ...] -> [n, B, L, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((B, n, L) + x.shape[2:]), 1, 0)

    before = jnp.tril(jnp.ones((L, L), bool), -1)  # [t, i]: i < t

    @jax.checkpoint
    def step(carry, x):
        num0, den0, max0 = carry  # [B, C]
        kc, vc, rc, sc = x  # [B, L, C], [B, L, C], [B, L], [B, L]
        count = jnp.cumsum(rc, axis=1).astype(jnp.float32)  # real tokens up to t, inclusive
        epoch = jnp.cumsum(sc, axis=1)  # resets up to t: equal epochs share a sequence
        carried = (epoch == 0)[..., None]  # [B, L, 1]: the carried state still reaches t

        # Outputs. Token i < t of t's epoch has decayed over the count[t] - 1 - count[i] real tokens
        # between them, the carried state over count[t] - 1; the current token carries the bonus u.
        # Padding needs no mask here: a real token after a run of padding starts a new epoch, and a
        # run starts with a new epoch or at the chunk's first token.
        seen = before & (epoch[:, :, None] == epoch[:, None, :])  # [B, t, i]
        logw = jnp.where(seen[..., None], kc[:, None] - w * (count[:, :, None, None] - 1 - count[:, None, :, None]),
                         -jnp.inf)  # [B, t, i, C]
        log0 = jnp.where(carried, max0[:, None] - w * (count[..., None] - 1), -jnp.inf)  # [B, L, C]
        logd = u + kc
        top = jax.lax.stop_gradient(jnp.maximum(logw.max(axis=2), jnp.maximum(log0, logd)))
        p, p0, pd = jnp.exp(logw - top[:, :, None]), jnp.exp(log0 - top), jnp.exp(logd - top)
        num = jnp.einsum("btic,bic->btc", p, vc) + p0 * num0[:, None] + pd * vc
        den = p.sum(axis=2) + p0 * den0[:, None] + pd
        out = jnp.where(rc[..., None], num / den, 0.0)

        # The state after the chunk's last token, its max exponent as transformers' recurrence makes it.
        last = epoch[:, -1:] == epoch  # [B, L]
        logs = jnp.where((rc & last)[..., None], kc - w * (count[:, -1:, None] - count[..., None]), -jnp.inf)
        logs0 = jnp.where(carried[:, -1], max0 - w * count[:, -1:], -jnp.inf)  # [B, C]
        m = jnp.maximum(jnp.maximum(logs.max(axis=1), logs0), EMPTY_MAX)
        q, q0 = jnp.exp(logs - m[:, None]), jnp.exp(logs0 - m)
        state = ((q * vc).sum(axis=1) + q0 * num0, q.sum(axis=1) + q0 * den0, m)
        return state, out

    state, out = jax.lax.scan(step, state, [chunks(x) for x in (k, v, real, reset)])
    return jnp.moveaxis(out, 0, 1).reshape(B, n * L, C)[:, :T], state


def _check(w, u, k, v, segment_ids, initial_state, impl, chunk_size):
    if impl not in IMPLS:
        raise ValueError(f"wkv: impl={impl!r}; expected one of {IMPLS}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"wkv: chunk_size={chunk_size!r}; expected a positive int")
    if k.ndim != 3 or k.shape[1] < 1:
        raise ValueError(f"wkv: k has shape {k.shape}; expected [B, T, C] with T >= 1")
    B, T, C = k.shape
    if v.shape != k.shape:
        raise ValueError(f"wkv: v has shape {v.shape}; expected k's {k.shape}")
    for name, x in (("w", w), ("u", u)):
        if x.shape != (C,):
            raise ValueError(f"wkv: {name} has shape {x.shape}; expected [C] = {(C,)}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"wkv: segment_ids has shape {segment_ids.shape}; expected [B, T] = {(B, T)}")
    if initial_state is not None and (len(initial_state) != 3
                                      or any(s.shape != (B, C) for s in initial_state)):
        raise ValueError(f"wkv: initial_state has shapes {[getattr(s, 'shape', s) for s in initial_state]}; "
                         f"expected (num, den, max), each [B, C] = {(B, C)}")
