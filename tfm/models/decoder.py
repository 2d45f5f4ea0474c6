"""Decoder-only language model (GPT-2 and Llama styles), with GPT-1's optional classification head."""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.inputs import BlockInputs
from tfm.layers.common import Einsum, compute_dtype
from tfm.layers.stack import Stack
from tfm.models.embedding import (DecodePosition, InputEmbedding, OutputLogits, check_inputs,
                                  default_positions, token_embed)


class DecoderLM(nn.Module):
    """tokens [B, T] -> `LMOutput` with logits [B, T, V] (fp32), causal.

    segment_ids [B, T] pack several sequences per row (0 = padding); positions [B, T] default
    to arange (per-segment positions come from the data pipeline). decode=True runs on the KV
    cache (see `tfm.decode`). logits=False sets the output's `unembedding` (final hidden states
    [B, T, D] and the output projection) instead of its logits, for `fused_cross_entropy`.

    With "classification" in config.heads (GPT-1's supervised head W_y) the output's cls_logits
    [B, num_labels] fp32 are read from the final hidden state at cls_positions [B] (default: the
    last position, T - 1); in decode mode they stay None.

    With config.multimodal.cross_attention_layers (Llama 3.2 Vision's text model) those layers
    attend to memory [B, S, D] (projected image features), through memory_mask [B, T, M] (which of
    M equal runs of the memory, the image tiles, each token sees; None = all). Without memory they
    are skipped. In decode mode the cache holds the memory's keys and values, projected once when
    the cache is made: pass memory then, and memory_mask (the new tokens' rows) on every step.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None, cls_positions=None, memory=None, memory_mask=None,
                 deterministic: bool = True, decode: bool = False, logits: bool = True):
        cfg = self.config
        check_inputs(cfg, tokens, segment_ids=segment_ids, positions=positions)
        if (memory is not None or memory_mask is not None) and not cfg.multimodal.cross_attention_layers:
            raise ValueError("DecoderLM got memory / memory_mask but ModelConfig.multimodal.cross_attention_layers "
                             "is empty: no layer would read them")
        start = DecodePosition(name="decode_position")(tokens.shape[1]) if decode else None
        positions = default_positions(tokens, positions, start)
        embed = token_embed(cfg, "embed")
        x = InputEmbedding(cfg, embed, name="input")(tokens, positions, deterministic=deterministic)
        x = Stack(cfg, cfg.num_layers, causal=True, name="decoder")(
            x, BlockInputs(segment_ids=segment_ids, positions=positions, memory=memory, memory_mask=memory_mask),
            deterministic, decode)
        out = OutputLogits(cfg, embed, name="output")(x, logits)  # LMOutput
        if "classification" not in cfg.heads or decode:
            return out
        return out.replace(cls_logits=ClassificationHead(cfg, name="classifier")(x, cls_positions, deterministic))


class ClassificationHead(nn.Module):
    """hidden [B, T, D] at cls_positions [B] (default T - 1) -> dropout -> dense -> fp32 [B, num_labels]."""

    config: ModelConfig

    @nn.compact
    def __call__(self, hidden, cls_positions=None, deterministic: bool = True):
        cfg = self.config
        B, T = hidden.shape[:2]
        if cls_positions is None:
            cls_positions = jnp.full((B,), T - 1, jnp.int32)
        cls_positions = jnp.where(cls_positions < 0, T, cls_positions)  # out of range -> NaN row, never wrapped
        h = jnp.take_along_axis(hidden, cls_positions[:, None, None], axis=1, mode="fill", fill_value=jnp.nan)[:, 0]
        h = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(h)
        dense = Einsum("BD,DO->BO", (cfg.d_model, cfg.num_labels), ("embed", None), (None,), use_bias=True,
                       dtype=compute_dtype(cfg), name="dense")
        return dense(h).astype(jnp.float32)
