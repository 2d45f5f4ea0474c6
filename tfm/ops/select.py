"""`impl="auto"`: the attention backend to use per device backend, shape and mask features.

A backend qualifies where its declaration (`tfm.capabilities.ATTENTION`) says it runs on the
platform, takes the dtype and head dim, and computes every feature of the call; among those,
the first in this order of preference, which follows benchmarks/RESULTS.md:

GPU (`benchmarks.gpu_check` on an H100, 2026-11-24, and an H200, 2026-11-27): cuDNN's fused kernel
comes first wherever it computes the layer without a materialised operand: not with ALiBi (a
[1, N, T, S] bias) nor segment ids (a [B, 1, T, S] mask; its speed there is unmeasured). On a
Hopper GPU tfm's Hopper driver comes next: slower than cuDNN but several times the Triton kernels on
every measured shape (bf16, H 64/128, L 2k-16k, causal and not), with 0 correctness failures over
every case on the H200, so the features cuDNN lacks (soft-cap, bidirectional windows, ALiBi, segment
ids, dropout) no longer fall to Triton. Then the Pallas kernels (Triton), then xla. cuDNN
and the Hopper driver need JAX's CUDA libraries: a compile-only GPU (`tfm.preflight`) has neither
(JAX cannot lower cuDNN calls there, nor load a Mosaic GPU kernel), so it gets Triton.
TPU (unmeasured): the Pallas kernels, then xla. CPU: xla while its fp32 logits stay under 1 GiB,
else chunked (the kernels only interpret there).

Under context parallelism (`choose_context_impl`) a block is the Pallas kernels' where they run
compiled for the dtype (TPU, bf16/fp16 GPU; unmeasured against the chunked blocks on hardware),
else the chunked backend's.
"""
from __future__ import annotations

import functools

from tfm import capabilities
from tfm.parallel.mesh import current_device_kind, current_platform

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
        cudnn = ["cudnn"] if cudnn_first and cuda_present() else []
        return cudnn + (["hopper"] if hopper_present() else []) + ["pallas", "xla"]
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
def cuda_present() -> bool:
    """Whether JAX found its CUDA libraries (its own check): what it lowers cuDNN attention with and
    loads Mosaic GPU kernels with. Absent on a compile-only GPU."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return False
    return cuda_versions is not None


def hopper_present() -> bool:
    """Whether the current mesh's devices are Hopper GPUs (H100, H200, H800) that can run tfm's
    Hopper driver: compiled for sm_90a and loaded by JAX's CUDA libraries."""
    return (current_platform() == "gpu" and cuda_present()
            and any(name in current_device_kind() for name in ("H100", "H200", "H800")))
