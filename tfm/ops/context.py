"""Context parallelism: attention with the sequence split over the mesh's `context` axis.

Under a mesh whose rules give "length" the `context` axis (c devices), q [B, T, N, H] and
k, v [B, S, K, H] arrive split along T and S (device i holds the i-th contiguous 1/c). Each
device then runs, inside `shard_map` (`tfm.ops.shard.per_device`, which splits batch and heads
too), one of two strategies (ModelConfig.execution.context_strategy, `tfm.capabilities.CONTEXT_STRATEGIES`):

  all_gather  every device gathers the whole of K and V (and their positions and segment
              ids) and attends its own queries to them: simple, O(S) memory per device.
  ring        K/V blocks travel around the `context` ring (`lax.ppermute`): at each of c steps a
              device attends its queries to the block it holds, merging blocks by online
              softmax (each block's output and log-sum-exp); the backward rotates the blocks again
              with their dK/dV accumulators, which arrive home after c steps. O(S/c) memory.

Load balance (causal): each device's share is re-laid out zig-zag, two mirrored chunks of
T/(2c): device i holds chunks i and 2c-1-i (`zigzag_chunks`), so every device has as many
visible (query, key) pairs as every other; for causal self-attention each ring step skips the
half of its block that no query of the device can see, so a device computes (c + 1) / 2 blocks'
worth instead of c, the same on every device. The re-layout moves q, k, v there and
the output back (one `ppermute` per half); positions, windows, ALiBi and segment ids are those
of each token's global position, wherever it sits.

One driver serves both strategies, the per-block computation pluggable (`impl`): the chunked
backend's (`tfm.ops.chunked.Blocks`: keys taken `chunk` at a time) or the flash kernels'
(`tfm.ops.pallas.Blocks`: one kernel call per pair of position runs, a zig-zag share being two
runs and the all-gathered keys, put back in sequence order, one; the queries' offset from the keys
is a traced scalar the kernels mask and skip tiles by). Each folds its blocks into an online-softmax
state (`accumulate`) that ends as the output and log-sum-exp (`finish`); the backward gives every
block the whole row's log-sum-exp and delta = rowsum(dO * O), recomputing the probabilities. cuDNN
is refused here.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tfm.ops import chunked, pallas
from tfm.ops.shard import context_size, per_device
from tfm.parallel.mesh import CONTEXT

def zigzag_chunks(index: int, size: int) -> tuple[int, int]:
    """The two chunks (of 2 * size, in sequence order) that device `index` of `size` holds."""
    return index, 2 * size - 1 - index


def _zigzag_home(chunk: int, size: int) -> int:
    """The device that holds sequence chunk `chunk` in the zig-zag layout."""
    return chunk if chunk < size else 2 * size - 1 - chunk


def _to_zigzag(x, size):
    """Device i's contiguous chunks (2i, 2i + 1) of x [B, L, ...] -> its zig-zag chunks."""
    first, second = jnp.split(x, 2, axis=1)
    even = jax.lax.ppermute(first, CONTEXT, [(i, _zigzag_home(2 * i, size)) for i in range(size)])
    odd = jax.lax.ppermute(second, CONTEXT, [(i, _zigzag_home(2 * i + 1, size)) for i in range(size)])
    mine_even = jax.lax.axis_index(CONTEXT) % 2 == 0  # chunk i is even, chunk 2c-1-i odd
    return jnp.concatenate([jnp.where(mine_even, even, odd), jnp.where(mine_even, odd, even)], axis=1)


def _from_zigzag(x, size):
    """The inverse of _to_zigzag: zig-zag chunks of x [B, L, ...] back to contiguous ones."""
    low, high = jnp.split(x, 2, axis=1)
    mine_even = jax.lax.axis_index(CONTEXT) % 2 == 0
    even, odd = jnp.where(mine_even, low, high), jnp.where(mine_even, high, low)
    even = jax.lax.ppermute(even, CONTEXT, [(_zigzag_home(2 * i, size), i) for i in range(size)])
    odd = jax.lax.ppermute(odd, CONTEXT, [(_zigzag_home(2 * i + 1, size), i) for i in range(size)])
    return jnp.concatenate([even, odd], axis=1)


def _zigzag_positions(length, size):
    """Global positions [1, L] of a device's zig-zag share of L = T / c tokens."""
    half = length // 2
    i = jax.lax.axis_index(CONTEXT)
    return jnp.concatenate([i * half + jnp.arange(half), (2 * size - 1 - i) * half + jnp.arange(half)])[None]


def _rotate(xs, size):
    """Each array to the next device around the ring (i -> i + 1)."""
    perm = [(i, (i + 1) % size) for i in range(size)]
    return tuple(jax.lax.ppermute(x, CONTEXT, perm) for x in xs)


def _step_kind(step, size, skip):
    """None without skipping, else 0: attend the whole block (the device's own); 1: the block
    comes from an earlier device (queries see only its first chunk); 2: from a later device
    (only the second query chunk sees it)."""
    if not skip:
        return None
    source = (jax.lax.axis_index(CONTEXT) - step) % size
    me = jax.lax.axis_index(CONTEXT)
    return jnp.where(source == me, 0, jnp.where(source < me, 1, 2)).astype(jnp.int32)


def _halves(x, axis):
    return jnp.split(x, 2, axis=axis)


def _ring_forward(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, blocks, size, skip):
    """o [B, T, K, G, H] and lse [B, K, G, T] of the local queries against every device's block."""
    q_seg_h = (None, None) if q_seg is None else _halves(q_seg, 1)

    def attend(state, block, kind):
        k, v, kv_pos, kv_seg = block
        full = lambda state: blocks.accumulate(state, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes)

        def first_keys(state):  # an earlier device's block: only its first chunk is visible
            kh, vh, ph, sh = (_halves(x, 1)[0] for x in (k, v, kv_pos, kv_seg))
            return blocks.accumulate(state, qg, kh, vh, q_pos, ph, q_seg, sh, slopes)

        def last_queries(state):  # a later device's block: only the second query chunk sees it
            lo, hi = zip(*(_halves(x, 3) for x in state))
            hi = blocks.accumulate(hi, _halves(qg, 1)[1], k, v, _halves(q_pos, 1)[1], kv_pos, q_seg_h[1], kv_seg,
                                   slopes)
            return tuple(jnp.concatenate(pair, axis=3) for pair in zip(lo, hi))

        return full(state) if kind is None else jax.lax.switch(kind, (full, first_keys, last_queries), state)

    def step(i, state):
        state, block = state
        return attend(state, block, _step_kind(i, size, skip)), _rotate(block, size)

    state, block = jax.lax.fori_loop(0, size - 1, step, (blocks.empty(qg), (k, v, kv_pos, kv_seg)))
    return blocks.finish(attend(state, block, _step_kind(size - 1, size, skip)), qg.dtype)


def _ring_backward(residuals, do, blocks, size, skip):
    qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, o, lse = residuals
    delta = chunked.output_delta(do, o)
    q_seg_h = (None, None) if q_seg is None else _halves(q_seg, 1)

    def grads(dq, block, kind):
        """dq with this block's share added, and the block's dk, dv."""
        k, v, kv_pos, kv_seg = block

        def full(dq):
            dq_block, dk, dv = blocks.backward(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, lse, delta, do)
            return dq + dq_block, dk, dv

        def first_keys(dq):
            kh, vh, ph, sh = (_halves(x, 1)[0] for x in (k, v, kv_pos, kv_seg))
            dq_block, dk, dv = blocks.backward(qg, kh, vh, q_pos, ph, q_seg, sh, slopes, lse, delta, do)
            pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)
            return dq + dq_block, pad(dk), pad(dv)

        def last_queries(dq):
            lo, hi = _halves(dq, 1)
            dq_block, dk, dv = blocks.backward(_halves(qg, 1)[1], k, v, _halves(q_pos, 1)[1], kv_pos, q_seg_h[1],
                                               kv_seg, slopes, _halves(lse, 3)[1], _halves(delta, 3)[1],
                                               _halves(do, 1)[1])
            return jnp.concatenate([lo, hi + dq_block], axis=1), dk, dv

        return full(dq) if kind is None else jax.lax.switch(kind, (full, first_keys, last_queries), dq)

    def step(i, state):
        dq, block, dkv = state
        dq, dk, dv = grads(dq, block, _step_kind(i, size, skip))
        dkv = (dkv[0] + dk, dkv[1] + dv)
        return dq, _rotate(block, size), _rotate(dkv, size)

    zeros = jnp.zeros(k.shape, jnp.float32)
    state = (jnp.zeros(qg.shape, jnp.float32), (k, v, kv_pos, kv_seg), (zeros, zeros))
    dq, _, (dk, dv) = jax.lax.fori_loop(0, size, step, state)  # after c rotations dK/dV are home
    return dq.astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _ring(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, blocks, size, skip):
    return _ring_forward(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, blocks, size, skip)[0]


def _ring_fwd(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, blocks, size, skip):
    o, lse = _ring_forward(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, blocks, size, skip)
    return o, (qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, o, lse)


def _ring_bwd(blocks, size, skip, residuals, do):
    return _ring_backward(residuals, do, blocks, size, skip) + (None,) * 5


_ring.defvjp(_ring_fwd, _ring_bwd)


def _in_sequence_order(x, size):
    """x [B, c * L, ...] gathered from every device's zig-zag share -> its 2c chunks in sequence order."""
    chunks = jnp.split(x, 2 * size, axis=1)  # device d's share is gathered chunks 2d, 2d + 1
    order = [2 * _zigzag_home(j, size) + (j >= size) for j in range(2 * size)]
    return jnp.concatenate([chunks[i] for i in order], axis=1)


def _gathered(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, blocks, size, skip):
    """The local queries against the whole K and V, gathered from every device (in sequence order)."""
    k, v, kv_pos, kv_seg = (_in_sequence_order(jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True), size)
                            for x in (k, v, kv_pos, kv_seg))
    return chunked.attend(qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, blocks)


def _chunk_for(length, chunk_size):
    """Keys per chunk: chunk_size when it divides a device's keys, else all of them at once."""
    return chunk_size if length % chunk_size == 0 else length


def attention(q, k, v, *, strategy: str, impl: str, causal: bool, q_segment_ids=None, kv_segment_ids=None,
              window=None, alibi_slopes=None, softcap=None, scale: float, chunk_size: int, block_sizes=None):
    """q [B, T, N, H]; k, v [B, S, K, H] -> [B, T, N, H], T and S split over the `context` axis.
    impl: the per-block computation, "chunked" (chunk_size keys at a time) or "pallas" (the flash
    kernels, block_sizes their tiles)."""
    size = context_size()
    B, T, N, H = q.shape
    S = k.shape[1]
    if T % (2 * size) or S % (2 * size):
        raise ValueError(f"context parallelism over {size} devices needs query and key lengths divisible by "
                         f"{2 * size} (two chunks per device); got T={T}, S={S}")
    if kv_segment_ids is None:
        kv_segment_ids = jnp.ones((B, S), jnp.int32)
    skip = causal and T == S  # self-attention: a ring step's invisible half is skipped
    body = _ring if strategy == "ring" else _gathered

    def per_block(T, S):
        """The per-block computation for a device's T queries and S keys."""
        keys = S * size if strategy == "all_gather" else S // 2 if skip else S  # most keys attended at once
        if impl == "pallas":  # runs of consecutive positions: zig-zag halves; all-gathered keys whole
            return pallas.blocks(T // 2, keys if strategy == "all_gather" else S // 2, causal=causal, window=window,
                                 softcap=softcap, scale=scale, block_sizes=block_sizes)
        return chunked.Blocks(chunked.ChunkConfig(causal, window, softcap, scale), _chunk_for(keys, chunk_size))

    def kernel(q, k, v, q_seg, kv_seg, slopes):
        B, T, N, H = q.shape
        S, K = k.shape[1], k.shape[2]
        zig = lambda x: None if x is None else _to_zigzag(x, size)
        q_pos = jnp.broadcast_to(_zigzag_positions(T, size), (B, T))
        kv_pos = jnp.broadcast_to(_zigzag_positions(S, size), (B, S))
        qg = zig(q).reshape(B, T, K, N // K, H)
        o = body(qg, zig(k), zig(v), q_pos, kv_pos, zig(q_seg), zig(kv_seg), slopes, per_block(T, S), size, skip)
        return _from_zigzag(o.reshape(B, T, N, H), size)

    return per_device(kernel, q, k, v, q_segment_ids, kv_segment_ids, alibi_slopes, split_length=True)
