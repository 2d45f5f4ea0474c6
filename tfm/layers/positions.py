"""Positions: absolute (learned or sinusoidal tables), rotary (RoPE and its scalings) and
relative (T5 buckets); RoBERTa's padding-aware positions."""
from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from tfm.config import ModelConfig
from tfm.layers.common import compute_dtype, param_init
from tfm.layers.embeddings import take_rows


def sinusoidal_table(positions, features: int):
    """[..., T] int -> [..., T, D]: sin of every frequency, then cos (the tensor2tensor/Marian layout).

    Frequencies 1 / 10000^(2i / D) for i < D / 2.
    """
    inv_freq = 1.0 / (10_000.0 ** (jnp.arange(0, features, 2, dtype=jnp.float32) / features))
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class PositionEmbedding(nn.Module):
    """Absolute positions [B, T] -> [B, T, D] for config.position in {learned, sinusoidal}; a
    learned table [max_len, D] is read at row position + config.position_offset (a row outside
    the table gives NaN, never another row)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, positions):
        cfg = self.config
        if cfg.position == "sinusoidal":
            return sinusoidal_table(positions, cfg.d_model).astype(compute_dtype(cfg))
        table = self.param("embedding", param_init(nn.initializers.normal(0.02), ("length", "embed")),
                           (cfg.max_len, cfg.d_model), jnp.float32)
        return take_rows(table, positions + cfg.position_offset).astype(compute_dtype(cfg))


def rope_frequencies(config: ModelConfig, max_position=None):
    """Inverse frequencies [R / 2] of the rotated dims R = config.rope.dim under config.rope.scaling,
    as Hugging Face's rope init functions compute them. max_position (may be traced): the largest
    position of the call, which "dynamic" NTK scaling stretches the base for. That makes "dynamic"
    a function of each call (as HF's is of each forward): past rope.original_max_len, a cached
    decoding step rotates its query and key with its own stretch, the full forward with the last's."""
    R, factor, theta = config.rope.dim, config.rope.factor, config.rope.theta
    kind, original = config.rope.scaling, config.rope.original_max_len
    if kind == "ntk":  # NTK-aware: stretch the base, keep positions
        theta = theta * factor ** (R / (R - 2))
    if kind == "dynamic":  # NTK with the stretch growing past the original length
        length = jnp.maximum(max_position + 1, original).astype(jnp.float32)
        theta = theta * (factor * length / original - (factor - 1)) ** (R / (R - 2))
    inv_freq = 1.0 / (theta ** (jnp.arange(0, R, 2, dtype=jnp.float32) / R))
    if kind == "linear":  # position interpolation
        inv_freq = inv_freq / factor
    elif kind == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, config)
    elif kind == "yarn":
        inv_freq = _yarn_frequencies(inv_freq, config)
    return inv_freq


def _llama3_frequencies(inv_freq, config: ModelConfig):
    """Llama 3.1: wavelengths beyond original / low_freq_factor are interpolated (/ factor), those
    below original / high_freq_factor kept, the band between blended linearly in original / wavelength."""
    factor, low, high = config.rope.factor, config.rope.low_freq_factor, config.rope.high_freq_factor
    original = config.rope.original_max_len
    wavelength = 2 * np.pi / inv_freq
    scaled = jnp.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / max(high - low, 1e-9)  # high == low (Llama 4 Scout): no band between
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return jnp.where(medium, blended, scaled)


def _yarn_frequencies(inv_freq, config: ModelConfig):
    """YaRN (Peng et al. 2023): interpolated frequencies (/ factor) below the dims that turn
    beta_slow times over the original length, original ones above beta_fast turns, a linear ramp between."""
    R, base, original = config.rope.dim, config.rope.theta, config.rope.original_max_len

    def dim_of(turns):  # the dim whose frequency turns `turns` times over the original length
        return R * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(config.rope.beta_fast), dim_of(config.rope.beta_slow)
    if config.rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001
    ramp = jnp.clip((jnp.arange(R // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return inv_freq / config.rope.factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: yarn's rope.attention_factor (None = 0.1 ln(factor) + 1), else 1."""
    if config.rope.scaling != "yarn":
        return 1.0
    if config.rope.attention_factor is not None:
        return config.rope.attention_factor
    factor = config.rope.factor
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def apply_rope(x, positions, config: ModelConfig):
    """Rotary positions on the first config.rope.dim dims of each head (the rest pass through):
    halves rotated together (Llama / GPT-NeoX) or adjacent pairs (GPT-J, rope.interleaved).
    x [B, T, heads, H], positions [B, T]."""
    R = config.rope.dim
    pos = positions.astype(jnp.float32)
    inv_freq = rope_frequencies(config, jnp.max(positions) if config.rope.scaling == "dynamic" else None)
    angles = pos[..., None] * inv_freq  # [B, T, R/2]
    factor = rope_attention_factor(config)
    cos = (jnp.cos(angles) * factor)[:, :, None, :]
    sin = (jnp.sin(angles) * factor)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    rot, rest = x32[..., :R], x32[..., R:]
    if config.rope.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = jnp.split(rot, 2, axis=-1)
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated, rest], axis=-1).astype(x.dtype)


def relative_position_bucket(distance, *, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5's bucket of each key-minus-query distance (int array -> int32 array of the same shape).

    Bidirectional: half the buckets for keys after the query. Within a half, distances below
    half its buckets get one bucket each; larger ones share log-spaced buckets up to
    max_distance, and everything beyond falls into the last. Causal: keys after the query are
    treated as distance 0.
    """
    bucket = jnp.zeros_like(distance, jnp.int32)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (distance > 0).astype(jnp.int32) * num_buckets
        distance = jnp.abs(distance)
    else:
        distance = -jnp.minimum(distance, 0)
    max_exact = num_buckets // 2
    safe = jnp.maximum(distance, 1).astype(jnp.float32)
    log_bucket = max_exact + (jnp.log(safe / max_exact) / np.log(max_distance / max_exact)
                              * (num_buckets - max_exact)).astype(jnp.int32)
    log_bucket = jnp.minimum(log_bucket, num_buckets - 1)
    return bucket + jnp.where(distance < max_exact, distance, log_bucket).astype(jnp.int32)


class RelativePositionBias(nn.Module):
    """T5 relative position bias: the per-head table `embedding` [relative_buckets, N], shared by
    every layer of one stack; bias(q_pos [B|1, T], kv_pos [B|1, S]) -> fp32 [B|1, N, T, S]."""

    config: ModelConfig
    bidirectional: bool

    def setup(self):
        cfg = self.config
        self.embedding = self.param("embedding", param_init(nn.initializers.normal(0.02), (None, "heads")),
                                    (cfg.relative_buckets, cfg.num_heads), jnp.float32)

    def __call__(self):
        """The table itself (handed to the layers, which index it by their own positions)."""
        return self.embedding


def relative_bias(table, q_pos, kv_pos, config: ModelConfig, bidirectional: bool):
    """table [buckets, N] at the buckets of kv_pos - q_pos -> fp32 bias [B|1, N, T, S]."""
    distance = kv_pos[:, None, :] - q_pos[:, :, None]  # [B, T, S]
    bucket = relative_position_bucket(distance, bidirectional=bidirectional, num_buckets=config.relative_buckets,
                                      max_distance=config.relative_max_distance)
    return jnp.moveaxis(jnp.take(table.astype(jnp.float32), bucket, axis=0), -1, 1)


def padding_positions(tokens, pad_id: int):
    """RoBERTa's positions: the count of non-pad tokens before each (0-based); pad tokens get -1."""
    real = (tokens != pad_id).astype(jnp.int32)
    return jnp.cumsum(real, axis=1) * real - 1
