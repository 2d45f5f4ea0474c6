"""Multi-head attention (MHA / GQA / MQA) with a fixed-shape KV cache for decoding."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init
from tfm.layers.norms import Norm
from tfm.layers.positions import apply_rope, relative_bias
from tfm.ops.attention import alibi_slopes, dot_product_attention
from tfm.ops.masks import NEG_INF

# Logical names of the cache variables: the rules shard them like activations (batch over the
# batch axes, kv heads over tensor when it divides them, the cache length whole), and beam
# search finds the batch (beam) axis of every cached array by the name "cache_batch".
# Keys/values are stored heads-major, [B, K, L, H]: a decoding step's two attention products
# then read the cache as it lies, where [B, L, K, H] made XLA transpose the whole cache on every
# step (on CPU ~5x the cost of the attention itself; benchmarks/decode.py).
CACHE_KV_AXES = ("cache_batch", "cache_kv_heads", "cache_length", "head_dim")  # [B, K, L, H]
CACHE_SEGMENT_AXES = ("cache_batch", "cache_length")  # [B, L]
# Cross-attention's projected memory: its batch has its own name because beam search leaves it in
# place (the W beams of an example attend to the same source, so reordering them changes nothing).
MEMORY_KV_AXES = ("cache_memory_batch",) + CACHE_KV_AXES[1:]  # [B, K, S, H]
MEMORY_SEGMENT_AXES = ("cache_memory_batch", "cache_length")  # [B, S]


class Attention(nn.Module):
    """Self- or cross-attention. x [B, T, D] (queries); memory [B, S, D] for cross-attention.

    In decode mode self-attention keeps `cache/cached_{key,value}` [B, K, L, H] and
    `cache/cached_segment_ids` [B, L]; writing T new entries at `cache/index`. Cross-attention keeps the
    projected memory `cache/cached_{key,value}` [B, K, S, H] computed once when the cache is made.
    The first decode-mode call creates the cache (zeros, length = the T it was given) and
    leaves it empty: call the model once with a [B, max_len] dummy to size it.
    Cached arrays are boxed with the logical names CACHE_KV_AXES / CACHE_SEGMENT_AXES (cross-attention:
    MEMORY_KV_AXES / MEMORY_SEGMENT_AXES).

    qk_norm: config.norm over each head of the queries and keys (`query_norm`, `key_norm` [H]) before
    attending (Mllama's cross-attention layers); cached keys are the normed ones.
    """

    config: ModelConfig
    causal: bool = False
    cross: bool = False
    layer_index: int = 0  # the layer's place in the stack: its kind under config.attention_pattern
    qk_norm: bool = False

    @nn.compact
    def __call__(self, x, memory=None, *, q_segment_ids=None, kv_segment_ids=None, positions=None,
                 kv_positions=None, relative_table=None, kv_mask=None, deterministic: bool = True,
                 decode: bool = False):
        """positions [B, T] are the query positions (RoPE, causal, window, ALiBi, relative bias).
        relative_table [buckets, N]: the stack's shared T5 relative position bias (self-attention).
        kv_mask [B, T, M] bool, M dividing S: whether each query sees each of M equal runs of keys (the
        image tiles of Mllama's cross-attention, which no segment ids describe; attends with impl "xla")."""
        cfg = self.config
        D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        proj = dict(use_bias=cfg.attention_bias, dtype=compute_dtype(cfg))
        query = Einsum("BTD,DNH->BTNH", (D, N, H), ("embed", "heads", "head_dim"),
                            ("heads", "head_dim"), name="query", **proj)
        key = Einsum("BSD,DKH->BSKH", (D, K, H), ("embed", "kv_heads", "head_dim"),
                          ("kv_heads", "head_dim"), name="key", **proj)
        value = Einsum("BSD,DKH->BSKH", (D, K, H), ("embed", "kv_heads", "head_dim"),
                            ("kv_heads", "head_dim"), name="value", **proj)
        out_bias = cfg.attention_bias if cfg.attention_out_bias is None else cfg.attention_out_bias
        out = Einsum("BTNH,NHD->BTD", (N, H, D), ("heads", "head_dim", "embed"), ("embed",), name="out",
                     **{**proj, "use_bias": out_bias})
        if self.qk_norm:
            query_norm, key_norm = Norm(cfg, "head_dim", name="query_norm"), Norm(cfg, "head_dim", name="key_norm")
            query, key = (lambda h, f=query: query_norm(f(h))), (lambda h, f=key: key_norm(f(h)))
        q = constrain(query(x), ("batch", "length", "heads", "head_dim"))  # [B, T, N, H]
        if self.cross:
            k, v, kv_segment_ids = self._cross_kv(key, value, memory, kv_segment_ids, decode)
            kv_positions = None
        else:
            k, v = key(x), value(x)  # [B, T, K, H]
            if cfg.position == "rope":
                q, k = apply_rope(q, positions, cfg), apply_rope(k, positions, cfg)
            kv_positions = positions
            if decode:
                k, v, kv_segment_ids, kv_positions = self._update_cache(k, v, q_segment_ids)
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        use_positions = decode and not self.cross
        bias = None
        if relative_table is not None and not self.cross:
            q_pos = jnp.arange(x.shape[1])[None] if positions is None else positions
            bias = relative_bias(relative_table, q_pos, q_pos if kv_positions is None else kv_positions, cfg,
                                 bidirectional=not self.causal)
        if kv_mask is not None:
            (B, T, M), S = kv_mask.shape, k.shape[1]
            if S % M:
                raise ValueError(f"kv_mask has {M} entries per query, which does not divide the {S} keys")
            seen = jnp.repeat(kv_mask.astype(bool), S // M, axis=-1)  # [B, T, S]
            bias = jnp.broadcast_to(jnp.where(seen, 0.0, NEG_INF)[:, None], (B, cfg.num_heads, T, S))
        dropout = 0.0 if deterministic else cfg.attention_dropout
        o = dot_product_attention(
            q, k, v, causal=self.causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            q_positions=positions if use_positions else None,
            kv_positions=kv_positions if use_positions else None,
            window=None if self.cross else cfg.layer_window(self.layer_index),
            alibi_slopes=(alibi_slopes(cfg.num_heads, cfg.alibi_bias_max)
                          if cfg.position == "alibi" and not self.cross else None),
            softcap=cfg.attn_logit_softcap, bias=bias, scale=None if cfg.scale_attention else 1.0,
            dropout_rate=dropout,
            dropout_rng=self.make_rng("dropout") if dropout > 0 else None,
            impl="xla" if use_positions or kv_mask is not None else cfg.attention_impl,
            chunk_size=cfg.attention_chunk_size, block_sizes=cfg.attention_block_sizes)
        return out(o)  # [B, T, D]

    def _cross_kv(self, key, value, memory, memory_segment_ids, decode):
        """Projected memory k, v [B, S, K, H]; cached once in decode mode."""
        if not decode:
            return key(memory), value(memory), memory_segment_ids
        if memory_segment_ids is None and memory is not None:
            memory_segment_ids = jnp.ones(memory.shape[:2], jnp.int32)
        k = self._cache("cached_key", MEMORY_KV_AXES, lambda: _swap_length_heads(key(memory)))
        v = self._cache("cached_value", MEMORY_KV_AXES, lambda: _swap_length_heads(value(memory)))
        seg = self._cache("cached_segment_ids", MEMORY_SEGMENT_AXES, lambda: memory_segment_ids)
        return _swap_length_heads(k.value), _swap_length_heads(v.value), seg.value

    def _update_cache(self, k, v, segment_ids):
        """Writes k, v [B, T, K, H] at the cache index; returns the whole cache [B, L, K, H] and its masks."""
        B, T = k.shape[:2]
        k, v = _swap_length_heads(k), _swap_length_heads(v)  # [B, K, T, H], the cache's layout
        creating = not self.has_variable("cache", "cached_key")
        ck = self._cache("cached_key", CACHE_KV_AXES, lambda: jnp.zeros(k.shape, k.dtype))
        cv = self._cache("cached_value", CACHE_KV_AXES, lambda: jnp.zeros(v.shape, v.dtype))
        cseg = self._cache("cached_segment_ids", CACHE_SEGMENT_AXES, lambda: jnp.zeros((B, T), jnp.int32))
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        L = ck.value.shape[2]
        if not creating:
            if segment_ids is None:
                segment_ids = jnp.ones((B, T), jnp.int32)
            i = index.value
            ck.value = jax.lax.dynamic_update_slice(ck.value, k.astype(ck.value.dtype), (0, 0, i, 0))
            cv.value = jax.lax.dynamic_update_slice(cv.value, v.astype(cv.value.dtype), (0, 0, i, 0))
            cseg.value = jax.lax.dynamic_update_slice(cseg.value, segment_ids.astype(jnp.int32), (0, i))
            index.value = i + T
        return _swap_length_heads(ck.value), _swap_length_heads(cv.value), cseg.value, jnp.arange(L)[None]

    def _cache(self, name: str, axes, make):
        """The cache variable `name`, created by make() and boxed with logical `axes`; reading
        its value constrains it to the sharding the active rules give those names."""
        return self.variable("cache", name, param_init(lambda: constrain(make(), axes), axes))


def _swap_length_heads(x):
    """[B, L, K, H] <-> [B, K, L, H]; XLA folds it into the attention products that read the cache."""
    return x.transpose(0, 2, 1, 3)
