"""Decoder-only language model (GPT-2 and Llama styles)."""
from __future__ import annotations

import flax.linen as nn

from tfm.config import ModelConfig
from tfm.layers.stack import Stack
from tfm.models.embedding import (DecodePosition, InputEmbedding, OutputLogits, check_inputs,
                                  default_positions, token_embed)


class DecoderLM(nn.Module):
    """tokens [B, T] -> logits [B, T, V] (fp32), causal.

    segment_ids [B, T] pack several sequences per row (0 = padding); positions [B, T] default
    to arange (per-segment positions come from the data pipeline). decode=True runs on the KV
    cache (see `tfm.decode`). logits=False returns the `Unembedding` (final hidden states
    [B, T, D] and the output projection) instead, for `fused_cross_entropy`.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None, deterministic: bool = True,
                 decode: bool = False, logits: bool = True):
        cfg = self.config
        check_inputs(cfg, tokens, segment_ids=segment_ids, positions=positions)
        start = DecodePosition(name="decode_position")(tokens.shape[1]) if decode else None
        positions = default_positions(tokens, positions, start)
        embed = token_embed(cfg, "embed")
        x = InputEmbedding(cfg, embed, name="input")(tokens, positions, deterministic=deterministic)
        x = Stack(cfg, cfg.num_layers, causal=True, name="decoder")(
            x, {"segment_ids": segment_ids, "positions": positions}, deterministic, decode)
        return OutputLogits(cfg, embed, name="output")(x, logits)
