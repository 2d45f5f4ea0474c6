"""`impl="auto"`: the attention backend to use per device backend, shape and mask features.

The rules follow benchmarks/RESULTS.md. GPU (measured on an H100 by `benchmarks.gpu_check`,
2026-11-24): cuDNN's fused kernel ran forward+backward at 2.5-4.6x the Pallas (Triton) kernels
on every measured shape (bf16, H 64/128, L 1k-16k, causal and not), so it is chosen wherever it
computes the layer without a materialised operand: no soft-cap, no bidirectional window (it has
neither), no ALiBi (a [1, N, T, S] bias) and no segment ids (a [B, 1, T, S] mask; its speed there
is unmeasured), head dim a multiple of 8 up to 128. Elsewhere on GPU the Pallas kernels, except
float32, which the Triton kernels refuse: xla. Without the cuDNN library (a compile-only H100 in
`tfm.preflight`, where JAX cannot lower cuDNN calls) the Pallas kernels. TPU is unmeasured: the
Pallas kernels. A sparsity pattern: the Pallas kernels on TPU and bf16/fp16 GPU (they alone skip
its empty tiles); elsewhere the rules above (never cuDNN).

Under context parallelism (`choose_context_impl`) a block is the Pallas kernels' on TPU and on
bf16/fp16 GPU (the memory- and speed-relevant path; unmeasured against the chunked blocks on
hardware), else the chunked backend's.
"""
from __future__ import annotations

import functools
from typing import Optional

from tfm.kernels.tiles import GPU_DTYPES
from tfm.parallel.mesh import current_platform

# Above this many fp32 logit bytes (B*N*T*S*4) the xla reference's memory dominates on CPU.
_CPU_XLA_MAX_LOGIT_BYTES = 1 << 30


def choose_impl(q, k, *, dropout_rate: float = 0.0, positions_given: bool = False, causal: bool = False,
                window: Optional[int] = None, softcap: Optional[float] = None, alibi: bool = False,
                segments: bool = False, sparse: bool = False) -> str:
    """A concrete impl name for q [B, T, N, H] and k [B, S, K, H] on the current mesh's platform,
    given the mask features the call uses."""
    if dropout_rate > 0.0 or positions_given:
        return "xla"  # only xla implements dropout and explicit (KV-cache) positions
    platform = current_platform()
    if sparse and (platform == "tpu" or (platform == "gpu" and q.dtype.name in GPU_DTYPES)):
        return "pallas"  # only the kernels skip a pattern's empty tiles (cuDNN takes no pattern)
    if platform == "gpu":
        if q.dtype.name not in GPU_DTYPES:
            return "xla"  # the Triton kernels and cuDNN take bf16/fp16 only
        H = q.shape[-1]
        plain = softcap is None and (window is None or causal) and not alibi and not segments
        return "cudnn" if plain and H % 8 == 0 and H <= 128 and cudnn_present() else "pallas"
    if platform == "tpu":
        return "pallas"
    B, T, N, _ = q.shape
    logit_bytes = B * N * T * k.shape[1] * 4
    return "xla" if logit_bytes <= _CPU_XLA_MAX_LOGIT_BYTES else "chunked"


def choose_context_impl(q) -> str:
    """The per-block computation of context-parallel attention (`tfm.ops.context`) for q [B, T, N, H]
    on the current mesh's platform: "pallas" or "chunked"."""
    platform = current_platform()
    if platform == "tpu" or (platform == "gpu" and q.dtype.name in GPU_DTYPES):
        return "pallas"
    return "chunked"


@functools.cache
def cudnn_present() -> bool:
    """Whether JAX found the CUDA libraries it lowers cuDNN attention with (its own check)."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return False
    return cuda_versions is not None
