"""Encoder-decoder (the original Transformer; Marian-style checkpoints)."""
from __future__ import annotations

import flax.linen as nn

from tfm.config import ModelConfig
from tfm.layers.block import BlockInputs
from tfm.layers.stack import Stack
from tfm.models.embedding import (DecodePosition, InputEmbedding, OutputLogits, check_inputs,
                                  default_positions, token_embed)


class EncoderDecoder(nn.Module):
    """inputs [B, S], targets_in [B, T] (decoder input, shifted right) -> `LMOutput` with logits
    [B, T, V] (fp32).

    With share_source_target_embeddings one matrix embeds source and target tokens (and, when
    tied, produces the logits), as in Vaswani et al. 2017.
    """

    config: ModelConfig

    def setup(self):
        cfg = self.config
        if cfg.parallel_block:
            raise ValueError("ModelConfig.parallel_block is not defined for encoder-decoder models")
        if cfg.share_source_target_embeddings:
            source_embed = target_embed = token_embed(cfg, "embed")
        else:
            source_embed, target_embed = token_embed(cfg, "source_embed"), token_embed(cfg, "target_embed")
        self.source_input = InputEmbedding(cfg, source_embed)
        self.target_input = InputEmbedding(cfg, target_embed)
        self.encoder = Stack(cfg, cfg.num_layers)
        self.decoder = Stack(cfg, cfg.num_decoder_layers, causal=True, cross=True)
        self.output = OutputLogits(cfg, target_embed)
        self.decode_position = DecodePosition()

    def encode(self, inputs, inputs_segment_ids=None, inputs_positions=None, deterministic: bool = True):
        """inputs [B, S] -> encoded [B, S, D]."""
        cfg = self.config
        check_inputs(cfg, inputs, "inputs", inputs_segment_ids=inputs_segment_ids,
                     inputs_positions=inputs_positions)
        positions = default_positions(inputs, inputs_positions)
        x = self.source_input(inputs, positions, deterministic=deterministic)
        return self.encoder(x, BlockInputs(segment_ids=inputs_segment_ids, positions=positions), deterministic)

    def decode(self, targets_in, encoded, inputs_segment_ids=None, targets_segment_ids=None,
               targets_positions=None, deterministic: bool = True, decode: bool = False,
               logits: bool = True):
        """targets_in [B, T], encoded [B, S, D] -> `LMOutput` with logits [B, T, V] (logits=False:
        its `unembedding` instead, for `fused_cross_entropy`)."""
        cfg = self.config
        check_inputs(cfg, targets_in, "targets_in", targets_segment_ids=targets_segment_ids,
                     targets_positions=targets_positions)
        if targets_segment_ids is not None and inputs_segment_ids is None:
            raise ValueError("targets_segment_ids need inputs_segment_ids (packed pairs share segment ids)")
        start = self.decode_position(targets_in.shape[1]) if decode else None
        positions = default_positions(targets_in, targets_positions, start)
        y = self.target_input(targets_in, positions, deterministic=deterministic)
        y = self.decoder(y, BlockInputs(segment_ids=targets_segment_ids, positions=positions, memory=encoded,
                                        memory_segment_ids=inputs_segment_ids), deterministic, decode)
        return self.output(y, logits)

    def __call__(self, inputs, targets_in, inputs_segment_ids=None, targets_segment_ids=None,
                 inputs_positions=None, targets_positions=None, deterministic: bool = True,
                 logits: bool = True):
        encoded = self.encode(inputs, inputs_segment_ids, inputs_positions, deterministic)
        return self.decode(targets_in, encoded, inputs_segment_ids, targets_segment_ids, targets_positions,
                           deterministic, logits=logits)
