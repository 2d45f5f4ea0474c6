"""The chunked backend: blockwise online softmax over key chunks, pure JAX.

Its pieces also serve context parallelism (`tfm.ops.context`): `Blocks` is the per-block
computation of its all-gather and ring strategies (the Pallas kernels' is `tfm.ops.pallas.Blocks`).

O(T + S) memory in both passes (the backward recomputes each chunk's probabilities from the
saved log-sum-exp), and it runs on every backend: the fallback for long sequences on CPU.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from tfm.ops.masks import NEG_INF, scores, visibility
from tfm.kernels.sparsity import Pattern


class ChunkConfig(NamedTuple):
    """The static settings of the chunked passes (hashable: a custom_vjp nondiff argument)."""
    causal: bool
    window: Optional[int]
    softcap: Optional[float]
    scale: float
    sparsity: Optional[Pattern] = None
    lengths: Optional[tuple] = None  # (T, S) the sparsity pattern is laid over (the unpadded lengths)


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
    s = scores(qg, kc, cfg.scale, cfg.softcap, slopes, q_pos, kv_pos_c)
    visible = visibility(q_pos, kv_pos_c, q_seg, kv_seg_c, causal=cfg.causal, window=cfg.window,
                         sparsity=cfg.sparsity, lengths=cfg.lengths)[:, None, None]
    return jnp.where(visible, s, NEG_INF), visible


def init_carry(qg):
    """Empty online-softmax state (running max m, sum l, output acc) for qg [B, T, K, G, H]."""
    B, T, K, G, H = qg.shape
    return (jnp.full((B, K, G, T), NEG_INF, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, H), jnp.float32))


def accumulate(carry, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, cfg, chunk):
    """The online-softmax state `carry` (init_carry) updated with keys k, v [B, S, K, H] taken
    chunk keys at a time; kv_pos, kv_seg [B, S] (S a multiple of chunk)."""
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

    return jax.lax.scan(step, carry, xs)[0]


def finish(carry, dtype):
    """o [B, T, K, G, H] (dtype) and lse [B, K, G, T] (fp32, +inf on rows that saw no key)."""
    m, l, acc = carry
    safe_l = jnp.where(l == 0.0, 1.0, l)
    o = acc / safe_l[..., None]
    lse = jnp.where(l == 0.0, jnp.inf, m + jnp.log(safe_l))  # +inf: exp(s - lse) = 0 for empty rows
    return jnp.einsum("BKGTH->BTKGH", o).astype(dtype), lse


def output_delta(do, o):
    """delta [B, K, G, T] = rowsum(do * o), the softmax backward's correction term."""
    return jnp.einsum("BTKGH,BTKGH->BKGT", do.astype(jnp.float32), o.astype(jnp.float32))


def block_grads(dq, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, cfg, chunk, lse, delta, do):
    """Flash-style backward over keys k, v [B, S, K, H], chunk keys at a time: each chunk's
    probabilities recomputed from the saved lse [B, K, G, T]. Returns dq (fp32, added to the
    given one) and this block's dk, dv [B, S, K, H] (fp32)."""
    softcap, scale = cfg.softcap, cfg.scale
    do32 = do.astype(jnp.float32)
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

    dq, (dk, dv) = jax.lax.scan(step, dq, xs)
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(k.shape)  # [n, B, c, K, H] -> [B, S, K, H]
    return dq, unchunk(dk), unchunk(dv)


class Blocks(NamedTuple):
    """The per-block computation of context parallelism in pure JAX, chunk keys at a time.

    The online-softmax state (m, l, acc; `init_carry`) from empty(qg) is updated block by block by
    accumulate(state, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes) and ends as finish(state, dtype)
    -> o [B, T, K, G, H], lse [B, K, G, T]; every array of the state has T on axis 3.
    backward(..., lse, delta, do) -> dq [B, T, K, G, H], dk, dv [B, S, K, H] fp32 with the whole row's
    lse and delta (`output_delta`). qg [B, T, K, G, H], k, v [B, S, K, H] (S a multiple of chunk),
    positions and segment ids [B, T] / [B, S] (q_seg may be None)."""
    cfg: ChunkConfig
    chunk: int

    def empty(self, qg):
        return init_carry(qg)

    def accumulate(self, state, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes):
        return accumulate(state, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, self.cfg, self.chunk)

    def finish(self, state, dtype):
        return finish(state, dtype)

    def backward(self, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, lse, delta, do):
        return block_grads(jnp.zeros(qg.shape, jnp.float32), qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes,
                           self.cfg, self.chunk, lse, delta, do)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def attend(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, blocks):
    """o [B, T, K, G, H] for query groups qg [B, T, K, G, H] against keys k, v [B, S, K, H] in one
    pass of `blocks` (this module's `Blocks` or `tfm.ops.pallas.Blocks`), positions and segment ids
    [B, T] / [B, S]; the backward recomputes the probabilities from the saved log-sum-exp."""
    return _attend_fwd(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, blocks)[0]


def _attend_fwd(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, blocks):
    state = blocks.accumulate(blocks.empty(qg), qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes)
    o, lse = blocks.finish(state, qg.dtype)
    return o, (qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, o, lse)


def _attend_bwd(blocks, residuals, do):
    qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, o, lse = residuals
    dq, dk, dv = blocks.backward(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, lse, output_delta(do, o), do)
    return dq.astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None, None


attend.defvjp(_attend_fwd, _attend_bwd)


def attention(q, k, v, *, causal, q_seg, kv_seg, q_pos, kv_pos, window, slopes, softcap, scale,
              chunk_size, sparsity=None):
    """q [B, T, N, H]; k, v [B, S, K, H] -> [B, T, N, H], keys in chunks of chunk_size (every chunk
    computed: a sparsity pattern masks, only the kernels skip)."""
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
    cfg = ChunkConfig(causal, window, softcap, scale, sparsity, (T, S))
    qg = q.reshape(B, T, K, N // K, H)
    o = attend(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, Blocks(cfg, chunk))
    return o.reshape(B, T, N, H)
