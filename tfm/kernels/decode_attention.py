"""Pallas decode attention: one query step against a long KV cache, split-K over the cache.

The cache [B, S, K, H] is cut into `num_splits` contiguous splits; grid (B, K, splits) runs
each split for all G query heads of one key/value head (so K/V are read once per step, not
G times), each giving a partial (o, m, l). `_combine` merges the splits with their
log-sum-exp weights. Keys at index >= kv_lengths[b] are masked (a length-0 row gives 0).
Forward only: decoding takes no gradients. The reference is the xla impl of
`tfm.ops.attention.dot_product_attention` with kv_segment_ids = (arange(S) < length).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tfm.kernels.flash_attention import _NEG_INF, _backend_name, _compiler_params, _dot, _pad


class _DecodeConfig(NamedTuple):
    softcap: Optional[float]
    scale: float
    block_kv: int
    interpret: bool


def _decode_kernel(q_ref, k_ref, v_ref, len_ref, o_ref, m_ref, l_ref, *, cfg: _DecodeConfig):
    """Grid (B, K, splits). q [G', H], k/v [S/splits, H], len [1, 1] -> o [G', H], m, l [G', 1]."""
    bk, split = cfg.block_kv, k_ref.shape[0]
    offset = pl.program_id(2) * split
    q, length = q_ref[...], len_ref[...]

    def body(c, carry):
        m, l, acc = carry
        rows = pl.ds(pl.multiple_of(c * bk, bk), bk)
        s = _dot(q, k_ref[rows, :], (1, 1)) * cfg.scale  # [G', bk]
        if cfg.softcap is not None:
            s = cfg.softcap * jnp.tanh(s / cfg.softcap)
        visible = offset + c * bk + lax.broadcasted_iota(jnp.int32, s.shape, 1) < length
        s = jnp.where(visible, s, _NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        correction = jnp.exp(m - m_new)
        acc = acc * correction + _dot(p.astype(v_ref.dtype), v_ref[rows, :])
        return m_new, l * correction + p.sum(axis=-1, keepdims=True), acc

    rows_q = q.shape[0]
    init = (jnp.full((rows_q, 1), _NEG_INF, jnp.float32), jnp.zeros((rows_q, 1), jnp.float32),
            jnp.zeros(o_ref.shape, jnp.float32))
    m, l, acc = lax.fori_loop(0, split // bk, body, init)
    o_ref[...] = acc / jnp.where(l == 0.0, 1.0, l)
    m_ref[...], l_ref[...] = m, l


def _combine(o, m, l):
    """Merges splits: o [..., splits, G', H], m and l [..., splits, G', 1] -> [..., G', H]."""
    weight = l * jnp.exp(m - m.max(axis=-3, keepdims=True))  # 0 for empty splits
    total = weight.sum(axis=-3)
    return (weight * o).sum(axis=-3) / jnp.where(total == 0.0, 1.0, total)


def decode_attention(q, k, v, *, kv_lengths, softcap: Optional[float] = None, scale: Optional[float] = None,
                     num_splits: Optional[int] = None, block_kv: int = 128, backend: Optional[str] = None,
                     interpret: Optional[bool] = None):
    """q [B, N, H] (one step); k, v [B, S, K, H]; kv_lengths int [B] -> [B, N, H].

    Keys [0, kv_lengths[b]) are visible. num_splits defaults to one split per 512 keys, up to 16.
    backend ("tpu", "gpu", "cpu") and interpret default as in `flash_attention`.
    """
    B, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    if block_kv < 8 or block_kv & (block_kv - 1):
        raise ValueError(f"block_kv must be a power of two >= 8, got {block_kv}")
    num_splits = max(1, min(16, S // 512)) if num_splits is None else num_splits
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    backend = _backend_name(backend)
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    cfg = _DecodeConfig(softcap=softcap, scale=float(H ** -0.5 if scale is None else scale),
                        block_kv=block_kv, interpret=interpret)
    rows = max(16, pl.next_power_of_2(G))  # query rows per kv head, padded for the dot units
    Hp = max(64, pl.next_power_of_2(H))
    Sp = -(-S // (num_splits * block_kv)) * num_splits * block_kv
    split = Sp // num_splits
    qg = _pad(_pad(q.reshape(B, K, G, H), 2, rows), 3, Hp)                     # [B, K, G', Hp]
    to_kernel = lambda x: _pad(_pad(x, 1, Sp), 3, Hp).transpose(0, 2, 1, 3)  # [B, K, Sp, Hp]
    lengths = jnp.asarray(kv_lengths, jnp.int32).reshape(B, 1, 1)
    q_spec = pl.BlockSpec((None, None, rows, Hp), lambda b, h, s: (b, h, 0, 0))
    kv_spec = pl.BlockSpec((None, None, split, Hp), lambda b, h, s: (b, h, s, 0))
    part = lambda width: pl.BlockSpec((None, None, None, rows, width), lambda b, h, s: (b, h, s, 0, 0))
    shape = lambda width: jax.ShapeDtypeStruct((B, K, num_splits, rows, width), jnp.float32)
    o, m, l = pl.pallas_call(
        functools.partial(_decode_kernel, cfg=cfg), grid=(B, K, num_splits),
        in_specs=[q_spec, kv_spec, kv_spec, pl.BlockSpec((None, 1, 1), lambda b, h, s: (b, 0, 0))],
        out_specs=(part(Hp), part(1), part(1)), out_shape=(shape(Hp), shape(1), shape(1)),
        compiler_params=_compiler_params(backend, interpret, 3), interpret=interpret, name="decode_attention",
    )(qg, to_kernel(k), to_kernel(v), lengths)
    return _combine(o, m, l)[:, :, :G, :H].reshape(B, N, H).astype(q.dtype)
