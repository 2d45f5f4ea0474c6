"""Attention over each query's chosen keys only (DeepSeek Sparse Attention's top-k, attention_impl="chunked"):
the keys and values are gathered per query, a chunk of queries at a time, so no [N, T, S] logits are formed;
equal to dense attention masked to the same keys (tests/test_sparse_indexer.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from tfm.ops.masks import NEG_INF


def topk_attention(q, k, v, top, valid, *, scale: float, chunk_size: int):
    """q [B, T, N, H]; k, v [B, S, N, H] (a key head per query head, as latent attention's); top [B, T, J] int, each
    query's chosen key indices; valid [B, T, J] bool, which of them are visible keys. -> [B, T, N, H] in q's dtype:
    softmax over a query's valid chosen keys of scale q.k, times their values (fp32); a row with none gives 0.
    Queries go chunk_size at a time: a chunk gathers [B, chunk, J, N, H] keys and values."""
    B, T, N, H = q.shape
    C = min(chunk_size, T)
    pad = -T % C
    chunks = lambda x: jnp.moveaxis(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(
        (B, (T + pad) // C, C) + x.shape[2:]), 1, 0)  # [n, B, C, ...]
    gather = jax.vmap(lambda x, idx: x[idx])  # [S, N, H], [C, J] -> [C, J, N, H], per batch row

    def one(args):
        q_c, top_c, valid_c = args
        k_c, v_c = gather(k, top_c).astype(jnp.float32), gather(v, top_c).astype(jnp.float32)
        logits = jnp.einsum("bcnh,bcjnh->bcnj", q_c.astype(jnp.float32), k_c) * scale
        probs = jax.nn.softmax(jnp.where(valid_c[:, :, None], logits, NEG_INF), axis=-1)
        probs = probs * valid_c.any(-1)[:, :, None, None]
        return jnp.einsum("bcnj,bcjnh->bcnh", probs, v_c).astype(q.dtype)

    o = jax.lax.map(one, (chunks(q), chunks(top), chunks(valid)))  # [n, B, C, N, H]
    return jnp.moveaxis(o, 0, 1).reshape(B, T + pad, N, H)[:, :T]
