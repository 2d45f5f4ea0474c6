"""What the models return: one flax.struct dataclass per model class, whatever its flags.

A head that a config leaves out, or an output a call did not ask for, is None; the type never
changes. They are pytrees, so they pass through `jit`, `eval_shape` and `jax.tree.map`.

  LMOutput        DecoderLM, EncoderDecoder
  EncoderOutput   EncoderModel (BERT family: pretraining, classification, span, embeddings)
  VisionOutput    VisionEncoder (ViT), TiledVisionEncoder (Llama 3.2 Vision)
  Unembedding     the output layer before its matmul, for `fused_cross_entropy`
"""
from __future__ import annotations

from typing import Any, Optional

from flax import struct
import jax.numpy as jnp

Array = jnp.ndarray


@struct.dataclass
class Unembedding:
    """The output layer before its matmul: logits [B, T, V] = fp32(hidden · kernelᵀ in
    `dtype`) + bias. Losses that never hold the whole logits take this instead
    (`tfm.train.losses.fused_cross_entropy`).

    hidden [B, T, D], kernel [V, D] (the tied embedding, or the transposed `lm_head`),
    bias [V] or None. block_size: `logits` multiplies by the kernel padded with zero rows to a
    multiple of it (ExecutionConfig.logits_block_size), then drops the padding columns.
    """

    hidden: jnp.ndarray
    kernel: jnp.ndarray
    bias: Optional[jnp.ndarray]
    dtype: Any = struct.field(pytree_node=False)
    block_size: int = struct.field(pytree_node=False, default=1)

    def logits(self):
        """fp32 logits [B, T, V]."""
        kernel = self.kernel.astype(self.dtype)
        vocab = kernel.shape[0]
        padding = -vocab % self.block_size
        if padding:
            kernel = jnp.pad(kernel, ((0, padding), (0, 0)))
        logits = jnp.einsum("BTD,VD->BTV", self.hidden.astype(self.dtype), kernel)[..., :vocab]
        logits = logits.astype(jnp.float32)
        return logits if self.bias is None else logits + self.bias


@struct.dataclass
class LMOutput:
    """logits [B, T, V] fp32 (None when called with logits=False); unembedding: the output
    layer before its matmul (only with logits=False, for `fused_cross_entropy`); cls_logits
    [B, num_labels] fp32 (DecoderLM with the "classification" head, outside decode mode)."""

    logits: Optional[Array] = None
    unembedding: Optional[Unembedding] = None
    cls_logits: Optional[Array] = None


@struct.dataclass
class EncoderOutput:
    """hidden [B, T, D] always; the rest per config.heads, else None:
    pooled [B, D] ("pooler", and the heads that read it: "nsp", "classification", "regression");
    embedding [B, D] ("mean_pool": L2-normalised mean over non-padding tokens);
    mlm_logits [B, P, V] ("mlm"; at mlm_positions [B, P], else [B, T, V]; None with logits=False,
    which sets mlm_unembedding instead); nsp_logits [B, 2]; logits [B, num_labels]
    ("classification"); score [B] ("regression"); start_logits, end_logits [B, T] ("span")."""

    hidden: Array
    pooled: Optional[Array] = None
    embedding: Optional[Array] = None
    mlm_logits: Optional[Array] = None
    mlm_unembedding: Optional[Unembedding] = None
    nsp_logits: Optional[Array] = None
    logits: Optional[Array] = None
    score: Optional[Array] = None
    start_logits: Optional[Array] = None
    end_logits: Optional[Array] = None


@struct.dataclass
class VisionOutput:
    """hidden [B, 1 + P, D] (TiledVisionEncoder: [B, I, X, 1 + P, D * (1 + n)], see there); pooled [B, D]
    ("pooler"); logits [B, num_labels] ("classification")."""

    hidden: Array
    pooled: Optional[Array] = None
    logits: Optional[Array] = None
