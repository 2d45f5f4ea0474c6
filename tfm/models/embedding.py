"""Input embedding shared by the families: tokens (+ types) (+ absolute positions) -> [B, T, D]."""
from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.common import compute_dtype, constrain, param_init, scaled
from tfm.layers.embeddings import Embed, check_token_ids
from tfm.layers.positions import PositionEmbedding
from tfm.layers.norms import Norm
from tfm.parallel.mesh import current_platform
from tfm.models.outputs import LMOutput, Unembedding  # noqa: F401  (Unembedding: re-exported)


def token_embed(config: ModelConfig, name: str) -> Embed:
    stddev = config.d_model ** -0.5 if config.scale_embeddings else 0.02
    rows = config.vocab_size + config.multimodal.extra_tokens
    return Embed(rows, config.d_model, dtype=compute_dtype(config), stddev=stddev,
                 lookup=config.execution.embedding_impl, name=name)


def check_inputs(config: ModelConfig, tokens, name: str = "tokens", **same_shape):
    """Clear errors for bad token ids, lengths beyond learned positions and mismatched shapes."""
    if tokens.ndim != 2:
        raise ValueError(f"{name} must be [batch, length]; got shape {tokens.shape}")
    check_token_ids(tokens, config.vocab_size + config.multimodal.extra_tokens, name)
    longest = config.max_len - config.position_offset
    if config.position == "learned" and tokens.shape[1] > longest:
        offset = f" less position_offset={config.position_offset}" if config.position_offset else ""
        raise ValueError(f"{name} length {tokens.shape[1]} exceeds max_len={config.max_len}{offset} "
                         f"of the learned position table")
    for other, value in same_shape.items():
        if value is not None and value.shape != tokens.shape:
            raise ValueError(f"{other} shape {value.shape} does not match {name} shape {tokens.shape}")


class DecodePosition(nn.Module):
    """Start position of the next decode step, kept in `cache/index` (advanced by T per call)."""

    @nn.compact
    def __call__(self, length: int):
        creating = not self.has_variable("cache", "index")
        index = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        start = index.value
        if not creating:
            index.value = start + length
        return start


class InputEmbedding(nn.Module):
    """tokens [B, T] -> [B, T, D]: embed * (sqrt(D)) + types + absolute positions, norm, dropout.

    `embed` is passed in so that one matrix can serve encoder, decoder and output.
    """

    config: ModelConfig
    embed: Embed

    @nn.compact
    def __call__(self, tokens, positions, token_type_ids: Optional[jnp.ndarray] = None,
                 deterministic: bool = True):
        cfg = self.config
        x = self.embed(tokens)
        if cfg.scale_embeddings:
            x = x * jnp.asarray(cfg.d_model ** 0.5, cfg.embedding_scale_rounding or jnp.float32).astype(x.dtype)
        x = scaled(x, cfg.embedding_multiplier)
        if cfg.position in ("learned", "sinusoidal"):
            x = x + PositionEmbedding(cfg, name="position")(positions)
        if cfg.type_vocab_size:
            if token_type_ids is None:
                token_type_ids = jnp.zeros_like(tokens)
            types = Embed(cfg.type_vocab_size, cfg.d_model, dtype=x.dtype, stddev=0.02,
                          axes=(None, "embed"), name="token_type")
            x = x + types(token_type_ids)
        if cfg.embedding_norm:
            x = Norm(cfg, name="norm")(x)
        x = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(x)
        return constrain(x, ("batch", "length", "embed"))


class _OutputKernel(nn.Module):
    """The untied output projection's weight [D, V] (`lm_head/kernel`)."""

    config: ModelConfig

    @nn.compact
    def __call__(self):
        cfg = self.config
        init = param_init(nn.initializers.normal(cfg.d_model ** -0.5), ("embed", "vocab"))
        return self.param("kernel", init, (cfg.d_model, cfg.vocab_size), jnp.float32)


def logits_block_size(cfg: ModelConfig) -> int:
    """ExecutionConfig.logits_block_size, its None resolved for the current mesh's platform."""
    block = cfg.execution.logits_block_size
    return block if block is not None else 128 if current_platform() == "gpu" else 1


class OutputLogits(nn.Module):
    """[B, T, D] -> `LMOutput` with fp32 logits [B, T, V]: tied to `embed` or its own
    projection, optional bias, soft-capped by config.final_logit_softcap.

    With logits=False the output holds the `Unembedding` (hidden states and projection) instead
    of the logits.
    """

    config: ModelConfig
    embed: Embed

    @nn.compact
    def __call__(self, x, logits: bool = True):
        cfg = self.config
        kernel = self.embed.embedding if cfg.tie_embeddings else _OutputKernel(cfg, name="lm_head")().T
        if cfg.rescale_tied_output:
            x = x * jnp.asarray(cfg.d_model ** -0.5, x.dtype)
        x = scaled(x, cfg.logits_multiplier)
        bias = None
        if cfg.output_bias:
            bias = self.param("bias", param_init(nn.initializers.zeros_init(), ("vocab",)),
                              (cfg.vocab_size,), jnp.float32)
        head = Unembedding(x, kernel, bias, compute_dtype(cfg), logits_block_size(cfg))
        cap = cfg.final_logit_softcap
        if not logits:
            if cap is not None:
                raise ValueError(f"ModelConfig.final_logit_softcap={cap}: the fused loss reads the unembedding's "
                                 f"uncapped logits; train with the task's vocab_chunk=None")
            return LMOutput(unembedding=head)
        out = head.logits() if cap is None else cap * jnp.tanh(head.logits() / cap)
        return LMOutput(logits=constrain(out, ("batch", "length", "vocab")))


def default_positions(tokens, positions, decode_start=None):
    """positions [B, T]: given, or arange (offset by the decode start)."""
    if positions is not None:
        return positions
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    if decode_start is not None:
        pos = pos + decode_start
    return jnp.broadcast_to(pos, tokens.shape)
