"""Vision Transformer (Dosovitskiy et al. 2020): images -> patches -> the encoder `Stack`.

images [B, H, W, C] (channels last; Hugging Face's pixel_values are [B, C, H, W]) are cut into
P = (H / p) * (W / p) square patches of p = config.patch_size pixels, projected to D by one
einsum (a stride-p convolution), prefixed with a learned [CLS] vector and added to learned
positions [1 + P, D]; then pre-norm Blocks and the final norm.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.block import BlockInputs
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init
from tfm.layers.stack import Stack
from tfm.models.outputs import VisionOutput


def num_patches(config: ModelConfig) -> int:
    return (config.image_size // config.patch_size) ** 2


def patchify(images, patch: int):
    """[B, H, W, C] -> [B, (H/p)*(W/p), p, p, C], patches in row-major order."""
    B, H, W, C = images.shape
    x = images.reshape(B, H // patch, patch, W // patch, patch, C)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(B, (H // patch) * (W // patch), patch, patch, C)


class VisionEncoder(nn.Module):
    """images [B, H, W, C] -> `VisionOutput`: hidden [B, 1 + P, D], and per config.heads (else
    None): pooled [B, D] ("pooler": tanh(dense(hidden[:, 0])), ViTModel), logits [B, num_labels]
    ("classification": a dense layer on the final-normed [CLS] state, ViTForImageClassification)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, images, deterministic: bool = True):
        cfg = self.config
        size, p, C, D = cfg.image_size, cfg.patch_size, cfg.num_channels, cfg.d_model
        if images.ndim != 4 or images.shape[1:] != (size, size, C):
            raise ValueError(f"images must be [batch, {size}, {size}, {C}] (ModelConfig.image_size, num_channels); "
                             f"got {images.shape}")
        dt = compute_dtype(cfg)
        patches = patchify(images.astype(dt), p)  # [B, P, p, p, C]
        x = Einsum("BPijC,ijCD->BPD", (p, p, C, D), (None, None, None, "embed"), ("embed",), use_bias=True,
                   dtype=dt, name="patch_embed")(patches)
        cls = self.param("cls", param_init(nn.initializers.zeros_init(), ("embed",)), (D,), jnp.float32)
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(dt), (x.shape[0], 1, D)), x], axis=1)
        table = self.param("position", param_init(nn.initializers.normal(0.02), ("length", "embed")),
                           (1 + num_patches(cfg), D), jnp.float32)
        x = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(x + table.astype(dt))
        x = constrain(x, ("batch", "length", "embed"))
        hidden = Stack(cfg, cfg.num_layers, name="encoder")(x, BlockInputs(), deterministic)
        dense = lambda n, name: Einsum("BD,DO->BO", (D, n), ("embed", None), (None,), use_bias=True, dtype=dt,
                                       name=name)
        pooled = logits = None
        if "pooler" in cfg.heads:
            pooled = jnp.tanh(dense(D, "pooler")(hidden[:, 0]))
        if "classification" in cfg.heads:
            logits = dense(cfg.num_labels, "classifier")(hidden[:, 0]).astype(jnp.float32)
        return VisionOutput(hidden=hidden, pooled=pooled, logits=logits)
