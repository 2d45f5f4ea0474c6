"""What each attention backend and MoE implementation supports, declared once.

`ModelConfig` validation (tfm.config), the attention entry point (tfm.ops.attention) and
`impl="auto"` (tfm.ops.select) all read these tables; a backend gains a feature by changing its
entry here and nowhere else. Importing this module imports no kernel.

The linear-time token mixers' forms are `MIXER` (below the attention tables).

Attention features (the keyword arguments of `tfm.ops.attention.dot_product_attention`):
  dropout       attention-probability dropout
  bias          an additive [B|1, N, T, S] logit bias (T5's relative position bias)
  positions     explicit query/key positions (KV-cache decoding)
  sparsity      a `tfm.kernels.sparsity` pattern
  softcap       logit soft-capping
  sinks         a learned per-head logit in the softmax's denominator (gpt-oss's attention sinks)
  bidirectional_window  a window without causal masking
  block_sizes   takes the Pallas kernel tiles (`ExecutionConfig.attention_block_sizes`)
  context       may be named under context parallelism (its blocks are computed as `CONTEXT` says)
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from tfm.kernels.tiles import GPU_DTYPES

FEATURES = ("dropout", "bias", "positions", "sparsity", "softcap", "sinks", "bidirectional_window", "block_sizes")


@dataclasses.dataclass(frozen=True)
class AttentionSupport:
    """One attention backend's features (module doc), and where it runs.

    platforms: device platforms it runs on ("cpu", "gpu", "tpu"). gpu_dtypes: the dtypes it takes on
    GPU (None = any). max_head_dim / head_dim_multiple: head dims it takes (None = any)."""

    dropout: bool = False
    bias: bool = False
    positions: bool = False
    sparsity: bool = False
    softcap: bool = True
    sinks: bool = False
    bidirectional_window: bool = True
    block_sizes: bool = False
    context: bool = True
    platforms: Tuple[str, ...] = ("cpu", "gpu", "tpu")
    gpu_dtypes: Optional[Tuple[str, ...]] = None
    max_head_dim: Optional[int] = None
    head_dim_multiple: int = 1

    def missing(self, **features: bool) -> list:
        """The named features asked for (True) that this backend lacks."""
        unknown = sorted(set(features) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown attention features {unknown}; known: {FEATURES}")
        return [name for name, wanted in features.items() if wanted and not getattr(self, name)]

    def takes(self, platform: str, dtype: str, head_dim: int) -> bool:
        """Whether it runs on `platform` for inputs of `dtype` with `head_dim`."""
        if platform not in self.platforms:
            return False
        if platform == "gpu" and self.gpu_dtypes is not None and dtype not in self.gpu_dtypes:
            return False
        return (self.max_head_dim is None or head_dim <= self.max_head_dim) and head_dim % self.head_dim_multiple == 0


ATTENTION = {
    # The reference: the [B, N, T, S] logits materialised. Under context parallelism it is
    # computed by the chunked blocks.
    "xla": AttentionSupport(dropout=True, bias=True, positions=True, sparsity=True, sinks=True),
    # Pure-JAX blockwise online softmax, O(L) memory.
    "chunked": AttentionSupport(positions=True, sparsity=True),
    # The flash kernels (tfm.kernels.flash_attention): Triton on GPU (tensor-core dtypes), Mosaic on
    # TPU, the Pallas interpreter on CPU. Their dropout mask is xla's (tfm.kernels.dropout).
    "pallas": AttentionSupport(dropout=True, sparsity=True, block_sizes=True, gpu_dtypes=GPU_DTYPES),
    # tfm's Hopper driver (tfm.kernels.flash_hopper, Pallas Mosaic GPU): H100/H200 only, bf16/fp16;
    # its backward takes head dims up to 128. No sparse block lists or context-parallel blocks yet.
    # On CPU it runs in Mosaic GPU's interpreter (tests).
    "hopper": AttentionSupport(dropout=True, context=False, platforms=("cpu", "gpu"),
                               gpu_dtypes=("bfloat16", "float16"), max_head_dim=128),
    # cuDNN's fused kernel through jax.nn: GPU only.
    "cudnn": AttentionSupport(softcap=False, bidirectional_window=False, context=False, platforms=("gpu",),
                              gpu_dtypes=("bfloat16", "float16"), max_head_dim=128, head_dim_multiple=8),
}
# Context-parallel attention (tfm.ops.context) computes blocks with the chunked backend or the
# kernels, the softmax statistics its own: it takes none of the features below.
CONTEXT = AttentionSupport()
ATTENTION_IMPLS = tuple(ATTENTION) + ("auto",)  # "auto": tfm.ops.select picks per call
CONTEXT_STRATEGIES = ("ring", "all_gather")  # tfm.ops.context


@dataclasses.dataclass(frozen=True)
class MoeSupport:
    """One MoE dispatch implementation: capacity (drops tokens past `capacity_factor` slots per
    expert), chunks (dispatches a device's tokens in `moe_chunks` sequential chunks)."""

    capacity: bool = False
    chunks: bool = False


MOE = {
    "ragged": MoeSupport(chunks=True),  # sort by expert + grouped matmuls: dropless
    "einsum": MoeSupport(capacity=True),  # one-hot dispatch into [B, E, C, D] expert slots
}


@dataclasses.dataclass(frozen=True)
class MixerSupport:
    """One way to run the linear-time token mixers (ModelConfig.mixer_pattern's Mamba, Mamba-2,
    gated DeltaNet, RWKV, RG-LRU): whether it is the parallel (training) form, and where it runs. Every form
    runs with the sequence split over `context` (tfm.ops.context_scan: each device's share from the state
    handed to it)."""

    parallel: bool = False
    platforms: Tuple[str, ...] = ("cpu", "gpu", "tpu")


MIXER = {
    # The recurrent form: one step per token in a lax.scan (decoding, and the reference).
    "reference": MixerSupport(),
    # The parallel form: chunked SSD, the chunked gated delta rule (WY form), chunked or associative
    # scans for the diagonal recurrences; execution.mixer_chunk_size tokens per chunk.
    "chunked": MixerSupport(parallel=True),
    # The Pallas kernels (tfm.kernels.ssd, tfm.kernels.delta_rule, tfm.kernels.kda: the chunked forms; linear_scan,
    # selective_scan, wkv: RG-LRU's, Mamba's and RWKV's recurrences; Mosaic on TPU, Triton on GPU, interpreted on
    # CPU), per device under shard_map (inside context_scan's over `context` when the sequence is
    # split). Not yet timed against "chunked": "auto" never picks it.
    "pallas": MixerSupport(parallel=True),
}
MIXER_IMPLS = tuple(MIXER) + ("auto",)  # "auto": chunked over a sequence, the recurrent step for one token


def mixer_impl(impl: str, length: int) -> str:
    """The concrete mixer form for `impl` over `length` new tokens: "auto" runs a single token (a
    decoding step) by the recurrent form, longer inputs by the parallel one."""
    if impl != "auto":
        return impl
    return "reference" if length == 1 else "chunked"


def call_features(*, dropout_rate: float = 0.0, bias: bool = False, positions_given: bool = False,
                  sparse: bool = False, softcap: Optional[float] = None, window: Optional[int] = None,
                  causal: bool = False, sinks: bool = False) -> dict:
    """{feature: used} of one attention call, from its arguments."""
    return dict(dropout=dropout_rate > 0.0, bias=bias, positions=positions_given, sparsity=sparse,
                softcap=softcap is not None, sinks=sinks, bidirectional_window=window is not None and not causal)


def supporting(**features: bool) -> list:
    """The concrete backends that support every feature asked for, in declaration order."""
    return [name for name, support in ATTENTION.items() if not support.missing(**features)]
