"""A stack of Blocks: loop or scan over layers, optional remat, final norm."""
from __future__ import annotations

import functools
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.block import Block
from tfm.layers.inputs import BlockInputs
from tfm.layers.positions import RelativePositionBias
from tfm.layers.shared import SharedBlock, block_width
from tfm.layers.norms import Norm

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_block(config: ModelConfig):
    """Block, or Block under config.execution.remat_policy."""
    if config.execution.remat_policy == "none":
        return Block
    return nn.remat(Block, policy=REMAT_POLICIES[config.execution.remat_policy], prevent_cse=not config.execution.scan_layers)


class Stack(nn.Module):
    """num_layers Blocks: [B, T, D] -> [B, T, D]. Scanned layers are stacked on a leading
    "layers" axis (params `layers/...`); looped layers are `layer_0`, `layer_1`, ...
    With an attention_pattern of period P > 1 a scanned stack repeats a `BlockGroup` of P layers
    num_layers / P times (params `layers/layer_0..layer_{P-1}/...`, each stacked on axis 0).
    With position="relative" the stack owns one `relative_bias` table that all its layers use; with shared
    blocks (mixer_pattern entries "shared>a") it owns their params `shared_block_{b}` (tfm.layers.shared).
    A MoE model's first config.dense_layers layers (dense feed-forward) stay `layer_i` when scanning."""

    config: ModelConfig
    num_layers: int
    causal: bool = False
    cross: bool = False
    gated: bool = False  # tanh-gated Blocks (see Block)

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        cfg = self.config
        block = remat_block(cfg)
        kw = dict(causal=self.causal, cross=self.cross, deterministic=deterministic, decode=decode, gated=self.gated)
        period = cfg.pattern_period
        if cfg.position == "relative":
            table = RelativePositionBias(cfg, bidirectional=not self.causal, name="relative_bias")()
            inputs = inputs.replace(relative_table=table)
        if "shared" in cfg.mixers_used:
            inputs = self._shared_blocks(x, inputs)
        dense = cfg.dense_layers  # a MoE model's first, dense layers (0 without experts): never scanned
        for i in range(dense if cfg.execution.scan_layers else self.num_layers):
            x, _ = block(cfg, layer_index=i, dense_ffn=i < dense, name=f"layer_{i}", **kw)(x, inputs)
        if cfg.execution.scan_layers:
            unit = block if period == 1 else functools.partial(BlockGroup, block=block)
            scanned = nn.scan(
                unit, variable_axes={"params": 0, "cache": 0, "losses": 0}, split_rngs={"params": True, "dropout": True},
                in_axes=nn.broadcast, length=(self.num_layers - dense) // period,
                metadata_params={nn.PARTITION_NAME: "layers"})
            x, _ = scanned(cfg, name="layers", **kw)(x, inputs)
        if cfg.norm_position != "post" and cfg.final_norm:
            x = Norm(cfg, name="final_norm")(x)
        return x

    def _shared_blocks(self, x, inputs: BlockInputs) -> BlockInputs:
        """inputs with the stack's input x [B, T, D] as `embeddings` and the params of its shared blocks
        `shared_block_{b}` (tfm.layers.shared), made at init by running each once."""
        cfg = self.config
        blocks = [SharedBlock(cfg, name=f"shared_block_{b}") for b in range(cfg.shared_block.blocks)]
        if self.is_initializing():
            h = jnp.zeros(x.shape[:2] + (block_width(cfg),), x.dtype)
            for block in blocks:
                block(h, inputs.replace(embeddings=x))
        return inputs.replace(embeddings=x, shared=tuple(nn.meta.unbox(b.variables["params"]) for b in blocks))


class BlockGroup(nn.Module):
    """One period of config.attention_pattern: Blocks `layer_0`..`layer_{P-1}` in order, each of its
    kind; (x, inputs) -> (x, None) like a Block, so a scan can repeat it."""

    config: ModelConfig
    block: Callable = Block
    causal: bool = False
    cross: bool = False
    deterministic: bool = True
    decode: bool = False
    gated: bool = False

    @nn.compact
    def __call__(self, x, inputs: BlockInputs):
        kw = dict(causal=self.causal, cross=self.cross, deterministic=self.deterministic, decode=self.decode,
                  gated=self.gated)
        for j in range(self.config.pattern_period):
            x, _ = self.block(self.config, layer_index=j, name=f"layer_{j}", **kw)(x, inputs)
        return x, None
