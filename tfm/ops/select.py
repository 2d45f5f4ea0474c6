"""`impl="auto"`: the attention backend to use per device backend and shape.

The rules follow benchmarks/RESULTS.md. GPU and TPU figures are not yet measured, so
there the choice is provisional: the Pallas kernels, which support every mask feature
(cuDNN lacks soft-cap and bidirectional windows, and this choice sees only shapes), except
float32 on GPU, which the Triton kernels refuse: xla.
"""
from __future__ import annotations

from tfm.kernels.flash_attention import GPU_DTYPES
from tfm.parallel.mesh import current_platform

# Above this many fp32 logit bytes (B*N*T*S*4) the xla reference's memory dominates on CPU.
_CPU_XLA_MAX_LOGIT_BYTES = 1 << 30


def choose_impl(q, k, *, dropout_rate: float = 0.0, positions_given: bool = False) -> str:
    """A concrete impl name for q [B, T, N, H] and k [B, S, K, H] on the current mesh's platform."""
    if dropout_rate > 0.0 or positions_given:
        return "xla"  # only xla implements dropout and explicit (KV-cache) positions
    platform = current_platform()
    if platform == "gpu" and q.dtype.name not in GPU_DTYPES:
        return "xla"  # the Triton kernels take bf16/fp16 only
    if platform in ("gpu", "tpu"):
        return "pallas"
    B, T, N, _ = q.shape
    logit_bytes = B * N * T * k.shape[1] * 4
    return "xla" if logit_bytes <= _CPU_XLA_MAX_LOGIT_BYTES else "chunked"
