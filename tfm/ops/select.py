"""`impl="auto"`: the attention backend to use per device backend, shape and mask features.

A backend qualifies where its declaration (`tfm.capabilities.ATTENTION`) says it runs on the
platform, takes the dtype and head dim, and computes every feature of the call; among those,
the first in this order of preference, which follows benchmarks/RESULTS.md:

GPU (measured on an H100 by `benchmarks.gpu_check`, 2026-11-24): cuDNN's fused kernel ran
forward+backward at 2.5-4.6x the Pallas (Triton) kernels on every measured shape (bf16, H 64/128,
L 1k-16k, causal and not), so it comes first wherever it computes the layer without a
materialised operand: not with ALiBi (a [1, N, T, S] bias) nor segment ids (a [B, 1, T, S] mask;
its speed there is unmeasured), nor without the cuDNN library (a compile-only H100 in
`tfm.preflight`, where JAX cannot lower cuDNN calls). Then the Pallas kernels, then xla.
TPU (unmeasured): the Pallas kernels, then xla. CPU: xla while its fp32 logits stay under 1 GiB,
else chunked (the kernels only interpret there).

Under context parallelism (`choose_context_impl`) a block is the Pallas kernels' where they run
compiled for the dtype (TPU, bf16/fp16 GPU; unmeasured against the chunked blocks on hardware),
else the chunked backend's.
"""
from __future__ import annotations

import functools

from tfm import capabilities
from tfm.parallel.mesh import current_platform

# Above this many fp32 logit bytes (B*N*T*S*4) the xla reference's memory dominates on CPU.
_CPU_XLA_MAX_LOGIT_BYTES = 1 << 30


def choose_impl(q, k, *, alibi: bool = False, segments: bool = False, **call) -> str:
    """A concrete impl name for q [B, T, N, H] and k [B, S, K, H] on the current mesh's platform.
    call: the call's mask arguments, as `capabilities.call_features` takes them (dropout_rate,
    positions_given, causal, window, softcap, sparse, bias); alibi, segments: whether it has them."""
    wanted = capabilities.call_features(**call)
    platform, dtype, H = current_platform(), q.dtype.name, q.shape[-1]
    for name in _preference(platform, q, k, cudnn_first=not (alibi or segments)):
        support = capabilities.ATTENTION[name]
        if support.takes(platform, dtype, H) and not support.missing(**wanted):
            return name
    asked = sorted(f for f, used in wanted.items() if used)
    raise ValueError(f"no attention backend computes {asked} for {dtype} on {platform} (tfm.capabilities)")


def _preference(platform: str, q, k, *, cudnn_first: bool) -> list:
    """Backend names in the order `auto` tries them (module doc)."""
    if platform == "gpu":
        return (["cudnn"] if cudnn_first and cudnn_present() else []) + ["pallas", "xla"]
    if platform == "tpu":
        return ["pallas", "xla"]
    B, T, N, _ = q.shape
    small = B * N * T * k.shape[1] * 4 <= _CPU_XLA_MAX_LOGIT_BYTES
    return ["xla", "chunked"] if small else ["chunked", "xla"]


def choose_context_impl(q) -> str:
    """The per-block computation of context-parallel attention (`tfm.ops.context`) for q [B, T, N, H]
    on the current mesh's platform: "pallas" or "chunked"."""
    platform = current_platform()
    compiled = platform != "cpu" and capabilities.ATTENTION["pallas"].takes(platform, q.dtype.name, q.shape[-1])
    return "pallas" if compiled else "chunked"


@functools.cache
def cudnn_present() -> bool:
    """Whether JAX found the CUDA libraries it lowers cuDNN attention with (its own check)."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return False
    return cuda_versions is not None
