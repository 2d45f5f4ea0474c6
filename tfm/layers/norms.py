"""LayerNorm (with or without bias) and RMSNorm, computed in float32 and returned in the computation dtype."""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.common import compute_dtype, param_init


class Norm(nn.Module):
    """config.norm over the last axis: [..., D] -> [..., D]; its parameters carry the logical name `axis`.
    The normalised x is multiplied by config.norm_scale_offset + `scale` (scales initialised to 1 - offset)."""

    config: ModelConfig
    axis: str = "embed"

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        D = x.shape[-1]
        x32 = x.astype(jnp.float32)
        offset = cfg.norm_scale_offset
        scale = offset + self.param("scale", param_init(nn.initializers.constant(1.0 - offset), (self.axis,)), (D,),
                                    jnp.float32)
        if cfg.norm == "rmsnorm":
            y = x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, -1, keepdims=True) + cfg.norm_eps))
            y = y * scale
        else:
            mean = x32.mean(-1, keepdims=True)
            var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
            y = (x32 - mean) * jnp.reciprocal(jnp.sqrt(var + cfg.norm_eps)) * scale
            if cfg.norm_bias:
                y = y + self.param("bias", param_init(nn.initializers.zeros_init(), (self.axis,)), (D,), jnp.float32)
        return y.astype(compute_dtype(cfg))
