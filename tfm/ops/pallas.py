"""The pallas and hopper backends: the flash kernels of `tfm.kernels.flash_attention` (Triton on
GPU, Mosaic on TPU) or of `tfm.kernels.flash_hopper` (Mosaic GPU on H100/H200), per device.

Under a mesh the kernel runs inside `shard_map` (`tfm.ops.shard.per_device`): batch and
heads are split as the active logical rules split them, T and S stay whole, and each device
runs the kernel on its own shard. Without a mesh it is called directly.

Attention dropout runs inside the kernels, its mask (`tfm.kernels.dropout`) a hash of global
batch row, query head and positions: per device the shard's offsets enter the hash, so a sharded
call drops exactly what the unsharded call and the xla backend (given the same rng) drop.

`Blocks` serves context parallelism (`tfm.ops.context`): the kernels as the per-block computation
of its ring and all-gather strategies, the softmax statistics merged and supplied by the caller; it
takes no dropout.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from tfm.kernels import dropout, flash_attention
from tfm.kernels.tiles import BlockSizes
from tfm.ops import select
from tfm.ops.shard import per_device
from tfm.parallel.mesh import current_device_kind, current_platform


def attention(q, k, v, *, causal: bool, q_segment_ids=None, kv_segment_ids=None,
              window: Optional[int] = None, alibi_slopes=None, softcap: Optional[float] = None,
              sparsity=None, scale: float, block_sizes: Optional[BlockSizes] = None,
              backend: Optional[str] = None, interpret: Optional[bool] = None,
              dropout_rate: float = 0.0, dropout_rng=None, driver: str = "flash"):
    """q [B, T, N, H]; k, v [B, S, K, H] -> [B, T, N, H].

    driver: "flash" (`tfm.kernels.flash_attention`) or "hopper" (`tfm.kernels.flash_hopper`, which
    takes no block_sizes or sparsity: the entry point's capabilities refuse those first).
    block_sizes: kernel tiles (default: per backend). backend: "tpu", "gpu" or "cpu" (default:
    the current mesh's platform, so a CPU host compiling for compile-only TPU or GPU devices
    builds their kernels); interpret: run the Pallas interpreter (default: on "cpu").
    dropout_rate > 0: attention dropout with the mask `tfm.ops.xla` draws from the same
    dropout_rng (a jax PRNG key).
    """
    backend = backend or _platform(q)
    interpret = backend == "cpu" if interpret is None else interpret
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("attention dropout_rate > 0 needs a dropout_rng")
    seed = dropout.seed(dropout_rng) if dropout_rate > 0.0 else None

    if driver == "hopper":
        _check_hopper(backend)
        from tfm.kernels import flash_hopper  # Mosaic GPU: imported where used (0.3 s that other runs skip)

        def kernel(q, k, v, q_segment_ids, kv_segment_ids, alibi_slopes, offsets):
            return flash_hopper.flash_attention(
                q, k, v, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, window=window,
                alibi_slopes=alibi_slopes, softcap=softcap, scale=scale, interpret=interpret,
                dropout_rate=dropout_rate, dropout_seed=seed, dropout_offsets=offsets)[0]
    else:
        def kernel(q, k, v, q_segment_ids, kv_segment_ids, alibi_slopes, offsets):
            return flash_attention.flash_attention(
                q, k, v, causal=causal, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                window=window, alibi_slopes=alibi_slopes, softcap=softcap, sparsity=sparsity, scale=scale,
                block_sizes=block_sizes, backend=backend, interpret=interpret, dropout_rate=dropout_rate,
                dropout_seed=seed, dropout_offsets=offsets)

    return per_device(kernel, q, k, v, q_segment_ids, kv_segment_ids, alibi_slopes, offsets=True)


def _check_hopper(backend: str) -> None:
    """The Hopper driver runs on H100/H200 GPUs with JAX's CUDA libraries, or interpreted on CPU."""
    if backend == "cpu":
        return
    if backend != "gpu" or not select.hopper_present():
        compile_only = ", compile-only" if backend == "gpu" and not select.cuda_present() else ""
        raise ValueError(f"impl='hopper' runs on H100/H200 GPUs with JAX's CUDA libraries (or interpreted on CPU), "
                         f"not on {current_device_kind()} ({backend}{compile_only}): use impl='auto' or 'pallas'")


def _platform(q) -> str:
    """The current mesh's platform. Without a current mesh, q's sharding may still name accelerator
    devices (a jit lowered for compile-only TPU or GPU devices): there the kernel would be the
    Pallas interpreter, called once on the whole array, so that is refused."""
    platform = current_platform()
    named = getattr(jax.typeof(q).sharding, "mesh", None)
    if jax.sharding.get_abstract_mesh().empty and named is not None and not named.empty:
        target = {"cuda": "gpu", "rocm": "gpu"}.get(named.abstract_device.platform, named.abstract_device.platform)
        if target != platform:
            raise ValueError(f"impl='pallas' traced for {target} devices without a current mesh would run the "
                             f"Pallas interpreter on one device's worth of work: trace it under jax.set_mesh(mesh) "
                             f"(tfm.train.Trainer does), or use impl='xla'")
    return platform


def blocks(q_run: int, kv_run: int, *, causal: bool, window: Optional[int], softcap: Optional[float], scale: float,
           block_sizes: Optional[BlockSizes] = None) -> "Blocks":
    """`Blocks` for the current mesh's platform (interpreted on CPU)."""
    backend = current_platform()
    options = dict(causal=causal, window=window, softcap=softcap, scale=scale, block_sizes=block_sizes,
                   backend=backend, interpret=backend == "cpu")
    return Blocks(q_run, kv_run, tuple(sorted(options.items())))


def _merge(a, b):
    """Two partial attentions of the same queries to disjoint keys, a = (o [B, K, G, T, H] fp32,
    lse [B, K, G, T], +inf on rows that saw no key), merged into the attention to both keys."""
    (o_a, lse_a), (o_b, lse_b) = a, b
    seen_a, seen_b = jnp.where(lse_a == jnp.inf, -jnp.inf, lse_a), jnp.where(lse_b == jnp.inf, -jnp.inf, lse_b)
    top = jnp.maximum(seen_a, seen_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w_a, w_b = jnp.exp(seen_a - top), jnp.exp(seen_b - top)  # 0 for a part that saw no key
    total = w_a + w_b
    empty = total == 0.0
    lse = jnp.where(empty, jnp.inf, top + jnp.log(jnp.where(empty, 1.0, total)))
    total = jnp.where(empty, 1.0, total)
    return o_a * (w_a / total)[..., None] + o_b * (w_b / total)[..., None], lse


class Blocks(NamedTuple):
    """The flash kernels as the per-block computation of context parallelism (the interface of
    `tfm.ops.chunked.Blocks`; the state: o [B, K, G, T, H] fp32 and lse [B, K, G, T], blocks merged
    by online softmax).

    A block's queries and keys are runs of consecutive global positions, q_run and kv_run tokens
    each (a zig-zag share is two runs): a loop over the (query run, key run) pairs calls the kernels
    once per pair with the queries' offset from the keys (a traced scalar), by which they mask and
    skip tiles. options: causal, window, softcap, scale, block_sizes, backend, interpret
    (`flash_attention`)."""
    q_run: int
    kv_run: int
    options: tuple  # sorted (name, value) pairs: hashable, a custom_vjp nondiff argument

    def _pairs(self, T, S):
        """(number of pairs, pair index -> (query run start, key run start)) for T queries, S keys."""
        runs_kv = S // self.kv_run
        return T // self.q_run * runs_kv, lambda p: ((p // runs_kv) * self.q_run, (p % runs_kv) * self.kv_run)

    def _run(self, x, start, axis=1):
        return None if x is None else lax.dynamic_slice_in_dim(x, start, self.q_run, axis)

    def _kv(self, x, start):
        return lax.dynamic_slice_in_dim(x, start, self.kv_run, 1)

    def empty(self, qg):
        B, T, K, G, H = qg.shape
        return jnp.zeros((B, K, G, T, H), jnp.float32), jnp.full((B, K, G, T), jnp.inf, jnp.float32)

    def accumulate(self, state, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes):
        B, T, K, G, H = qg.shape
        pairs, starts = self._pairs(T, k.shape[1])

        def pair(p, state):
            q0, k0 = starts(p)
            o, lse = flash_attention.block_forward(
                self._run(qg, q0).reshape(B, self.q_run, K * G, H), self._kv(k, k0), self._kv(v, k0),
                q_pos[0, q0] - kv_pos[0, k0], q_segment_ids=self._run(q_seg, q0), kv_segment_ids=self._kv(kv_seg, k0),
                alibi_slopes=slopes, **dict(self.options))
            o = jnp.einsum("BTKGH->BKGTH", o.astype(jnp.float32).reshape(B, self.q_run, K, G, H))
            o, lse = _merge(tuple(self._run(x, q0, 3) for x in state), (o, lse.reshape(B, K, G, self.q_run)))
            return tuple(lax.dynamic_update_slice_in_dim(x, y, q0, 3) for x, y in zip(state, (o, lse)))

        return lax.fori_loop(0, pairs, pair, state)

    def finish(self, state, dtype):
        o, lse = state
        return jnp.einsum("BKGTH->BTKGH", o).astype(dtype), lse

    def backward(self, qg, k, v, q_pos, kv_pos, q_seg, kv_seg, slopes, lse, delta, do):
        B, T, K, G, H = qg.shape
        pairs, starts = self._pairs(T, k.shape[1])
        heads = lambda x, q0: self._run(x, q0).reshape(B, self.q_run, K * G, H)  # [B, T', N, H]
        stats = lambda x, q0: self._run(x, q0, 3).reshape(B, K * G, self.q_run)  # [B, N, T']

        def pair(p, grads):
            q0, k0 = starts(p)
            dq_part, dk_part, dv_part = flash_attention.block_backward(
                heads(qg, q0), self._kv(k, k0), self._kv(v, k0), heads(do, q0), stats(lse, q0), stats(delta, q0),
                q_pos[0, q0] - kv_pos[0, k0], q_segment_ids=self._run(q_seg, q0),
                kv_segment_ids=self._kv(kv_seg, k0), alibi_slopes=slopes, **dict(self.options))
            add = lambda acc, part, start, length: lax.dynamic_update_slice_in_dim(
                acc, lax.dynamic_slice_in_dim(acc, start, length, 1) + part.astype(jnp.float32), start, 1)
            dq, dk, dv = grads
            return (add(dq, dq_part.reshape(B, self.q_run, K, G, H), q0, self.q_run),
                    add(dk, dk_part, k0, self.kv_run), add(dv, dv_part, k0, self.kv_run))

        zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
        return lax.fori_loop(0, pairs, pair, (zeros(qg), zeros(k), zeros(v)))
