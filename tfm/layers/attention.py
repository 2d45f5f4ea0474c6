"""Multi-head attention (MHA / GQA / MQA, and DeepSeek's latent attention) with a fixed-shape KV cache
for decoding."""
from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init, scaled
from tfm.layers.inputs import BlockInputs
from tfm.layers.norms import Norm
from tfm.layers.slot import register_mixer
from tfm.layers.positions import apply_rope, relative_bias
from tfm.ops.attention import alibi_slopes, dot_product_attention
from tfm.ops.masks import NEG_INF, visibility
from tfm.ops.topk_attention import topk_attention

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
# Multi-head latent attention caches the kv latent [B, L, C] and the RoPE key [B, L, R] instead.
CACHE_LATENT_AXES = ("cache_batch", "cache_length", "latent")


class Attention(nn.Module):
    """Self- or cross-attention. x [B, T, D] (queries); memory [B, S, D] for cross-attention.
    With config.mla, self-attention is DeepSeek's multi-head latent attention (`_latent_qkv`), whose
    cache holds `cached_latent` and `cached_key_rope` [B, L, C] / [B, L, R] instead of keys and values.

    In decode mode self-attention keeps `cache/cached_{key,value}` [B, K, L, H] and
    `cache/cached_segment_ids` [B, L]; writing T new entries at `cache/index`. Cross-attention keeps the
    projected memory `cache/cached_{key,value}` [B, K, S, H] computed once when the cache is made.
    The first decode-mode call creates the cache (zeros, length = the T it was given) and
    leaves it empty: call the model once with a [B, max_len] dummy to size it. A causal layer with a window w
    (config.layer_window) keeps only min(w, L) positions, a ring written at index mod w: a step attends to the ring
    as it was before the step beside the step's own keys (masked by position), then overwrites the oldest slots.
    Cached arrays are boxed with the logical names CACHE_KV_AXES / CACHE_SEGMENT_AXES (cross-attention:
    MEMORY_KV_AXES / MEMORY_SEGMENT_AXES).

    qk_norm: config.norm over each head of the queries and keys (`query_norm`, `key_norm` [H]) before
    attending (Mllama's cross-attention layers; config.qk_norm: every layer, Qwen3; over all heads together,
    [N * H] / [K * H], with config.qk_norm_scope="heads"); cached keys are the normed ones. With
    config.attention_sinks self-attention has `sinks` [N], one logit per query head in its softmax's denominator.

    config.attention_sparsity patterns self-attention (tfm.kernels.sparsity); with config.global_projections the
    Longformer global rows are recomputed through their own projections (`_global_rows`).
    """

    config: ModelConfig
    causal: bool = False
    cross: bool = False
    layer_index: int = 0  # the layer's place in the stack: its kind under config.attention_pattern
    qk_norm: bool = False
    out_features: Optional[int] = None  # the output's width; None = config.d_model (Zamba's shared block: D from 2D)

    @nn.compact
    def __call__(self, x, memory=None, *, q_segment_ids=None, kv_segment_ids=None, positions=None,
                 kv_positions=None, relative_table=None, kv_mask=None, deterministic: bool = True,
                 decode: bool = False):
        """positions [B, T] are the query positions (RoPE, causal, window, ALiBi, relative bias).
        relative_table [buckets, N]: the stack's shared T5 relative position bias (self-attention).
        kv_mask [B, T, M] bool, M dividing S: whether each query sees each of M equal runs of keys (the
        image tiles of Mllama's cross-attention, which no segment ids describe; attends with impl "xla")."""
        cfg = self.config
        N, H = cfg.num_heads, cfg.head_dim
        Hv = H if cfg.mla is None else cfg.mla.value_dim
        index = ()  # the indexer's inputs (DeepSeek Sparse Attention)
        if self.cross:
            q, k, v, kv_segment_ids = self._cross_qkv(x, memory, kv_segment_ids, decode)
            kv_positions = None
        else:
            span = cfg.layer_span(self.layer_index)
            if span is not None:
                q_segment_ids = kv_segment_ids = span_segments(q_segment_ids, positions, x.shape[:2], span, cfg.max_len)
            qkv = self._self_qkv if cfg.mla is None else self._latent_qkv
            q, k, v, kv_segment_ids, kv_positions, *index = qkv(x, positions, q_segment_ids, kv_segment_ids, decode)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        if Hv != H:  # one head size through the kernels: zero dims change no logit and no output
            width = max(H, Hv)
            q, k, v = (jnp.pad(a, [(0, 0)] * 3 + [(0, width - a.shape[-1])]) for a in (q, k, v))
        use_positions = decode and not self.cross
        bias = None
        if relative_table is not None and not self.cross:
            q_pos = jnp.arange(x.shape[1])[None] if positions is None else positions
            bias = relative_bias(relative_table, q_pos, q_pos if kv_positions is None else kv_positions, cfg,
                                 bidirectional=not self.causal)
        scale = (H ** -0.5 if cfg.attention_scale is None else cfg.attention_scale) if cfg.scale_attention else 1.0
        if cfg.mla is not None:
            scale *= cfg.mla.softmax_scale_factor
        top = None
        if index:  # DeepSeek Sparse Attention: each query's top_k keys by the indexer's scores
            chosen, scores, top = self._top_keys(*index, positions if use_positions else None,
                                                 kv_positions if use_positions else None, q_segment_ids, kv_segment_ids)
            if not decode and self.is_mutable_collection("losses"):
                self._sow_index_loss(q, k, scale, chosen, scores)
            plain = (bias is None and kv_mask is None and not cfg.attn_logit_softcap and not cfg.attention_sinks
                     and cfg.position != "alibi")  # what the gather path computes; else the masked dense form
            if top is not None and plain and not use_positions and cfg.execution.attention_impl == "chunked":
                if not deterministic and cfg.attention_dropout:
                    raise ValueError("attention_impl='chunked' gathers each query's top-k keys and has no attention "
                                     "dropout; set attention_dropout=0 or attention_impl='xla'")
                o = topk_attention(q, k, v, top, jnp.take_along_axis(chosen, top, axis=-1), scale=scale,
                                   chunk_size=cfg.execution.attention_chunk_size)
                return self._output(x, o, N, Hv)
            bias = jnp.broadcast_to(jnp.where(chosen, 0.0, NEG_INF)[:, None], (x.shape[0], N) + chosen.shape[1:])
        if kv_mask is not None:
            (B, T, M), S = kv_mask.shape, k.shape[1]
            if S % M:
                raise ValueError(f"kv_mask has {M} entries per query, which does not divide the {S} keys")
            seen = jnp.repeat(kv_mask.astype(bool), S // M, axis=-1)  # [B, T, S]
            bias = jnp.broadcast_to(jnp.where(seen, 0.0, NEG_INF)[:, None], (B, cfg.num_heads, T, S))
        dropout = 0.0 if deterministic else cfg.attention_dropout
        sinks = None
        if cfg.attention_sinks and not self.cross:
            sinks = self.param("sinks", param_init(nn.initializers.zeros_init(), ("heads",)), (N,), jnp.float32)
        o = dot_product_attention(
            q, k, v, causal=self.causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            q_positions=positions if use_positions else None,
            kv_positions=kv_positions if use_positions else None,
            window=None if self.cross else cfg.layer_window(self.layer_index),
            alibi_slopes=(alibi_slopes(cfg.num_heads, cfg.alibi_bias_max)
                          if cfg.position == "alibi" and not self.cross else None),
            softcap=cfg.attn_logit_softcap, sparsity=None if self.cross else cfg.attention_sparsity, bias=bias,
            sinks=sinks,
            scale=scale, dropout_rate=dropout,
            dropout_rng=self.make_rng("dropout") if dropout > 0 else None,
            impl="xla" if use_positions or kv_mask is not None or index else cfg.execution.attention_impl,
            chunk_size=cfg.execution.attention_chunk_size, block_sizes=cfg.execution.attention_block_sizes,
            context_strategy=cfg.execution.context_strategy)
        if cfg.global_projections and not self.cross:
            o = self._global_rows(x, o, q_segment_ids, kv_segment_ids, scale, dropout)
        return self._output(x, o, N, Hv)

    def _output(self, x, o, N: int, Hv: int):
        """The heads' outputs o [B, T, N, >= Hv] (their first Hv dims), gated where config.attention_output_gate,
        through `out`: [B, T, D] (out_features wide)."""
        cfg = self.config
        out_bias = cfg.attention_bias if cfg.attention_out_bias is None else cfg.attention_out_bias
        out = Einsum("BTNH,NHD->BTD", (N, Hv, self.out_features or cfg.d_model), ("heads", "head_dim", "embed"),
                     ("embed",), name="out", use_bias=out_bias, dtype=compute_dtype(cfg))
        o = o[..., :Hv]
        if cfg.attention_output_gate:  # Qwen3-Next: each head's output times sigmoid(gate(x)) [B, T, N, Hv]
            gate = self._projection("BTD,DNH->BTNH", (cfg.d_model, N, Hv), ("embed", "heads", "head_dim"), "gate")(x)
            o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
        return out(o)  # [B, T, D]

    def _global_rows(self, x, o, q_segment_ids, kv_segment_ids, scale, dropout):
        """Longformer's global rows (HF LongformerSelfAttention): o [B, T, N, H] with the rows of the first
        `globals` tokens replaced by their attention to every key through `query_global`, `key_global` and
        `value_global` ([B, g, N, H] queries: O(g S) logits)."""
        cfg = self.config
        g = min(cfg.attention_sparsity.globals, x.shape[1])
        q = self._heads("query_global", cfg.num_heads)(x[:, :g])  # [B, g, N, H]
        if not g:  # no global token: the projections exist (a checkpoint holds them) and nothing changes
            self._heads("key_global", cfg.num_kv_heads)(x[:, :0]), self._heads("value_global", cfg.num_kv_heads)(x[:, :0])
            return o
        k, v = self._heads("key_global", cfg.num_kv_heads)(x), self._heads("value_global", cfg.num_kv_heads)(x)
        o_global = dot_product_attention(
            q, k, v, q_segment_ids=None if q_segment_ids is None else q_segment_ids[:, :g],
            kv_segment_ids=kv_segment_ids, scale=scale, dropout_rate=dropout,
            dropout_rng=self.make_rng("dropout") if dropout > 0 else None, impl=cfg.execution.attention_impl,
            block_sizes=cfg.execution.attention_block_sizes, context_strategy=cfg.execution.context_strategy)
        return o.at[:, :g].set(o_global.astype(o.dtype))

    def _projection(self, spec: str, shape, axes, name: str, use_bias=None):
        """An Einsum with the layer's dtype; bias on its output dims when use_bias (default attention_bias)."""
        cfg = self.config
        use_bias = cfg.attention_bias if use_bias is None else use_bias
        out_dims = len(spec.split("->")[1]) - 2  # the output letters past B and T/S
        return Einsum(spec, shape, axes, axes[-out_dims:], use_bias=use_bias, dtype=compute_dtype(cfg), name=name)

    def _heads(self, name: str, heads: int, use_bias=None):
        """The projection [B, L, D] -> [B, L, heads, H] named `name`; with qk_norm, queries and keys are
        normalised per head (`query_norm`, `key_norm`) before any position is applied (unless
        config.qk_norm_position="after_rope": `_self_qkv` normalises them after RoPE)."""
        cfg = self.config
        head_axis = "heads" if heads == cfg.num_heads and name in ("query", "query_global") else "kv_heads"
        project = self._projection("BSD,DKH->BSKH", (cfg.d_model, heads, cfg.head_dim),
                                   ("embed", head_axis, "head_dim"), name, use_bias)
        if not ((self.qk_norm or cfg.qk_norm) and name in ("query", "key")) or self._norms_after_rope():
            return project
        norm = Norm(cfg, "head_dim", name=f"{name}_norm")
        if cfg.qk_norm_scope == "heads" and not self.qk_norm:  # over all of a token's heads: [B, L, heads * H]
            return lambda h: (lambda y: norm(y.reshape(y.shape[:2] + (-1,))).reshape(y.shape))(project(h))
        return lambda h: norm(project(h))

    def _norms_after_rope(self) -> bool:
        """Whether config.qk_norm normalises each query and key head after RoPE (HunYuan)."""
        cfg = self.config
        return cfg.qk_norm and cfg.qk_norm_position == "after_rope" and not self.cross and cfg.mla is None

    def _self_qkv(self, x, positions, segment_ids, kv_segment_ids, decode):
        """q [B, T, N, H]; k, v [B, S, K, H] (S = the cache length when decoding), their segment ids and positions."""
        cfg = self.config
        q = self._heads("query", cfg.num_heads)(x)
        k, v = scaled(self._heads("key", cfg.num_kv_heads)(x), cfg.key_multiplier), self._value(x)  # [B, T, K, H]
        rope = cfg.layer_rope(self.layer_index) if not self.cross else None
        if rope is not None:
            layer_cfg = cfg if rope is cfg.rope else cfg.replace(rope=rope)
            q, k = apply_rope(q, positions, layer_cfg), apply_rope(k, positions, layer_cfg)
        if self._norms_after_rope():
            q, k = Norm(cfg, "head_dim", name="query_norm")(q), Norm(cfg, "head_dim", name="key_norm")(k)
        if rope is not None and cfg.rope_qk_rms_norm:
            q, k = _rms(q, cfg.norm_eps), _rms(k, cfg.norm_eps)
        if rope is None and cfg.nope_temperature:  # Llama 4's temperature on layers without positions
            pos = (jnp.arange(x.shape[1])[None] if positions is None else positions).astype(jnp.float32)
            t = 1.0 + cfg.nope_temperature * jnp.log1p(jnp.floor((pos + 1.0) / cfg.nope_temperature_floor))
            q = (q.astype(jnp.float32) * t[..., None, None]).astype(q.dtype)
        if cfg.linformer_length is not None:
            if self.causal or decode:
                raise ValueError("ModelConfig.linformer_length projects keys along the whole length, which has no "
                                 "causal or cached form; use it in encoders")
            k, v, kv_segment_ids = self._project_length(k, v, kv_segment_ids)
            return q, k, v, kv_segment_ids, None
        if not decode:
            return q, k, v, kv_segment_ids, positions
        (k, v), segment_ids, positions = self._write_cache(
            {"cached_key": (_swap_length_heads(k), CACHE_KV_AXES),
             "cached_value": (_swap_length_heads(v), CACHE_KV_AXES)}, segment_ids,
            ring=cfg.layer_window(self.layer_index) if self.causal else None)
        return q, _swap_length_heads(k), _swap_length_heads(v), segment_ids, positions

    def _value(self, x):
        """Values [B, S, K, H]: one projection, or through rank config.value_rank (W_V = W_V_down W_V_up)."""
        cfg = self.config
        if cfg.value_rank is None:
            return self._heads("value", cfg.num_kv_heads)(x)
        r = self._projection("BSD,DR->BSR", (cfg.d_model, cfg.value_rank), ("embed", "rank"), "value_down",
                             use_bias=False)(x)
        return self._projection("BSR,RKH->BSKH", (cfg.value_rank, cfg.num_kv_heads, cfg.head_dim),
                                ("rank", "kv_heads", "head_dim"), "value_up")(r)

    def _project_length(self, k, v, kv_segment_ids):
        """Linformer (Wang et al. 2020): k, v [B, S, K, H] -> [B, P, K, H] through the first S rows of one
        learned [max_len, P] matrix shared by keys and values. Padding keys (segment id 0) are zeroed
        first, so padding changes nothing; packed sequences (ids > 1) would mix and are not supported."""
        cfg = self.config
        S, P = k.shape[1], cfg.linformer_length
        if S > cfg.max_len:
            raise ValueError(f"Linformer's length projection has max_len={cfg.max_len} rows; got {S} keys")
        init = nn.initializers.normal(stddev=cfg.max_len ** -0.5)
        E = self.param("length_projection", param_init(init, (None, None)), (cfg.max_len, P), jnp.float32)
        E = E[:S].astype(k.dtype)  # [S, P]
        if kv_segment_ids is not None:
            keep = (kv_segment_ids > 0)[:, :, None, None].astype(k.dtype)
            k, v = k * keep, v * keep
            kv_segment_ids = jnp.ones((k.shape[0], P), jnp.int32)  # every projected key is visible
        k, v = (jnp.einsum("BSKH,SP->BPKH", a, E) for a in (k, v))
        return k, v, kv_segment_ids

    def _latent_qkv(self, x, positions, segment_ids, kv_segment_ids, decode):
        """Multi-head latent attention (DeepSeek-V2 section 2.1): q, k [B, S, N, H] (the first
        rope_dim of a head rotated, the key's shared by every head), v [B, S, N, Hv], all projected
        from x through the normed latents; decoding caches only the kv latent [B, L, C] and the
        rotated RoPE key [B, L, R]."""
        cfg, mla = self.config, self.config.mla
        D, N, H, R, C = cfg.d_model, cfg.num_heads, cfg.head_dim, mla.rope_dim, mla.kv_rank
        latent_cfg = cfg if mla.latent_norm_eps in (None, cfg.norm_eps) else cfg.replace(norm_eps=mla.latent_norm_eps)
        if mla.q_rank is None:
            q = self._heads("query", N, use_bias=False)(x)
        else:
            cq = self._projection("BTD,DQ->BTQ", (D, mla.q_rank), ("embed", "latent"), "q_down")(x)
            cq = Norm(latent_cfg, axis="latent", name="q_norm")(cq)
            q = self._projection("BTQ,QNH->BTNH", (mla.q_rank, N, H), ("latent", "heads", "head_dim"), "q_up",
                                 use_bias=False)(cq)
        c = Norm(latent_cfg, axis="latent", name="kv_norm")(
            self._projection("BSD,DC->BSC", (D, C), ("embed", "latent"), "kv_down")(x))  # [B, S, C]
        k_rope = self._projection("BSD,DR->BSR", (D, R), ("embed", "head_dim"), "key_rope")(x)
        if cfg.layer_rope(self.layer_index) is not None:  # else the RoPE part passes unrotated (Kimi Linear)
            q = apply_rope(q, positions, cfg)  # rope.dim = R: the first R dims of each head rotate
            k_rope = apply_rope(k_rope[:, :, None], positions, cfg)[:, :, 0]  # [B, S, R]
        entries = {"cached_latent": (c, CACHE_LATENT_AXES), "cached_key_rope": (k_rope, CACHE_LATENT_AXES)}
        if cfg.indexer is not None:
            # the indexer's input detached (DeepSeek-V3.2): it learns from its own loss only (`_sow_index_loss`)
            index_q, index_k = self._index_heads(jax.lax.stop_gradient(x), jax.lax.stop_gradient(cq), positions)
            entries["cached_index_key"] = (index_k, CACHE_LATENT_AXES)
        if decode:
            cached, kv_segment_ids, positions = self._write_cache(entries, segment_ids)
            c, k_rope = cached[:2]
            if cfg.indexer is not None:
                index_k = cached[2]
        k_pass = self._projection("BSC,CNH->BSNH", (C, N, H - R), ("latent", "kv_heads", "head_dim"), "key_up",
                                  use_bias=False)(c)
        v = self._projection("BSC,CNH->BSNH", (C, N, mla.value_dim), ("latent", "kv_heads", "head_dim"),
                             "value_up", use_bias=False)(c)
        k_rope = jnp.broadcast_to(k_rope[:, :, None].astype(k_pass.dtype), k_pass.shape[:3] + (R,))
        out = (q, jnp.concatenate([k_rope, k_pass], axis=-1), v, kv_segment_ids, positions)
        return out + ((jax.lax.stop_gradient(x), index_q, index_k) if cfg.indexer is not None else ())

    def _index_heads(self, x, cq, positions):
        """The lightning indexer's queries [B, T, heads, head_dim] (from the query latent cq [B, T, Q]) and keys
        [B, T, head_dim] (LayerNorm of a projection of x), the first mla.rope_dim dims of each rotated with
        halves together (DeepSeek-V3.2's indexer, beside its attention's interleaved pairs)."""
        cfg, ind = self.config, self.config.indexer
        q = self._projection("BTQ,QNH->BTNH", (cfg.mla.q_rank, ind.heads, ind.head_dim), ("latent", "heads", None),
                             "indexer_query", use_bias=False)(cq)
        k = self._projection("BSD,DH->BSH", (cfg.d_model, ind.head_dim), ("embed", None), "indexer_key",
                             use_bias=False)(x)
        norm_cfg = cfg.replace(norm="layernorm", norm_bias=True, norm_eps=ind.norm_eps, norm_scale_offset=0.0)
        k = Norm(norm_cfg, axis=None, name="indexer_key_norm")(k)
        if cfg.layer_rope(self.layer_index) is not None:
            halves = cfg.replace(rope=dict(interleaved=False))
            q, k = apply_rope(q, positions, halves), apply_rope(k[:, :, None], positions, halves)[:, :, 0]
        return q, k

    def _top_keys(self, x, index_q, index_k, q_pos, kv_pos, q_segment_ids, kv_segment_ids):
        """(chosen [B, T, S] bool: the indexer.top_k visible keys of highest score for each query, ties to the
        earlier key; the scores [B, T, S] fp32, sum_h w_h relu(q_h . k / sqrt(head_dim)), w = `indexer_weights` x /
        sqrt(heads); top [B, T, top_k] their indices, None where top_k covers every key). The scores' gradient reaches the indexer's parameters only (its inputs are detached). q_pos,
        kv_pos: the cache's positions when decoding, else None (the order of the tokens)."""
        cfg, ind = self.config, self.config.indexer
        T, S = index_q.shape[1], index_k.shape[1]
        w = self._projection("BTD,DN->BTN", (cfg.d_model, ind.heads), ("embed", "heads"), "indexer_weights",
                             use_bias=False)(x).astype(jnp.float32) * ind.heads ** -0.5
        logits = jnp.einsum("btnh,bsh->btns", index_q.astype(jnp.float32), index_k.astype(jnp.float32))
        scores = jnp.einsum("btn,btns->bts", w, jax.nn.relu(logits * ind.head_dim ** -0.5))
        visible = visibility(jnp.arange(T)[None] if q_pos is None else q_pos,
                             jnp.arange(S)[None] if kv_pos is None else kv_pos, q_segment_ids, kv_segment_ids,
                             causal=self.causal, window=None)
        if ind.top_k >= S:
            return visible, scores, None
        _, top = jax.lax.top_k(jnp.where(visible, jax.lax.stop_gradient(scores), -jnp.inf), ind.top_k)  # [B, T, top_k]
        B = top.shape[0]
        chosen = jnp.zeros((B, T, S), bool).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], top].set(True)
        return chosen & visible, scores, top

    def _sow_index_loss(self, q, k, scale, chosen, scores):
        """Sows `losses/indexer_kl_loss`: DeepSeek-V3.2's indexer loss, sum over queries t of KL(p_t || softmax(I_t)),
        over each query's chosen keys (all visible keys while top_k covers them: the dense warm-up), p_t the main
        attention's probabilities summed over heads and L1-normalised (no gradient), I the index scores; here the
        mean over the queries that see a key (so it does not grow with the batch). q [B, T, N, H], k [B, S, N, H]."""
        logits = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
        probs = jax.nn.softmax(jnp.where(chosen[:, None], logits, NEG_INF), axis=-1).sum(1)  # [B, T, S]
        seen = chosen.any(-1)  # [B, T]
        p = jax.lax.stop_gradient(probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-30))
        log_q = jax.nn.log_softmax(jnp.where(chosen, scores, NEG_INF), axis=-1)  # finite: no NaN in any gradient
        terms = jnp.where(chosen & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0)
        kl = jnp.where(seen, terms.sum(-1), 0.0).sum() / jnp.maximum(seen.sum(), 1)
        self.sow("losses", "indexer_kl_loss", kl)

    def _cross_qkv(self, x, memory, memory_segment_ids, decode):
        """q [B, T, N, H]; the projected memory k, v [B, S, K, H], cached once in decode mode."""
        cfg = self.config
        if cfg.mla is not None:
            raise ValueError("ModelConfig.mla is self-attention only; an encoder-decoder cannot use it")
        q = self._heads("query", cfg.num_heads)(x)
        key, value = self._heads("key", cfg.num_kv_heads), self._heads("value", cfg.num_kv_heads)
        if not decode:
            return q, key(memory), value(memory), memory_segment_ids
        if memory_segment_ids is None and memory is not None:
            memory_segment_ids = jnp.ones(memory.shape[:2], jnp.int32)
        k = self._cache("cached_key", MEMORY_KV_AXES, lambda: _swap_length_heads(key(memory)))
        v = self._cache("cached_value", MEMORY_KV_AXES, lambda: _swap_length_heads(value(memory)))
        seg = self._cache("cached_segment_ids", MEMORY_SEGMENT_AXES, lambda: memory_segment_ids)
        return q, _swap_length_heads(k.value), _swap_length_heads(v.value), seg.value

    def _write_cache(self, entries, segment_ids, ring=None):
        """Writes each new entry (name -> (array in its cache layout with T new positions, its
        logical axes, "cache_length" among them)) at the cache index. Returns the whole cached
        arrays in the order given, the cache's segment ids [B, L] and positions [1, L]. ring: a window w
        (keys further back than w - 1 positions are never read): the cache keeps min(w, L) slots, and what
        is returned is the slots before this write followed by the T new entries (`_ring_write`)."""
        creating = not self.has_variable("cache", "index")
        first, axes = next(iter(entries.values()))
        B, T = first.shape[0], first.shape[axes.index("cache_length")]
        slots = T if ring is None else min(ring, T)  # T: the cache length while the cache is made

        def empty(a, axes):
            at = axes.index("cache_length")
            return jnp.zeros(a.shape[:at] + (slots,) + a.shape[at + 1:], a.dtype)

        cached = {name: self._cache(name, axes, lambda a=a, axes=axes: empty(a, axes))
                  for name, (a, axes) in entries.items()}
        cseg = self._cache("cached_segment_ids", CACHE_SEGMENT_AXES, lambda: jnp.zeros((B, slots), jnp.int32))
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        if creating:
            return [cached[name].value for name in entries], cseg.value, jnp.arange(slots)[None]
        i = index.value
        ids = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        index.value = i + T
        if ring is not None:
            return self._ring_write(entries, cached, cseg, ids, i)
        for name, (a, axes) in entries.items():
            start = tuple(i if axis == "cache_length" else 0 for axis in axes)
            cached[name].value = jax.lax.dynamic_update_slice(cached[name].value,
                                                              a.astype(cached[name].value.dtype), start)
        cseg.value = jax.lax.dynamic_update_slice(cseg.value, ids, (0, i))
        return [cached[name].value for name in entries], cseg.value, jnp.arange(cseg.value.shape[1])[None]

    @staticmethod
    def _ring_write(entries, cached, cseg, ids, i):
        """The ring's slots (W of them; slot j holds the latest position p < i with p = j mod W) followed by the T
        new entries at positions i .. i + T - 1, with their segment ids [B, W + T] and positions [1, W + T]; then
        the last min(W, T) new entries overwrite their slots."""
        W, T = cseg.value.shape[1], ids.shape[1]
        positions = jnp.concatenate([i - 1 - (i - 1 - jnp.arange(W)) % W, i + jnp.arange(T)])[None]
        first = T - min(W, T)  # the first new entry that stays
        written = (i + jnp.arange(first, T)) % W  # the slots it and the later ones overwrite
        read = []
        for name, (a, axes) in entries.items():
            length = axes.index("cache_length")
            old = cached[name].value
            read.append(jnp.concatenate([old, a.astype(old.dtype)], axis=length))
            kept = jax.lax.slice_in_dim(a, first, T, axis=length).astype(old.dtype)
            cached[name].value = old.at[(slice(None),) * length + (written,)].set(kept)
        segments = jnp.concatenate([cseg.value, ids], axis=1)
        cseg.value = cseg.value.at[:, written].set(ids[:, first:])
        return read, segments, positions

    def _cache(self, name: str, axes, make):
        """The cache variable `name`, created by make() and boxed with logical `axes`; reading
        its value constrains it to the sharding the active rules give those names."""
        return self.variable("cache", name, param_init(lambda: constrain(make(), axes), axes))


def _rms(x, eps: float):
    """x [..., H] divided by its root mean square over H, in float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


def span_segments(segment_ids, positions, shape, span: int, max_len: int):
    """Segment ids [B, T] refined so that a token sees only its own aligned span of positions (p // span): a span
    layer's mask is then the segment mask every backend and the decode cache already apply. Padding (0) stays 0."""
    B, T = shape
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T)[None] if positions is None else positions, (B, T)).astype(jnp.int32)
    spans = -(-max_len // span) + 1  # distinct spans a sequence can have, and one to spare
    return jnp.where(seg > 0, seg * spans + pos // span + 1, 0)


def _swap_length_heads(x):
    """[B, L, K, H] <-> [B, K, L, H]; XLA folds it into the attention products that read the cache."""
    return x.transpose(0, 2, 1, 3)


class SelfAttention(Attention):
    """Self-attention in the Block's mixer slot (kind "attention", params `self_attn`): x [B, T, D] ->
    [B, T, D], reading the segment ids, positions, T5's relative table and the self mask from `inputs`."""

    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        seg = inputs.segment_ids
        return Attention.__call__(self, x, q_segment_ids=seg, kv_segment_ids=seg, positions=inputs.positions,
                                  relative_table=inputs.relative_table, kv_mask=inputs.self_mask,
                                  deterministic=deterministic, decode=decode)


register_mixer("attention", SelfAttention, name="self_attn", norm="attn", bidirectional=True)
