"""Token, token-type and position embeddings; rotary position encoding."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfm.config import ModelConfig
from tfm.layers.common import compute_dtype, param_init


def check_token_ids(tokens, vocab_size: int, name: str = "token ids"):
    """Clear error for ids outside [0, V) when the ids are concrete (outside jit)."""
    try:
        ids = np.asarray(tokens)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced inside jit: `Embed` turns out-of-range ids into NaN rows instead
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} must lie in [0, {vocab_size}); got values in [{lo}, {hi}]")


class Embed(nn.Module):
    """Lookup [B, T] -> [B, T, D]; tied output layers read `embedding` [V, D] (tfm.models.embedding)."""

    num_embeddings: int
    features: int
    dtype: jnp.dtype = jnp.float32
    axes: tuple = ("vocab", "embed")
    stddev: float = 1.0

    def setup(self):
        self.embedding = self.param(
            "embedding", param_init(nn.initializers.normal(self.stddev), self.axes),
            (self.num_embeddings, self.features), jnp.float32)

    def __call__(self, ids):
        # jnp.take wraps negative ids to the end of the table (numpy indexing) and fills ids >= V
        # with NaN; moving negatives past the end too makes every out-of-range id embed as NaN.
        ids = jnp.where(ids < 0, self.num_embeddings, ids)
        return jnp.take(self.embedding, ids, axis=0, mode="fill", fill_value=jnp.nan).astype(self.dtype)


def sinusoidal_table(positions, features: int):
    """[..., T] int -> [..., T, D]: sin of every frequency, then cos (the tensor2tensor/Marian layout).

    Frequencies 1 / 10000^(2i / D) for i < D / 2.
    """
    inv_freq = 1.0 / (10_000.0 ** (jnp.arange(0, features, 2, dtype=jnp.float32) / features))
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class PositionEmbedding(nn.Module):
    """Absolute positions [B, T] -> [B, T, D] for config.position in {learned, sinusoidal}."""

    config: ModelConfig

    @nn.compact
    def __call__(self, positions):
        cfg = self.config
        if cfg.position == "sinusoidal":
            return sinusoidal_table(positions, cfg.d_model).astype(compute_dtype(cfg))
        table = self.param("embedding", param_init(nn.initializers.normal(0.02), ("length", "embed")),
                           (cfg.max_len, cfg.d_model), jnp.float32)
        return jnp.take(table, positions, axis=0).astype(compute_dtype(cfg))


def rope_frequencies(config: ModelConfig):
    """Inverse frequencies [H / 2] with the configured scaling."""
    H = config.head_size
    theta = config.rope_theta
    if config.rope_scaling == "ntk":  # NTK-aware: stretch the base, keep positions
        theta = theta * config.rope_scaling_factor ** (H / (H - 2))
    return 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))


def apply_rope(x, positions, config: ModelConfig):
    """Rotate halves (the Llama/GPT-NeoX layout): x [B, T, heads, H], positions [B, T]."""
    pos = positions.astype(jnp.float32)
    if config.rope_scaling == "linear":  # position interpolation
        pos = pos / config.rope_scaling_factor
    angles = pos[..., None] * rope_frequencies(config)  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
