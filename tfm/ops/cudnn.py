"""cuDNN fused attention through `jax.nn.dot_product_attention(implementation="cudnn")`.

GPU only, fp16/bf16. q [B, T, N, H]; k, v [B, S, K, H] (GQA native). Segment ids and ALiBi
become a materialised mask [B, 1, T, S] and bias [1, N, T, S]; cuDNN has no logit soft-cap
and no bidirectional window, and those raise ValueError. Under a mesh the call runs per
device, like the pallas backend (`tfm.ops.shard.per_device`: batch and heads split, T and
S whole). cuDNN's backward takes only even T and S: an odd length is padded by one zero
query row (sliced off) or one key hidden from every query (segment id 0, or
`key_value_seq_lengths`), so any length trains.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from tfm.ops.masks import visibility
from tfm.ops.shard import per_device
from tfm.parallel.mesh import current_platform


def attention(q, k, v, *, causal: bool, q_segment_ids=None, kv_segment_ids=None,
              window: Optional[int] = None, alibi_slopes=None, softcap: Optional[float] = None,
              scale: float):
    """softmax(q k^T * scale + masks) v with cuDNN. q [B, T, N, H]; k, v [B, S, K, H] -> [B, T, N, H]."""
    if softcap is not None:
        raise ValueError("impl='cudnn' has no logit soft-cap; use impl='pallas'")
    if window is not None and not causal:
        raise ValueError("impl='cudnn' supports a sliding window only with causal=True; use impl='pallas'")
    if current_platform() != "gpu":
        raise ValueError(f"impl='cudnn' needs GPU devices, not {current_platform()!r}")
    kernel = functools.partial(_cudnn, causal=causal, window=window, scale=scale)
    return per_device(kernel, q, k, v, q_segment_ids, kv_segment_ids, alibi_slopes)


def _cudnn(q, k, v, q_segment_ids, kv_segment_ids, alibi_slopes, *, causal, window, scale):
    """One device's call: q [B, T, N, H]; k, v [B, S, K, H]; alibi_slopes [N] -> [B, T, N, H]."""
    B, T, N, _ = q.shape
    S = k.shape[1]
    q, k, v = _even(q), _even(k), _even(v)
    Tp, Sp = q.shape[1], k.shape[1]
    mask = bias = kv_lengths = None
    if kv_segment_ids is not None:  # the padded key gets segment 0, which no query sees
        positions = jnp.arange(Tp)[None], jnp.arange(Sp)[None]
        mask = visibility(*positions, _even(q_segment_ids), _even(kv_segment_ids), causal=False, window=None)
    elif Sp != S:
        kv_lengths = jnp.full((B,), S, jnp.int32)
    if alibi_slopes is not None:
        distance = jnp.abs(jnp.arange(Tp)[:, None] - jnp.arange(Sp)[None, :]).astype(jnp.float32)
        bias = (-alibi_slopes[:, None, None] * distance)[None].astype(q.dtype)  # [1, N, Tp, Sp]
    o = jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=None if mask is None else mask[:, None], scale=scale, is_causal=causal,
        key_value_seq_lengths=kv_lengths,
        local_window_size=None if window is None else (window - 1, 0), implementation="cudnn")
    if mask is not None:  # rows that see no key give 0, as in every other impl
        o = o * mask.any(axis=-1)[:, :, None, None].astype(o.dtype)
    return o[:, :T]


def _even(x):
    """x [B, L, ...] (or None) padded with zeros to an even L."""
    if x is None or x.shape[1] % 2 == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 2))
