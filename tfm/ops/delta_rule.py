"""The gated delta rule (gated DeltaNet, Yang et al. 2024; Qwen3-Next's linear attention) and its per-channel
decay (Kimi Delta Attention, KDA: Kimi Linear, 2025), pure JAX.

Letters here follow the gated-DeltaNet convention, not DESIGN.md's attention letters: H heads,
K the query/key head dim, V the value head dim; n chunks of C tokens.

Two forms of one recurrence. `reference` scans over time (a decode step). `chunked` is the training
form: within a chunk the delta updates form a unit lower-triangular system (the WY/UT
representation), solved for all of the chunk's corrected values at once, and only the state is
carried by a scan over chunks. A decay between two tokens is a sum of log decays (<= 0) over the
span between them, summed pairwise (not a difference of running sums, which cancels and, reversed,
overflows) and masked before exp: nothing positive is exponentiated and no inf meets a zero.
With a per-channel decay (g [B, T, H, K]) those spans are per key channel, [C, C, K] a chunk, so the chunked
form holds C^2 K decays per chunk and head where the scalar decay holds C^2.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jax.scipy.linalg import solve_triangular

from tfm.kernels.delta_rule import chunked_gated_delta_rule
from tfm.kernels.kda import chunked_kda
from tfm.ops import context_scan, shard
from tfm.parallel.mesh import current_platform

IMPLS = ("reference", "chunked", "pallas")


def gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None, impl="chunked",
                     chunk_size=64):
    """q, k [B, T, H, K] (the caller has already L2-normalised q and k and scaled q by K**-0.5);
    v [B, T, H, V]; g [B, T, H] log decays (<= 0), or [B, T, H, K] one per key channel (KDA); beta [B, T, H] in (0, 1).
    Per head, state S [K, V]:  S' = diag(exp(g_t)) S_{t-1} (exp(g_t) S_{t-1} for a scalar g);
    S_t = S' + beta_t * outer(k_t, v_t - S'^T k_t);  o_t = S_t^T q_t
    Returns (o [B, T, H, V] in v.dtype, final_state [B, H, K, V] float32).

    segment_ids [B, T] int, 0 = padding: the state is dropped where a sequence starts
    (tfm.ops.segments; t = 0 continues from initial_state [B, H, K, V], None = zeros), and
    padding tokens act as g = 0, beta = 0. State and decays are float32 (float64 for float64 v).
    impl: "reference" (a scan over time), "chunked" (a scan over chunks of chunk_size tokens) or "pallas" (the
    chunked form's kernels on each device's batch rows and heads, tfm.kernels.delta_rule for a scalar decay and
    tfm.kernels.kda per key channel; chunk_size a tile they take)."""
    _check(q, k, v, g, beta, segment_ids, initial_state, impl, chunk_size)
    B, T, H, K = q.shape
    dtype = jnp.promote_types(v.dtype, jnp.float32)
    state = (jnp.zeros((B, H, K, v.shape[-1]), dtype) if initial_state is None
             else initial_state.astype(dtype))

    def run(sequences, params, real, starts, state):
        q, k, v, g, beta = (x.astype(dtype) for x in sequences)
        g = jnp.where(real.reshape(real.shape + (1,) * (g.ndim - 2)), g, 0)
        beta = jnp.where(real[..., None], beta, 0)
        if impl == "reference":
            o, state = _recurrent(q, k, v, g, beta, starts, state)
        elif impl == "pallas":
            o, state = _pallas(*sequences[:3], g, beta, starts, state, chunk_size)
        else:
            o, state = _chunked(q, k, v, g, beta, starts, state, min(chunk_size, q.shape[1]))
        return o.astype(sequences[2].dtype), state

    def chunk_map(sequences, params, real, starts):
        """The share's map S -> A S + b, both from one run: values [0 | v] from the state [I | 0] end as [A | b]."""
        q, k, v, g, beta = sequences
        probe = jnp.concatenate([jnp.zeros(v.shape[:3] + (K,), v.dtype), v], -1)
        eye = jnp.broadcast_to(jnp.eye(K, dtype=dtype), (v.shape[0], H, K, K))
        _, final = run((q, k, probe, g, beta), params, real, starts,
                       jnp.concatenate([eye, jnp.zeros(state.shape, dtype)], -1))
        return final[..., :K], final[..., K:]

    return context_scan.scan(run, chunk_map, context_scan.MATRIX, (q, k, v, g, beta), (), segment_ids, state)


def _recurrent(q, k, v, g, beta, reset, state):
    """The recurrence token by token; reset [B, T] drops the state before its token."""
    def step(s, x):  # s [B, H, K, V]
        q_t, k_t, v_t, g_t, b_t, r_t = x  # [B, H, K], [B, H, K], [B, H, V], [B, H, 1 | K], [B, H], [B]
        s = jnp.where(r_t[:, None, None, None], 0, jnp.exp(g_t)[..., None] * s)
        err = v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)
        s = s + (b_t[..., None] * k_t)[..., :, None] * err[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

    state, o = jax.lax.scan(step, state, [jnp.moveaxis(x, 1, 0) for x in (q, k, v, _channels(g), beta, reset)])
    return jnp.moveaxis(o, 0, 1), state


def _channels(g):
    """Log decays with a channel axis: [B, T, H] -> [B, T, H, 1]; [B, T, H, K] as it is."""
    return g if g.ndim == 4 else g[..., None]


def _pairs(x, y, decay):
    """sum_c x_i[c] y_j[c] decay[i, j, c] [..., C, C] of x, y [..., C, K] and decay [..., C, C, 1 | K]."""
    if decay.shape[-1] == 1:
        return jnp.einsum("...ik,...jk->...ij", x, y) * decay[..., 0]
    return jnp.einsum("...ik,...jk,...ijk->...ij", x, y, decay)


def _chunked(q, k, v, g, beta, reset, state, C):
    """The WY/UT chunked form; T is padded to a multiple of C with identity tokens (g = 0,
    beta = 0, no reset), which leave the state as it is."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    pad = -T % C
    n = (T + pad) // C

    def chunks(x):  # [B, T, H, ...] -> [B, H, n, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((B, n, C) + x.shape[2:]), 3, 1)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(_channels(g))  # [B, H, n, C, K|V|1]
    beta = chunks(beta[..., None])[..., 0]                            # [B, H, n, C]
    count = jnp.cumsum(jnp.pad(reset, ((0, 0), (0, pad))).reshape(B, 1, n, C), -1)  # resets so far

    causal = jnp.tril(jnp.ones((C, C), bool))                         # [i, j]: j <= i
    strict = jnp.tril(jnp.ones((C, C), bool), -1)                     # j < i
    # span[i, j] = g_{j+1} + ... + g_i (j <= i), per channel: the log decay from token j's update to token i.
    span = jnp.cumsum(jnp.where(strict[..., None], g[..., :, None, :], 0), axis=-3)
    live = causal & (count[..., :, None] == count[..., None, :])      # no reset in (j, i]
    decay = jnp.exp(jnp.where(live[..., None], span, -jnp.inf))       # [B, H, n, C, C, 1 | K]
    # From the state entering the chunk to token i (g_0 + ... + g_i), dropped after a reset.
    d_in = jnp.exp(jnp.where((count == 0)[..., None], jnp.cumsum(g, -2), -jnp.inf))  # [B, H, n, C, 1 | K]

    # Corrected values W (one row per token) solve (I + A) W = beta v - (beta d_in k) S_in,
    # A[i, j] = beta_i sum_c decay[i, j, c] k_i[c] k_j[c] for j < i; so W = U - Wk S_in, both independent of S_in.
    a = jnp.where(strict, beta[..., None] * _pairs(k, k, decay), 0)
    rhs = jnp.concatenate([beta[..., None] * v, beta[..., None] * d_in * k], -1)
    sol = solve_triangular(a, rhs, lower=True, unit_diagonal=True)    # reads a's strict lower part
    u, wk = sol[..., :V], sol[..., V:]
    attn = _pairs(q, k, decay)                                        # [B, H, n, C, C]
    q_in = d_in * q                                                   # reads the entering state
    k_out = decay[..., -1, :, :] * k                                  # writes the leaving state
    through = d_in[..., -1, :]                                        # [B, H, n, 1 | K]

    def step(s, x):  # s [B, H, K, V]
        u, wk, attn, q_in, k_out, through = x
        w = u - jnp.einsum("bhck,bhkv->bhcv", wk, s)
        o = jnp.einsum("bhck,bhkv->bhcv", q_in, s) + jnp.einsum("bhij,bhjv->bhiv", attn, w)
        s = through[..., None] * s + jnp.einsum("bhck,bhcv->bhkv", k_out, w)
        return s, o

    xs = [jnp.moveaxis(x, 2, 0) for x in (u, wk, attn, q_in, k_out, through)]
    state, o = jax.lax.scan(step, state, xs)                          # o [n, B, H, C, V]
    o = jnp.moveaxis(o, 0, 2).reshape(B, H, n * C, V)[:, :, :T]
    return jnp.moveaxis(o, 1, 2), state


def _pallas(q, k, v, g, beta, reset, state, chunk_size):
    """The chunked form by the Pallas kernels (q and k in v's dtype; the scalar decay's, or KDA's for g [B, T, H, K])
    on each device's batch rows and heads (`shard.per_device_heads`: an opaque kernel in a sharded jit needs an
    explicit shard_map boundary)."""
    backend = current_platform()
    chunked = chunked_kda if g.ndim == 4 else chunked_gated_delta_rule

    def kernel(q, k, v, g, beta, reset, state):
        return chunked(q, k, v, g, beta, reset, state, chunk=chunk_size, backend=backend)

    return shard.per_device_heads(kernel, (q.astype(v.dtype), k.astype(v.dtype), v, g, beta, reset, state),
                                  heads_dims=(2, 2, 2, 2, 2, None, 1), out_heads_dims=(2, 1))


def _check(q, k, v, g, beta, segment_ids, initial_state, impl, chunk_size):
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}; pick one of them")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
    if q.ndim != 4 or q.shape[1] < 1:
        raise ValueError(f"q has shape {q.shape}; expected [B, T, H, K] with T >= 1")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k has shape {k.shape}; expected q's shape {q.shape} (repeat heads)")
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v has shape {v.shape}; expected [B, T, H, V] = [{B}, {T}, {H}, V]")
    if g.shape not in ((B, T, H), (B, T, H, K)):
        raise ValueError(f"g has shape {g.shape}; expected [B, T, H] = {(B, T, H)} or [B, T, H, K] = {(B, T, H, K)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta has shape {beta.shape}; expected [B, T, H] = {(B, T, H)}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"segment_ids has shape {segment_ids.shape}; expected [B, T] = {(B, T)}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state has shape {initial_state.shape}; expected [B, H, K, V] = "
                         f"{(B, H, K, v.shape[-1])}")
