"""The reference backend: plain jnp, materialising the [B, N, T, S] logits.

Readable rather than fast; every other backend is tested against it, and it alone
implements explicit (KV-cache) positions and an additive bias. Its attention dropout mask is
`tfm.kernels.dropout`'s, as the flash kernels' is: the same rng drops the same probabilities.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tfm.kernels import dropout
from tfm.ops.masks import NEG_INF, scores, visibility


def attention(q, k, v, *, causal, q_seg, kv_seg, q_pos, kv_pos, window, slopes, softcap, scale,
              dropout_rate, dropout_rng, bias=None, sparsity=None, sinks=None):
    """q [B, T, N, H]; k, v [B, S, K, H] -> [B, T, N, H]. q_pos [B|1, T], kv_pos [B|1, S];
    bias [B|1, N, T, S] is added to the logits; sparsity (`tfm.kernels.sparsity`) is materialised [T, S];
    sinks [N]: each head's logit that joins the softmax's denominator with no value."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    s = scores(qg, k, scale, softcap, slopes, q_pos, kv_pos)  # [B, K, G, T, S]
    if bias is not None:
        s = s + bias.astype(jnp.float32).reshape(bias.shape[0], K, N // K, T, k.shape[1])
    visible = visibility(q_pos, kv_pos, q_seg, kv_seg, causal=causal, window=window,
                         sparsity=sparsity)[:, None, None]
    s = jnp.where(visible, s, NEG_INF)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1) * visible  # fully masked rows -> 0
    else:  # the sink as one more column of the softmax, dropped after it
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1), s.shape[:-1] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1] * visible
    if dropout_rate > 0.0:
        G = N // K
        heads = jnp.arange(N, dtype=jnp.int32).reshape(1, K, G, 1, 1)  # query head k * G + g
        batch = jnp.arange(B, dtype=jnp.int32).reshape(B, 1, 1, 1, 1)
        key = dropout.head_key(dropout.seed(dropout_rng), batch, heads)
        keep = dropout.keep(key, jnp.arange(T, dtype=jnp.int32)[:, None], jnp.arange(k.shape[1], dtype=jnp.int32),
                            dropout_rate)  # [B, K, G, T, S]
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    o = jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(v.dtype), v)
    return o.reshape(B, T, N, H)
