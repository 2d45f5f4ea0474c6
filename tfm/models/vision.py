"""Vision Transformers: ViT (Dosovitskiy et al. 2020) and Llama 3.2 Vision's tiled encoder.

images [B, H, W, C] (channels last; Hugging Face's pixel_values are [B, C, H, W]) are cut into
P = (H / p) * (W / p) square patches of p = config.patch_size pixels, projected to D by one
einsum (a stride-p convolution), prefixed with a learned [CLS] vector and added to learned
positions [1 + P, D]; then pre-norm Blocks and the final norm.

`TiledVisionEncoder` (config.multimodal.max_num_tiles > 0, HF's MllamaVisionModel) does this per
tile of each image, with tile-layout embeddings, and follows the local Blocks with gated global ones.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.inputs import BlockInputs
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init
from tfm.layers.norms import Norm
from tfm.layers.stack import Stack, remat_block
from tfm.models.outputs import VisionOutput


def num_patches(config: ModelConfig) -> int:
    return (config.image_size // config.patch_size) ** 2


def patchify(images, patch: int):
    """[B, H, W, C] -> [B, (H/p)*(W/p), p, p, C], patches in row-major order."""
    B, H, W, C = images.shape
    x = images.reshape(B, H // patch, patch, W // patch, patch, C)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(B, (H // patch) * (W // patch), patch, patch, C)


def embed_patches(config: ModelConfig, images, use_bias: bool):
    """images [B, H, W, C] -> [B, P, D]: each patch projected by `patch_embed` (a stride-p convolution)."""
    p, C, D, dt = config.patch_size, config.num_channels, config.d_model, compute_dtype(config)
    patches = patchify(images.astype(dt), p)  # [B, P, p, p, C]
    return Einsum("BPijC,ijCD->BPD", (p, p, C, D), (None, None, None, "embed"), ("embed",), use_bias=use_bias,
                  dtype=dt, name="patch_embed")(patches)


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
        x = embed_patches(cfg, images, use_bias=True)  # [B, P, D]
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


def tile_mask_padding(length: int) -> int:
    """Tokens per tile after padding 1 + P to a multiple of 8 (as Mllama does)."""
    return -(-length // 8) * 8


class TiledVisionEncoder(nn.Module):
    """Llama 3.2 Vision's image encoder (HF MllamaVisionModel), for config.multimodal.max_num_tiles = X.

    images [B, I, X, H, W, C] (I images of up to X tiles), aspect_ratio_ids [B, I] (the tile layout,
    1..max_aspect_ratio_id; 0 = no image), aspect_ratio_mask [B, I, X] (1 = a real tile) ->
    `VisionOutput` with hidden [B, I, X, 1 + P, D * (1 + n)]: the final features, then the outputs of
    the n local layers at config.multimodal.intermediate_layers (feature-interleaved, as HF stacks them).

    Per tile: patch embedding (no bias) + tanh-gated layout embedding `pre_tile`; [CLS]; positions
    (1 - tanh g) * `position` + tanh g * `tile_position` (per layout and tile); `pre_norm`. Tiles are
    padded to a multiple of 8 tokens and concatenated; a token sees every other unless both are
    padding (a padded position or a masked tile). Then config.num_layers Blocks, `post_norm`, a gated
    `post_tile` embedding, and num_global_layers gated Blocks (`global`).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, images, aspect_ratio_ids, aspect_ratio_mask, deterministic: bool = True):
        cfg, mm = self.config, self.config.multimodal
        size, C, D, X, R = cfg.image_size, cfg.num_channels, cfg.d_model, mm.max_num_tiles, mm.max_aspect_ratio_id
        if images.ndim != 6 or images.shape[2:] != (X, size, size, C):
            raise ValueError(f"images must be [batch, images, {X}, {size}, {size}, {C}] (ModelConfig.multimodal."
                             f"max_num_tiles, image_size, num_channels); got {images.shape}")
        B, I = images.shape[:2]
        L = 1 + num_patches(cfg)
        dt = compute_dtype(cfg)
        table = lambda name, shape, axes, init: self.param(name, param_init(init, axes), shape, jnp.float32)
        gate = lambda name: jnp.tanh(table(name, (), (), nn.initializers.zeros_init())).astype(dt)
        layout = lambda name, shape, axes: jnp.take(table(name, (R + 1,) + shape, (None,) + axes,
                                                          nn.initializers.normal(0.02)),
                                                    aspect_ratio_ids.reshape(B * I), axis=0).astype(dt)
        x = embed_patches(cfg, images.reshape(B * I * X, size, size, C), use_bias=False)
        x = x.reshape(B * I, X, L - 1, D)
        x = x + gate("pre_tile_gate") * layout("pre_tile", (X, D), (None, "embed"))[:, :, None]
        cls = table("cls", (D,), ("embed",), nn.initializers.normal(0.02)).astype(dt)
        x = jnp.concatenate([jnp.broadcast_to(cls, (B * I, X, 1, D)), x], axis=2)  # [BI, X, L, D]
        g = gate("position_gate")
        x = x + (1 - g) * table("position", (L, D), ("length", "embed"), nn.initializers.normal(0.02)).astype(dt)
        x = x + g * layout("tile_position", (X, L, D), (None, "length", "embed"))
        x = Norm(cfg, name="pre_norm")(x)
        Lp = tile_mask_padding(L)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, Lp - L), (0, 0))).reshape(B * I, X * Lp, D)
        real = aspect_ratio_mask.reshape(B * I, X, 1).astype(bool) & (jnp.arange(Lp) < L)
        real = real.reshape(B * I, X * Lp)
        inputs = BlockInputs(self_mask=real[:, :, None] | real[:, None, :])
        x = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(constrain(x, ("batch", "length", "embed")))
        block, kept = remat_block(cfg), []
        for i in range(cfg.num_layers):
            x, _ = block(cfg, layer_index=i, deterministic=deterministic, name=f"layer_{i}")(x, inputs)
            if i in mm.intermediate_layers:
                kept.append(x)
        x = Norm(cfg, name="post_norm")(x).reshape(B * I, X, Lp, D)
        x = x + gate("post_tile_gate") * layout("post_tile", (X, D), (None, "embed"))[:, :, None]
        x = Stack(cfg.replace(final_norm=False), mm.num_global_layers, gated=True, name="global")(
            x.reshape(B * I, X * Lp, D), inputs, deterministic)
        unpad = lambda h: h.reshape(B, I, X, Lp, -1)[:, :, :, :L]
        features = [unpad(x)]
        if kept:
            features.append(unpad(jnp.stack(kept, axis=-1).reshape(B * I, X * Lp, D * len(kept))))
        return VisionOutput(hidden=jnp.concatenate(features, axis=-1))
