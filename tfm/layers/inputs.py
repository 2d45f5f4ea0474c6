"""What a layer reads besides its input: `BlockInputs`."""
from __future__ import annotations

from typing import Optional

from flax import struct
import jax.numpy as jnp


@struct.dataclass
class BlockInputs:
    """What a Block reads besides x, each optional: segment_ids [B, T] and positions [B, T] of the
    queries; memory [B, S, D] and memory_segment_ids [B, S] for cross-attention; relative_table
    [buckets, N] (T5's bias, set by the `Stack` and shared by its layers); memory_mask [B, T, M]
    (gated cross-attention layers): whether each query sees each of M equal runs of the memory (the
    image tiles); self_mask [B, T, T] bool: which keys each query sees in self-attention, on top of
    the segment ids (Mllama's tiled vision encoder, whose padding rule they cannot describe); embeddings
    [B, T, D] (the stack's input) and shared (one param tree per shared block, tfm.layers.shared), both set
    by the `Stack` for its shared-block uses. A pytree, so a scan broadcasts it to every layer."""

    segment_ids: Optional[jnp.ndarray] = None
    positions: Optional[jnp.ndarray] = None
    memory: Optional[jnp.ndarray] = None
    memory_segment_ids: Optional[jnp.ndarray] = None
    relative_table: Optional[jnp.ndarray] = None
    memory_mask: Optional[jnp.ndarray] = None
    self_mask: Optional[jnp.ndarray] = None
    embeddings: Optional[jnp.ndarray] = None
    shared: Optional[tuple] = None
