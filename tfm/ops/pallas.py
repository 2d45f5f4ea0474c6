"""The pallas backend: the flash kernels of `tfm.kernels.flash_attention`, per device.

Under a mesh the kernel runs inside `shard_map` (`tfm.ops.shard.per_device`): batch and
heads are split as the active logical rules split them, T and S stay whole, and each device
runs the kernel on its own shard. Without a mesh it is called directly.

`Blocks` serves context parallelism (`tfm.ops.context`): the kernels as the per-block computation
of its ring and all-gather strategies, the softmax statistics merged and supplied by the caller.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax.numpy as jnp

from tfm.kernels import flash_attention
from tfm.ops.chunked import merge
from tfm.ops.shard import per_device
from tfm.parallel.mesh import current_platform


def attention(q, k, v, *, causal: bool, q_segment_ids=None, kv_segment_ids=None,
              window: Optional[int] = None, alibi_slopes=None, softcap: Optional[float] = None,
              sparsity=None, scale: float, block_sizes: Optional[flash_attention.BlockSizes] = None,
              backend: Optional[str] = None, interpret: Optional[bool] = None):
    """q [B, T, N, H]; k, v [B, S, K, H] -> [B, T, N, H].

    block_sizes: kernel tiles (default: per backend). backend: "tpu", "gpu" or "cpu" (default:
    the current mesh's platform, so a CPU host compiling for compile-only TPU or GPU devices
    builds their kernels); interpret: run the Pallas interpreter (default: on "cpu").
    """
    backend = backend or current_platform()
    interpret = backend == "cpu" if interpret is None else interpret

    def kernel(q, k, v, q_segment_ids, kv_segment_ids, alibi_slopes):
        return flash_attention.flash_attention(
            q, k, v, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            window=window, alibi_slopes=alibi_slopes, softcap=softcap, sparsity=sparsity, scale=scale,
            block_sizes=block_sizes, backend=backend, interpret=interpret)

    return per_device(kernel, q, k, v, q_segment_ids, kv_segment_ids, alibi_slopes)


def blocks(q_run: int, kv_run: int, *, causal: bool, window: Optional[int], softcap: Optional[float], scale: float,
           block_sizes: Optional[flash_attention.BlockSizes] = None) -> "Blocks":
    """`Blocks` for the current mesh's platform (interpreted on CPU)."""
    backend = current_platform()
    options = dict(causal=causal, window=window, softcap=softcap, scale=scale, block_sizes=block_sizes,
                   backend=backend, interpret=backend == "cpu")
    return Blocks(q_run, kv_run, tuple(sorted(options.items())))


class Blocks(NamedTuple):
    """The flash kernels as the per-block computation of context parallelism (the interface of
    `tfm.ops.chunked.Blocks`: forward -> o fp32, lse; backward with the whole row's lse and delta).

    A block's queries and keys are runs of consecutive global positions, q_run and kv_run tokens
    each (a zig-zag share is two runs): one kernel call per (query run, key run) pair, the queries'
    offset from the keys (a traced scalar) given to the kernels, which mask and skip tiles by it.
    options: causal, window, softcap, scale, block_sizes, backend, interpret (`flash_attention`)."""
    q_run: int
    kv_run: int
    options: tuple  # sorted (name, value) pairs: hashable, a custom_vjp nondiff argument

    def _runs(self, length, run):
        return [slice(start, start + run) for start in range(0, length, run)]

    def forward(self, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes):
        B, T, K, G, H = qg.shape
        options = dict(self.options)
        outs = []
        for rows in self._runs(T, self.q_run):
            q = qg[:, rows].reshape(B, -1, K * G, H)
            part = None
            for cols in self._runs(k.shape[1], self.kv_run):
                shift = q_pos[0, rows.start] - kv_pos[0, cols.start]
                o, lse = flash_attention.block_forward(
                    q, k[:, cols], v[:, cols], shift, q_segment_ids=None if q_seg is None else q_seg[:, rows],
                    kv_segment_ids=kv_seg[:, cols], alibi_slopes=slopes, **options)
                o = o.astype(jnp.float32).reshape(B, -1, K, G, H), lse.reshape(B, K, G, -1)  # [B, T', K, G, H]
                part = o if part is None else merge(part, o)
            outs.append(part)
        return jnp.concatenate([o for o, _ in outs], axis=1), jnp.concatenate([lse for _, lse in outs], axis=3)

    def backward(self, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, lse, delta, do):
        B, T, K, G, H = qg.shape
        options = dict(self.options)
        dq = jnp.zeros(qg.shape, jnp.float32)
        dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
        heads = lambda x, rows: x[:, rows].reshape(B, -1, K * G, H)  # [B, T', N, H]
        stats = lambda x, rows: x[..., rows].reshape(B, K * G, -1)   # [B, N, T']
        for rows in self._runs(T, self.q_run):
            for cols in self._runs(k.shape[1], self.kv_run):
                shift = q_pos[0, rows.start] - kv_pos[0, cols.start]
                dq_part, dk_part, dv_part = flash_attention.block_backward(
                    heads(qg, rows), k[:, cols], v[:, cols], heads(do, rows), stats(lse, rows), stats(delta, rows),
                    shift, q_segment_ids=None if q_seg is None else q_seg[:, rows], kv_segment_ids=kv_seg[:, cols],
                    alibi_slopes=slopes, **options)
                dq = dq.at[:, rows].add(dq_part.astype(jnp.float32).reshape(B, -1, K, G, H))
                dk = dk.at[:, cols].add(dk_part.astype(jnp.float32))
                dv = dv.at[:, cols].add(dv_part.astype(jnp.float32))
        return dq, dk, dv
