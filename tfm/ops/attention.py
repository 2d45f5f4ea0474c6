"""The one attention entry point: validates, then dispatches to a backend module.

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
  sinks           float [N]: one more logit per query head in the softmax's denominator, whose key has no
                  value (gpt-oss): each row's weights sum to 1 - its sink's share.
  bias            float [B|1, N, T, S] added to the logits (T5's relative position bias).
  sparsity        a `tfm.kernels.sparsity` pattern (Sparse Transformer strided/fixed, BigBird,
                  Longformer), ANDed with the rest: materialised by "xla", masked per chunk by
                  "chunked"; the kernels visit only the tiles it leaves non-empty. Not with
                  explicit positions (cached decoding).
A row with no visible key outputs 0 (never NaN). Which backend computes which of these is
declared once in `tfm.capabilities`; a call asking a backend for a feature it lacks is refused
in one line naming the backends that have it.

Backends: `xla` (the reference), `chunked`, `pallas` (with `hopper`, the Hopper driver, in the
same module) and `cudnn`; the kernels run per device under a mesh (`tfm.ops.shard`). Under a mesh whose rules split
"length" over `context`, attention is context-parallel (`tfm.ops.context`, by
`context_strategy`), each block computed by the Pallas kernels for impl "pallas" (and "auto"
where `select.choose_context_impl` says so), else by the chunked backend; it computes the
features `capabilities.CONTEXT` declares, for the impls declaring `context`. `masks` holds what
they share.
`alibi_slopes` and `visibility` are re-exported here for callers of the entry point.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from tfm.kernels.tiles import BlockSizes
from tfm import capabilities
from tfm.kernels import sparsity as sparsity_lib
from tfm.ops import chunked, context, cudnn, pallas, select, shard, xla
from tfm.ops.masks import alibi_slopes, check_attention_inputs, visibility

__all__ = ["alibi_slopes", "dot_product_attention", "visibility"]


@functools.partial(jax.named_call, name="attention")  # the scope names its ops in compiled HLO
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
    sparsity: Optional[sparsity_lib.Pattern] = None,
    bias: Optional[jax.Array] = None,
    sinks: Optional[jax.Array] = None,
    scale: Optional[float] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
    impl: str = "xla",
    chunk_size: int = 128,
    block_sizes: Optional[BlockSizes] = None,
    context_strategy: str = "ring",
) -> jax.Array:
    """Attention softmax(q k^T * scale + masks) v. q [B, T, N, H]; k, v [B, S, K, H] -> [B, T, N, H].

    impl: "xla" (reference), "chunked" (pure-JAX blockwise, O(L) memory), "pallas"
    (flash kernels), "hopper" (tfm's Hopper kernels, H100/H200 only), "cudnn" (jax.nn, GPU only),
    "auto" (fastest per backend).
    chunk_size is used by "chunked" (and context parallelism's chunked blocks) only, block_sizes
    (the kernel tiles, and on GPU their Triton launch parameters) by "pallas" only.
    context_strategy: "ring" or "all_gather", used when the sequence is split over the mesh's
    `context` axis (and no positions are given).
    """
    check_attention_inputs(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    if impl not in capabilities.ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose from {capabilities.ATTENTION_IMPLS}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if context_strategy not in capabilities.CONTEXT_STRATEGIES:
        raise ValueError(f"unknown context_strategy {context_strategy!r}; choose from {capabilities.CONTEXT_STRATEGIES}")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("attention dropout_rate > 0 needs a dropout_rng")
    B, T, N, H = q.shape
    S = k.shape[1]
    scale = H ** -0.5 if scale is None else scale
    sparsity = sparsity_lib.coerce(sparsity)
    positions_given = q_positions is not None or kv_positions is not None
    if sparsity is not None and positions_given:
        raise ValueError("sparse attention patterns are described over a whole sequence; explicit positions "
                         "(cached decoding) are not supported with them")
    call = dict(dropout_rate=dropout_rate, bias=bias is not None, positions_given=positions_given,
                sparse=sparsity is not None, softcap=softcap, window=window, causal=causal, sinks=sinks is not None)
    features = capabilities.call_features(**call)
    if not positions_given and shard.context_size() > 1:
        missing = capabilities.CONTEXT.missing(**features)
        if missing or (impl != "auto" and not capabilities.ATTENTION[impl].context):
            able = [name for name, s in capabilities.ATTENTION.items() if s.context] + ["auto"]
            raise ValueError(f"context-parallel attention (a mesh splitting 'length' over 'context') takes impl "
                             f"{'/'.join(able)} (got {impl!r}) and none of {missing or 'these features'}: it "
                             f"computes blocks with the chunked backend or the Pallas kernels")
        block_impl = select.choose_context_impl(q) if impl == "auto" else "pallas" if impl == "pallas" else "chunked"
        return context.attention(q, k, v, strategy=context_strategy, impl=block_impl, causal=causal,
                                 q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, window=window,
                                 alibi_slopes=alibi_slopes, softcap=softcap, scale=scale, chunk_size=chunk_size,
                                 block_sizes=block_sizes)
    if impl == "auto":
        impl = select.choose_impl(q, k, alibi=alibi_slopes is not None, segments=kv_segment_ids is not None, **call)
    missing = capabilities.ATTENTION[impl].missing(**features)
    if missing:
        able = {f: capabilities.supporting(**{f: True}) for f in missing}
        raise ValueError(f"attention impl {impl!r} does not implement " +
                         "; ".join(f"{f} (impl {' / '.join(map(repr, a))} does)" for f, a in able.items()))
    if sinks is not None and sinks.shape != (N,):
        raise ValueError(f"attention sinks must be [{N}] (one per query head); got {sinks.shape}")
    if bias is not None and (bias.ndim != 4 or bias.shape[1:] != (N, T, S) or bias.shape[0] not in (1, B)):
        raise ValueError(f"attention bias must be [{B} or 1, {N}, {T}, {S}]; got {bias.shape}")
    if impl in ("pallas", "hopper", "cudnn"):
        kernel_args = dict(causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                           window=window, alibi_slopes=alibi_slopes, softcap=softcap, scale=scale)
        if impl == "pallas":
            return pallas.attention(q, k, v, block_sizes=block_sizes, sparsity=sparsity, dropout_rate=dropout_rate,
                                    dropout_rng=dropout_rng, **kernel_args)
        if impl == "hopper":
            return pallas.attention(q, k, v, driver="hopper", dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                                    **kernel_args)
        return cudnn.attention(q, k, v, **kernel_args)
    q_pos = jnp.arange(T)[None] if q_positions is None else q_positions
    kv_pos = jnp.arange(S)[None] if kv_positions is None else kv_positions
    common = dict(causal=causal, q_seg=q_segment_ids, kv_seg=kv_segment_ids, q_pos=q_pos,
                  kv_pos=kv_pos, window=window, slopes=alibi_slopes, softcap=softcap, scale=scale)
    if impl == "xla":
        return xla.attention(q, k, v, bias=bias, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                             sparsity=sparsity, sinks=sinks, **common)
    return chunked.attention(q, k, v, chunk_size=chunk_size, sparsity=sparsity, **common)
