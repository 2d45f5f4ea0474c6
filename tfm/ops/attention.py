"""The one attention entry point.

Layout everywhere: q [B, T, N, H], k and v [B, S, K, H], output [B, T, N, H], with N a
multiple of K (G = N // K query heads share one key/value head; K == N is MHA, K == 1 MQA).

Masking is described, never materialised by the caller:
  causal          key position <= query position.
  window          causal: 0 <= q_pos - kv_pos < window; bidirectional: |q_pos - kv_pos| < window.
  segment ids     int [B, T] / [B, S]; a query sees a key only with the same id, and id 0
                  marks padding, which nothing attends to (padding query rows give 0).
  positions       int [B, T] / [B, S]; default arange. Only the KV-cache decode path passes
                  them; causal, window and ALiBi are functions of positions.
  alibi_slopes    float [N]; adds -slope * |q_pos - kv_pos| to the logits.
  softcap         logits -> softcap * tanh(logits / softcap), after scaling, before ALiBi.
A row with no visible key outputs 0 (never NaN).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "chunked", "pallas", "cudnn", "auto")
_NEG_INF = -1e30  # finite, so fully masked rows stay NaN-free


def visibility(q_pos, kv_pos, q_seg, kv_seg, *, causal: bool, window: Optional[int]):
    """Boolean [B, T, S] (or broadcastable): may query t see key s.

    q_pos [B|1, T], kv_pos [B|1, S] ints; q_seg / kv_seg int [B, T] / [B, S] or None.
    """
    q_pos, kv_pos = q_pos[:, :, None], kv_pos[:, None, :]
    visible = jnp.ones(jnp.broadcast_shapes(q_pos.shape, kv_pos.shape), bool)
    if causal:
        visible &= kv_pos <= q_pos
    if window is not None:
        distance = q_pos - kv_pos if causal else jnp.abs(q_pos - kv_pos)
        visible &= distance < window
    if kv_seg is not None:
        visible = visible & (kv_seg[:, None, :] != 0)
        if q_seg is not None:
            visible = visible & (q_seg[:, :, None] == kv_seg[:, None, :])
    return visible


def alibi_slopes(num_heads: int) -> jax.Array:
    """ALiBi head slopes [N] (Press et al. 2022), geometric from 2^(-8/n); non-powers of two
    interleave the slopes of the next power of two, as in the paper's reference code."""
    def powers_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** (num_heads.bit_length() - 1)
    slopes = powers_of_two(closest)
    if closest != num_heads:
        slopes += powers_of_two(2 * closest)[0::2][: num_heads - closest]
    return jnp.asarray(slopes, jnp.float32)


def _scores(q, k, scale, softcap, slopes, q_pos, kv_pos):
    """fp32 logits [B, K, G, T, S] from q [B, T, K, G, H] and k [B, S, K, H]."""
    s = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if slopes is not None:
        K, G = q.shape[2], q.shape[3]
        distance = jnp.abs(q_pos[:, :, None] - kv_pos[:, None, :]).astype(jnp.float32)  # [B, T, S]
        s = s - slopes.reshape(1, K, G, 1, 1) * distance[:, None, None]
    return s


def _xla_attention(q, k, v, *, causal, q_seg, kv_seg, q_pos, kv_pos, window, slopes, softcap,
                   scale, dropout_rate, dropout_rng):
    """Reference: materialises the [B, N, T, S] logits."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    s = _scores(qg, k, scale, softcap, slopes, q_pos, kv_pos)
    visible = visibility(q_pos, kv_pos, q_seg, kv_seg, causal=causal, window=window)[:, None, None]
    s = jnp.where(visible, s, _NEG_INF)
    p = jax.nn.softmax(s, axis=-1) * visible  # fully masked rows -> 0
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    o = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v.dtype), v)
    return o.reshape(B, T, N, H)


# --------------------------------------------------------------------------------------
# chunked: blockwise online softmax over key chunks; O(T + S) memory in both passes.
# --------------------------------------------------------------------------------------

def _pad_axis(x, axis, multiple, value=0):
    pad = -x.shape[axis] % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _chunks(x, chunk, axis=1):
    """Split axis into [num_chunks, ...] leading for lax.scan."""
    shape = x.shape
    x = x.reshape(shape[:axis] + (shape[axis] // chunk, chunk) + shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _chunk_logits(qg, kc, kv_pos_c, kv_seg_c, q_pos, q_seg, slopes, cfg):
    """Masked logits [B, K, G, T, c] and visibility for one key chunk."""
    causal, window, softcap, scale = cfg
    s = _scores(qg, kc, scale, softcap, slopes, q_pos, kv_pos_c)
    visible = visibility(q_pos, kv_pos_c, q_seg, kv_seg_c, causal=causal, window=window)[:, None, None]
    return jnp.where(visible, s, _NEG_INF), visible


def _chunked_forward(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, cfg, chunk):
    """Returns o [B, T, K, G, H] (q dtype) and lse [B, K, G, T] (fp32)."""
    B, T, K, G, H = qg.shape
    xs = (_chunks(k, chunk), _chunks(v, chunk), _chunks(kv_pos, chunk), _chunks(kv_seg, chunk))

    def step(carry, x):
        m, l, acc = carry
        kc, vc, kv_pos_c, kv_seg_c = x
        s, visible = _chunk_logits(qg, kc, kv_pos_c, kv_seg_c, q_pos, q_seg, slopes, cfg)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None]) * visible
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(-1)
        acc = acc * correction[..., None] + jnp.einsum(
            "BKGTS,BSKH->BKGTH", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
        return (m_new, l, acc), None

    init = (jnp.full((B, K, G, T), _NEG_INF, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, H), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, xs)
    safe_l = jnp.where(l == 0.0, 1.0, l)
    o = acc / safe_l[..., None]
    lse = jnp.where(l == 0.0, jnp.inf, m + jnp.log(safe_l))  # +inf: exp(s - lse) = 0 for empty rows
    return jnp.einsum("BKGTH->BTKGH", o).astype(qg.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _chunked_core(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, cfg, chunk):
    return _chunked_forward(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, cfg, chunk)[0]


def _chunked_core_fwd(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, cfg, chunk):
    o, lse = _chunked_forward(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, cfg, chunk)
    return o, (qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, o, lse)


def _chunked_core_bwd(cfg, chunk, residuals, do):
    """Flash-style backward: recompute each chunk's probabilities from the saved lse."""
    qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, o, lse = residuals
    causal, window, softcap, scale = cfg
    do32 = do.astype(jnp.float32)
    delta = jnp.einsum("BTKGH,BTKGH->BKGT", do32, o.astype(jnp.float32))
    xs = (_chunks(k, chunk), _chunks(v, chunk), _chunks(kv_pos, chunk), _chunks(kv_seg, chunk))

    def step(dq, x):
        kc, vc, kv_pos_c, kv_seg_c = x
        s, visible = _chunk_logits(qg, kc, kv_pos_c, kv_seg_c, q_pos, q_seg, slopes, cfg)
        p = jnp.exp(s - lse[..., None]) * visible  # [B, K, G, T, c]
        dv = jnp.einsum("BKGTS,BTKGH->BSKH", p, do32)
        dp = jnp.einsum("BTKGH,BSKH->BKGTS", do32, vc.astype(jnp.float32))
        ds = p * (dp - delta[..., None])
        if softcap is not None:  # d/dx [c tanh(x/c)] = 1 - tanh^2 = 1 - (capped / c)^2
            raw = jnp.einsum("BTKGH,BSKH->BKGTS", qg, kc, preferred_element_type=jnp.float32) * scale
            ds = ds * (1.0 - jnp.tanh(raw / softcap) ** 2)
        ds = ds * scale
        dq = dq + jnp.einsum("BKGTS,BSKH->BTKGH", ds, kc.astype(jnp.float32))
        dk = jnp.einsum("BKGTS,BTKGH->BSKH", ds, qg.astype(jnp.float32))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(qg.shape, jnp.float32), xs)
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(k.shape)  # [n, B, c, K, H] -> [B, S, K, H]
    return (dq.astype(qg.dtype), unchunk(dk).astype(k.dtype), unchunk(dv).astype(v.dtype),
            None, None, None, None, None)


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def _chunked_attention(q, k, v, *, causal, q_seg, kv_seg, q_pos, kv_pos, window, slopes, softcap,
                       scale, chunk_size):
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    chunk = min(chunk_size, S)
    if kv_seg is None:
        kv_seg = jnp.ones((B, S), jnp.int32)
        q_seg = None
    # Pad keys to a multiple of the chunk with segment 0 (invisible).
    k, v = _pad_axis(k, 1, chunk), _pad_axis(v, 1, chunk)
    kv_seg = _pad_axis(jnp.broadcast_to(kv_seg, (B, S)), 1, chunk)
    kv_pos = _pad_axis(jnp.broadcast_to(kv_pos, (B, S)), 1, chunk)
    q_pos = jnp.broadcast_to(q_pos, (B, T))
    cfg = (causal, window, softcap, scale)
    qg = q.reshape(B, T, K, N // K, H)
    o = _chunked_core(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, cfg, chunk)
    return o.reshape(B, T, N, H)


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------

def check_attention_inputs(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
    """Raises ValueError naming the mismatch."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects [batch, length, heads, head_dim]; got q{q.shape} "
                         f"k{k.shape} v{v.shape}")
    B, T, N, H = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
    if k.shape[0] != B or k.shape[3] != H:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if N % k.shape[2]:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({k.shape[2]})")
    if q_segment_ids is not None and kv_segment_ids is None:
        raise ValueError("q_segment_ids given without kv_segment_ids")
    for name, ids, length in (("q_segment_ids", q_segment_ids, T), ("kv_segment_ids", kv_segment_ids, k.shape[1]),
                              ("q_positions", q_positions, T), ("kv_positions", kv_positions, k.shape[1])):
        if ids is not None and (ids.ndim != 2 or ids.shape[1] != length):
            raise ValueError(f"{name} must be [batch, {length}]; got {ids.shape}")


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    q_segment_ids: Optional[jax.Array] = None,
    kv_segment_ids: Optional[jax.Array] = None,
    q_positions: Optional[jax.Array] = None,
    kv_positions: Optional[jax.Array] = None,
    window: Optional[int] = None,
    alibi_slopes: Optional[jax.Array] = None,
    softcap: Optional[float] = None,
    scale: Optional[float] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
    impl: str = "xla",
    chunk_size: int = 128,
    block_sizes=None,
) -> jax.Array:
    """Attention softmax(q k^T * scale + masks) v. q [B, T, N, H]; k, v [B, S, K, H] -> [B, T, N, H].

    impl: "xla" (reference), "chunked" (pure-JAX blockwise, O(L) memory), "pallas"
    (flash kernels), "cudnn" (jax.nn, GPU only), "auto" (fastest per backend).
    """
    check_attention_inputs(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from {IMPLEMENTATIONS}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("attention dropout_rate > 0 needs a dropout_rng")
    B, T, N, H = q.shape
    S = k.shape[1]
    scale = H ** -0.5 if scale is None else scale
    if impl == "auto":
        from tfm.ops import select
        impl = select.choose_impl(q, k, dropout_rate=dropout_rate, positions_given=q_positions is not None)
    if dropout_rate > 0.0 and impl != "xla":
        raise ValueError(f"attention dropout is implemented only by impl='xla', not {impl!r}")
    if impl in ("pallas", "cudnn"):
        if q_positions is not None or kv_positions is not None:
            raise ValueError(f"impl={impl!r} takes no explicit positions (decode with impl='xla')")
        if impl == "pallas":
            from tfm.kernels import flash_attention
            return flash_attention.flash_attention(
                q, k, v, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                window=window, alibi_slopes=alibi_slopes, softcap=softcap, scale=scale,
                block_sizes=block_sizes)
        from tfm.ops import cudnn
        return cudnn.attention(q, k, v, causal=causal, q_segment_ids=q_segment_ids,
                               kv_segment_ids=kv_segment_ids, window=window, alibi_slopes=alibi_slopes,
                               softcap=softcap, scale=scale)
    q_pos = jnp.arange(T)[None] if q_positions is None else q_positions
    kv_pos = jnp.arange(S)[None] if kv_positions is None else kv_positions
    common = dict(causal=causal, q_seg=q_segment_ids, kv_seg=kv_segment_ids, q_pos=q_pos,
                  kv_pos=kv_pos, window=window, softcap=softcap, scale=scale)
    if impl == "xla":
        return _xla_attention(q, k, v, slopes=alibi_slopes, dropout_rate=dropout_rate,
                              dropout_rng=dropout_rng, **common)
    return _chunked_attention(q, k, v, slopes=alibi_slopes, chunk_size=chunk_size,
                              **common)
