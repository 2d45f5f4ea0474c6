"""What every attention backend agrees on: visibility, ALiBi, soft-capped logits, input checks.

Masks are described by positions and segment ids and built here, per tile or whole, by the
backends that need them; callers never materialise one.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so fully masked rows stay NaN-free


def visibility(q_pos, kv_pos, q_seg, kv_seg, *, causal: bool, window: Optional[int], sparsity=None,
               lengths=None):
    """Boolean [B, T, S] (or broadcastable): may query t see key s.

    q_pos [B|1, T], kv_pos [B|1, S] ints; q_seg / kv_seg int [B, T] / [B, S] or None; sparsity a
    `tfm.kernels.sparsity` pattern or None, laid over `lengths` (T, S) (default: these positions' lengths;
    a BigBird table is sized by them, so a chunk of keys passes the whole lengths).
    """
    T, S = lengths or (q_pos.shape[1], kv_pos.shape[1])
    q_pos, kv_pos = q_pos[:, :, None], kv_pos[:, None, :]
    visible = jnp.ones(jnp.broadcast_shapes(q_pos.shape, kv_pos.shape), bool)
    if causal:
        visible &= kv_pos <= q_pos
    if window is not None:
        distance = q_pos - kv_pos if causal else jnp.abs(q_pos - kv_pos)
        visible &= distance < window
    if sparsity is not None:
        visible &= sparsity.visible(q_pos, kv_pos, T, S)
    if kv_seg is not None:
        visible = visible & (kv_seg[:, None, :] != 0)
        if q_seg is not None:
            visible = visible & (q_seg[:, :, None] == kv_seg[:, None, :])
    return visible


def alibi_slopes(num_heads: int, bias_max: float = 8.0) -> jax.Array:
    """ALiBi head slopes [N] (Press et al. 2022), geometric from 2^(-bias_max/n) (8 in the paper;
    MPT's alibi_bias_max); non-powers of two interleave the slopes of the next power of two, as in
    the paper's reference code (BLOOM and MPT compute the same)."""
    def powers_of_two(n):
        start = 2.0 ** (-bias_max / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** (num_heads.bit_length() - 1)
    slopes = powers_of_two(closest)
    if closest != num_heads:
        slopes += powers_of_two(2 * closest)[0::2][: num_heads - closest]
    return jnp.asarray(slopes, jnp.float32)


def scores(q, k, scale, softcap, slopes, q_pos, kv_pos):
    """Unmasked fp32 logits [B, K, G, T, S] from q [B, T, K, G, H] and k [B, S, K, H]:
    scaled, then soft-capped, then ALiBi-biased."""
    s = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if slopes is not None:
        K, G = q.shape[2], q.shape[3]
        distance = jnp.abs(q_pos[:, :, None] - kv_pos[:, None, :]).astype(jnp.float32)  # [B, T, S]
        s = s - slopes.reshape(1, K, G, 1, 1) * distance[:, None, None]
    return s


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
