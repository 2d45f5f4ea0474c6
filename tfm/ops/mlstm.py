"""The mLSTM (xLSTM, Beck et al. 2024; xLSTM-7B's form), pure JAX: a matrix memory with exponential input gates,
stabilised by a running maximum.

H heads, K the query/key head dim, V the value head dim; n chunks of C tokens. Per head, with log forget gate
lf_t = logsigmoid(f_t) and input gate preactivation i_t, the state is (C [K, V], n [K], m []):

    m_t = max(lf_t + m_{t-1}, i_t)
    C_t = exp(lf_t + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T      (n_t likewise with k_t)
    h_t = (q_t' C_t) / (max(|q_t' . n_t|, exp(-m_t)) + eps),   q_t' = q_t / sqrt(K)

m is the largest log weight among the terms C holds (the entering state's counts as m_0), so every exp above
is of a non-positive number. `chunked` computes each token's m in closed form: within a chunk, the largest of
(the entering state's log weight, b_t - b_j + i_j for the chunk's tokens j <= t), b the running sum of lf; the
state passes between chunks by a scan. A fresh sequence starts from zeros (m = 0, as transformers' xLSTM), and so
does a sequence start inside a row; padding tokens leave the state as it is (lf = 0, no input).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tfm.ops import context_scan

IMPLS = ("reference", "chunked")


def _merge(a, b):
    """Two states' terms together: the larger maximum, each side's terms rescaled to it."""
    (Ca, na, ma), (Cb, nb, mb) = a, b
    m = jnp.maximum(ma, mb)
    wa, wb = jnp.exp(ma - _finite(m)), jnp.exp(mb - _finite(m))
    return wa[..., None, None] * Ca + wb[..., None, None] * Cb, wa[..., None] * na + wb[..., None] * nb, m


def _finite(m):
    """m where finite, else 0: the stabiliser of a state without terms (m = -inf), whose exps are then 0."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


# A share of tokens maps the entering state to merge(its terms decayed by the share's log forget sum A, the
# share's own terms): transfers are A [B, H] (-inf after a sequence start), composed by adding.
LOG_WEIGHTS = context_scan.Algebra(apply=lambda a, s: (s[0], s[1], s[2] + a), add=_merge,
                                   compose=lambda a1, a2: a1 + a2)


def mlstm(q, k, v, i, f, *, segment_ids=None, initial_state=None, impl="chunked", chunk_size=64, eps=1e-6):
    """q, k [B, T, H, K]; v [B, T, H, V]; i, f [B, T, H] the gates' preactivations. initial_state: (C [B, H, K, V],
    n [B, H, K], m [B, H]) or None (zeros). segment_ids [B, T] int, 0 = padding (tfm.ops.segments). With the
    sequence split over `context` (tfm.ops.context_scan), each device's share is a map of the entering state in
    LOG_WEIGHTS. Returns (h [B, T, H, V] in v.dtype, final state (C, n, m), float32; float64 for float64 v)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}; the mLSTM has no Pallas kernel yet")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != (B, T, H) or i.shape != (B, T, H) or f.shape != (B, T, H):
        raise ValueError(f"mlstm takes q, k [B, T, H, K], v [B, T, H, V], i, f [B, T, H]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}, i {i.shape}, f {f.shape}")
    dtype = jnp.promote_types(v.dtype, jnp.float32)
    if initial_state is None:
        initial_state = (jnp.zeros((B, H, K, V), dtype), jnp.zeros((B, H, K), dtype), jnp.zeros((B, H), dtype))
    state = tuple(s.astype(dtype) for s in initial_state)

    def gates(i, f, real):
        return (jnp.where(real[..., None], i.astype(dtype), -jnp.inf),  # padding writes nothing
                jnp.where(real[..., None], jax.nn.log_sigmoid(f.astype(dtype)), 0.0))

    def run(sequences, params, real, starts, state):
        q, k, v, i, f = sequences
        i, lf = gates(i, f, real)
        q, k, v = (x.astype(dtype) for x in (q * K ** -0.5, k, v))
        if impl == "reference":
            h, state = _recurrent(q, k, v, i, lf, starts, state, eps)
        else:
            h, state = _chunked(q, k, v, i, lf, starts, state, eps, min(chunk_size, q.shape[1]))
        return h.astype(v.dtype), state

    def chunk_map(sequences, params, real, starts):
        """(A, the share's own terms: its run from a state without terms)."""
        _, lf = gates(*sequences[3:], real)
        transfer = jnp.where(starts.any(1)[:, None], -jnp.inf, lf.sum(1))
        Bs = sequences[0].shape[0]
        empty = (jnp.zeros((Bs, H, K, V), dtype), jnp.zeros((Bs, H, K), dtype), jnp.full((Bs, H), -jnp.inf, dtype))
        return transfer, run(sequences, params, real, starts, empty)[1]

    return context_scan.scan(run, chunk_map, LOG_WEIGHTS, (q, k, v, i, f), (), segment_ids, state)


def _recurrent(q, k, v, i, lf, starts, state, eps):
    """The recurrence token by token; a start drops the state to zeros before its token."""
    def step(s, x):
        C, n, m = s  # [B, H, K, V], [B, H, K], [B, H]
        q_t, k_t, v_t, i_t, lf_t, r_t = x
        C, n, m = (jnp.where(r_t.reshape((-1,) + (1,) * (a.ndim - 1)), 0.0, a) for a in (C, n, m))
        m_new = jnp.maximum(lf_t + m, i_t)
        decay, write = jnp.exp(lf_t + m - _finite(m_new)), jnp.exp(i_t - _finite(m_new))
        C = decay[..., None, None] * C + write[..., None, None] * k_t[..., :, None] * v_t[..., None, :]
        n = decay[..., None] * n + write[..., None] * k_t
        num = jnp.einsum("bhk,bhkv->bhv", q_t, C)
        den = jnp.maximum(jnp.abs(jnp.einsum("bhk,bhk->bh", q_t, n)), jnp.exp(-_finite(m_new)))
        return (C, n, m_new), num / (den[..., None] + eps)

    xs = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, i, lf, starts)]
    state, h = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(h, 0, 1), state


def _chunked(q, k, v, i, lf, starts, state, eps, C):
    """Chunks of C tokens (T padded with identity tokens: lf = 0, no input, no start)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    pad = -T % C
    n = (T + pad) // C

    def chunks(x, fill=0.0):  # [B, T, H, ...] -> [B, H, n, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape((B, n, C) + x.shape[2:]), 3, 1)

    q, k, v = chunks(q), chunks(k), chunks(v)                          # [B, H, n, C, K|V]
    i, lf = chunks(i[..., None], -jnp.inf)[..., 0], chunks(lf[..., None])[..., 0]  # [B, H, n, C]
    count = jnp.cumsum(jnp.pad(starts, ((0, 0), (0, pad))).reshape(B, 1, n, C), -1)  # starts so far

    causal = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    span = jnp.cumsum(jnp.where(strict, lf[..., :, None], 0), axis=-2)  # lf_{j+1} + ... + lf_t  [.., t, j]
    live = causal & (count[..., :, None] == count[..., None, :])       # no start in (j, t]
    log_w = jnp.where(live, span + i[..., None, :], -jnp.inf)          # token j's log weight at token t
    # The entering state's log weight at token t, less its m: b_t, or after a start in the chunk the fresh
    # zero state's (m = 0) weight from that start on; `fresh` says the entering state is gone.
    b = jnp.cumsum(lf, -1)                                             # [B, H, n, C]
    last_start = jax.lax.cummax(jnp.where(jnp.pad(starts, ((0, 0), (0, pad))).reshape(B, 1, n, C),
                                          jnp.arange(C), -1), axis=3)  # [B, 1, n, C]
    before = jnp.where(last_start > 0, jnp.take_along_axis(b, jnp.maximum(last_start - 1, 0).repeat(H, 1), -1), 0.0)
    fresh = last_start >= 0
    scores = jnp.einsum("...tk,...jk->...tj", q, k)                    # q already scaled

    def step(s, x):
        C_in, n_in, m_in = s                                           # [B, H, K, V], [B, H, K], [B, H]
        q, k, v, log_w, b, before, fresh, scores = x
        m_in = m_in[..., None]
        enter = jnp.where(fresh, b - before, b + m_in)                 # [B, H, C]
        m = jnp.maximum(enter, jnp.max(log_w, -1))                     # each token's m
        safe = _finite(m)
        d = jnp.exp(log_w - safe[..., None]) * scores                  # [B, H, C, C]
        carry = jnp.where(fresh, 0.0, jnp.exp(enter - safe))           # the entering state's factor
        num = carry[..., None] * jnp.einsum("bhck,bhkv->bhcv", q, C_in) + jnp.einsum("bhtj,bhjv->bhtv", d, v)
        den = carry * jnp.einsum("bhck,bhk->bhc", q, n_in) + jnp.sum(d, -1)
        h = num / (jnp.maximum(jnp.abs(den), jnp.exp(-safe)) + eps)[..., None]
        m_out = m[..., -1]
        w_out = jnp.exp(log_w[..., -1, :] - safe[..., -1, None])       # [B, H, C]: each token's share at the end
        C_out = carry[..., -1, None, None] * C_in + jnp.einsum("bhc,bhck,bhcv->bhkv", w_out, k, v)
        n_out = carry[..., -1, None] * n_in + jnp.einsum("bhc,bhck->bhk", w_out, k)
        return (C_out, n_out, m_out), h

    xs = [jnp.moveaxis(x, 2, 0) for x in (q, k, v, log_w, b, before.astype(b.dtype), jnp.broadcast_to(fresh, b.shape),
                                          scores)]
    state, h = jax.lax.scan(step, state, xs)                           # h [n, B, H, C, V]
    h = jnp.moveaxis(h, 0, 2).reshape(B, H, n * C, V)[:, :, :T]
    return jnp.moveaxis(h, 1, 2), state
