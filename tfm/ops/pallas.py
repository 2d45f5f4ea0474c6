"""The pallas backend: the flash kernels of `tfm.kernels.flash_attention`, per device.

Under a mesh the kernel runs inside `shard_map` (`tfm.ops.shard.per_device`): batch and
heads are split as the active logical rules split them, T and S stay whole, and each device
runs the kernel on its own shard. Without a mesh it is called directly.
"""
from __future__ import annotations

from typing import Optional

from tfm.kernels import flash_attention
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
