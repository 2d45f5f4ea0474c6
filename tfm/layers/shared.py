"""Zamba's shared transformer blocks (ModelConfig.shared_block; mixer_pattern entries "shared>a"): one set of
parameters used at several layers, each use with its own LoRA adapters, output projection and decode cache.

The `Stack` owns the blocks' parameters (`shared_block_{b}`) and hands them to its layers in BlockInputs.shared
(a scan broadcasts them, so every repeat uses the same ones); a layer's use (`SharedUse`, params `shared`)
runs block `use % blocks` on its input with the adapters merged into the shared weights, W + A B for that use
(so gradients reach both), through `nn.map_variables`, which keeps the use's cache in the layer.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.attention import SelfAttention
from tfm.layers.common import Einsum, compute_dtype, param_init
from tfm.layers.feedforward import Mlp
from tfm.layers.inputs import BlockInputs
from tfm.layers.norms import Norm
from tfm.layers.slot import TokenMixer, register_mixer

# What shared_block.lora names -> the block's projections it adapts (module, projection), one `a` for them all
# (ffn: the gate and up projections of a gated feed-forward, as Zamba2's one adapter on its fused gate_up_proj).
TARGETS = {"query": (("self_attn", "query"),), "key": (("self_attn", "key"),), "value": (("self_attn", "value"),),
           "ffn": (("ffn", "wi_gate"), ("ffn", "wi_up"), ("ffn", "wi"))}
OUT_AXES = {"query": ("heads", "head_dim"), "key": ("kv_heads", "head_dim"), "value": ("kv_heads", "head_dim"),
            "wi_gate": ("mlp",), "wi_up": ("mlp",), "wi": ("mlp",)}


def block_width(config: ModelConfig) -> int:
    """The width a shared block reads: 2D with the embeddings concatenated, else D."""
    return 2 * config.d_model if config.shared_block.embeddings else config.d_model


class SharedBlock(nn.Module):
    """One shared block: h [B, T, W] -> [B, T, D]; attention (`attn_norm`, `self_attn`: W in, D out) then a
    feed-forward (`ffn_norm`, `ffn`), without residuals (W = block_width)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, h, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        cfg = self.config
        wide = cfg.replace(d_model=h.shape[-1]) if h.shape[-1] != cfg.d_model else cfg
        h = Norm(cfg, name="attn_norm")(h)
        h = SelfAttention(wide, causal=True, out_features=cfg.d_model, name="self_attn")(h, inputs, deterministic,
                                                                                          decode)
        h = Norm(cfg, name="ffn_norm")(h)
        d_ff = cfg.shared_block.d_ff
        return Mlp(cfg.replace(d_ff=d_ff) if d_ff else cfg, name="ffn")(h, deterministic)


class SharedUse(TokenMixer):
    """A layer's use of a shared block (kind "shared", a feeder: "shared>a" adds its output to a's input):
    x [B, T, D] -> out(block(concat[x, embeddings])) [B, T, D], `out` this use's [D, D] projection, the block's
    projections named in shared_block.lora adapted by this use's LoRA (`_adapted`; b zero at init: a fresh use
    starts as the shared block)."""

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        cfg, sb = self.config, self.config.shared_block
        if inputs.shared is None:
            raise ValueError("a 'shared' mixer reads its block's parameters from the Stack (BlockInputs.shared); "
                             "run it inside a tfm Stack")
        h = jnp.concatenate([x, inputs.embeddings.astype(x.dtype)], -1) if sb.embeddings else x
        params = self._adapted(inputs.shared[cfg.shared_use(self.layer_index) % sb.blocks])
        block = nn.map_variables(SharedBlock, "params", trans_in_fn=lambda _: {"params": params}, mutable=False)
        t = block(cfg, name="block")(h, inputs, deterministic, decode)
        return Einsum("BTD,DE->BTE", (cfg.d_model, cfg.d_model), ("embed", "mlp"), dtype=compute_dtype(cfg),
                      name="out")(t)

    def _adapted(self, params: dict) -> dict:
        """The block's params with this use's adapters merged: kernel + a @ b for each adapted projection
        (`lora_{name}_a` [in, r] per shared_block.lora name, `lora_{projection}_b` [r, out...] per projection)."""
        sb = self.config.shared_block
        if not sb.lora_rank:
            return params
        params = {name: dict(sub) for name, sub in params.items()}
        for name in sb.lora:
            projections = [(m, p) for m, p in TARGETS[name] if p in params[m]]
            fan_in = params[projections[0][0]][projections[0][1]]["kernel"].shape[0]
            a = self.param(f"lora_{name}_a", param_init(nn.initializers.lecun_normal(), ("embed", None)),
                           (fan_in, sb.lora_rank), jnp.float32)
            for module, proj in projections:
                kernel = params[module][proj]["kernel"]  # [in, out...]
                b = self.param(f"lora_{proj}_b", param_init(nn.initializers.zeros_init(), (None,) + OUT_AXES[proj]),
                               (sb.lora_rank,) + kernel.shape[1:], jnp.float32)
                params[module][proj] = dict(params[module][proj], kernel=kernel + jnp.tensordot(a, b, 1))
        return params


register_mixer("shared", SharedUse, name="shared", norm="shared")
