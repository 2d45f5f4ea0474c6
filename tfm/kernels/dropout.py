"""Attention dropout's keep mask as a counter-based hash of (seed, batch, head, query, key).

The flash kernels regenerate the mask per tile in the forward and both backward kernels, and the
xla reference (`tfm.ops.xla`) builds it whole from the same function, so the two drop the same
probabilities given the same seed. Indices are global: batch row and query head of the whole
call (not of a device's shard), query and key positions in the unpadded sequences; the mask
therefore depends on neither the kernels' tiles nor the mesh.

Only int32 jnp ops (wrapping multiply, xor, logical shifts, a signed compare), so it lowers in
Pallas on TPU Mosaic, GPU Triton and the CPU interpreter alike. The hash: murmur3's 32-bit
finaliser (`_fmix`) keys a head from (seed, batch, head), a row from (head key, query) and a
column from (head key, key position); the element is the finaliser of row ^ column, and is kept
when its top 31 bits reach `threshold(rate)`: probability 1 - rate up to 2^-31.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Odd multipliers (golden ratio and murmur3's); as int32 their products wrap like uint32 ones.
_GOLDEN, _M1, _M2, _HEAD, _ROW, _COL = (np.uint32(c).view(np.int32) for c in (
    0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x7FEB352D, 0x27D4EB2F, 0x165667B1))


def _fmix(h):
    """murmur3's 32-bit finaliser (a bijection with full avalanche) on int32 bits."""
    h = h ^ lax.shift_right_logical(h, jnp.int32(16))
    h = h * _M1
    h = h ^ lax.shift_right_logical(h, jnp.int32(13))
    h = h * _M2
    return h ^ lax.shift_right_logical(h, jnp.int32(16))


def seed(rng) -> jax.Array:
    """int32 [] seed from a jax PRNG key (the layer's dropout rng)."""
    return lax.bitcast_convert_type(jax.random.bits(rng, (), jnp.uint32), jnp.int32)


def threshold(rate: float) -> int:
    """Elements whose hash's top 31 bits are >= this are kept: P(keep) = 1 - rate (to 2^-31)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    return int(round(rate * 2.0 ** 31))


def head_key(seed, batch, head):
    """int32 key of one (batch row, query head) from int32 seed, batch and head (scalars, or arrays
    that broadcast)."""
    return _fmix(_fmix(seed + batch * _GOLDEN) ^ (head * _HEAD))


def keep(key, rows, cols, rate: float):
    """bool keep mask for head key `key`, query positions rows [..., T, 1] and key positions
    cols [..., 1, S] (int32, broadcast against each other and the key) -> [..., T, S]."""
    row = _fmix(key ^ (rows * _ROW))
    col = _fmix(key + cols * _COL)
    bits = lax.shift_right_logical(_fmix(row ^ col), jnp.int32(1))  # uniform in [0, 2^31)
    return bits >= jnp.int32(threshold(rate))
