"""Bidirectional encoder (BERT family) with MLM, NSP and sequence-classification heads."""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.inputs import BlockInputs
from tfm.layers.common import Einsum, compute_dtype
from tfm.layers.feedforward import activation_fn
from tfm.layers.positions import padding_positions
from tfm.layers.norms import Norm
from tfm.layers.stack import Stack
from tfm.models.embedding import InputEmbedding, OutputLogits, check_inputs, default_positions, token_embed
from tfm.models.outputs import EncoderOutput


def _dense(features_in: int, features_out: int, name: str, dtype):
    return Einsum("BD,DO->BO", (features_in, features_out), ("embed", None), (None,), use_bias=True,
                  dtype=dtype, name=name)


def _gather(hidden, positions):
    """hidden [B, T, D] at positions [B, P] -> [B, P, D]; a position outside [0, T) gives a NaN
    row (a negative one would otherwise wrap to the end of the row)."""
    positions = jnp.where(positions < 0, hidden.shape[1], positions)
    return jnp.take_along_axis(hidden, positions[..., None], axis=1, mode="fill", fill_value=jnp.nan)


def mean_pool(hidden, segment_ids=None):
    """hidden [B, T, D] -> the L2-normalised fp32 mean over tokens with segment id != 0 [B, D]."""
    hidden = hidden.astype(jnp.float32)
    if segment_ids is None:
        mean = hidden.mean(axis=1)
    else:
        real = (segment_ids != 0).astype(jnp.float32)[..., None]
        mean = (hidden * real).sum(axis=1) / jnp.maximum(real.sum(axis=1), 1.0)
    return mean / jnp.maximum(jnp.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)


class EncoderModel(nn.Module):
    """tokens [B, T] -> `EncoderOutput`: hidden [B, T, D], and per config.heads (else None):
    pooled [B, D], mlm_logits [B, P, V] (at mlm_positions [B, P], else [B, T, V]), nsp_logits
    [B, 2], logits [B, num_labels] (classification), score [B] (regression), start_logits and
    end_logits [B, T] (span: extractive question answering), embedding [B, D] (mean_pool: the
    L2-normalised mean of the hidden states over non-padding tokens, E5 / sentence embeddings);
    "pooler" alone sets pooled. logits=False sets mlm_unembedding (the MLM head's transformed
    hidden states [B, P, D] and projection) instead of mlm_logits, for `fused_cross_entropy`."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens, token_type_ids=None, segment_ids=None, positions=None, mlm_positions=None,
                 deterministic: bool = True, logits: bool = True):
        cfg = self.config
        check_inputs(cfg, tokens, token_type_ids=token_type_ids, segment_ids=segment_ids, positions=positions)
        if token_type_ids is not None and cfg.type_vocab_size:
            check_inputs(cfg.replace(vocab_size=cfg.type_vocab_size), token_type_ids, "token_type_ids")
        if positions is None and cfg.padding_positions:
            positions = padding_positions(tokens, cfg.pad_id)
        positions = default_positions(tokens, positions)
        embed = token_embed(cfg, "embed")
        x = InputEmbedding(cfg, embed, name="input")(tokens, positions, token_type_ids, deterministic)
        hidden = Stack(cfg, cfg.num_layers, name="encoder")(
            x, BlockInputs(segment_ids=segment_ids, positions=positions), deterministic)
        out = EncoderOutput(hidden=hidden)
        dt = compute_dtype(cfg)
        if {"nsp", "classification", "regression", "pooler"} & set(cfg.heads):
            out = out.replace(pooled=jnp.tanh(_dense(cfg.d_model, cfg.d_model, "pooler", dt)(hidden[:, 0])))
        if "mean_pool" in cfg.heads:
            out = out.replace(embedding=mean_pool(hidden, segment_ids))
        if "nsp" in cfg.heads:
            out = out.replace(nsp_logits=_dense(cfg.d_model, 2, "nsp", dt)(out.pooled).astype(jnp.float32))
        if "classification" in cfg.heads:
            pooled = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(out.pooled)
            out = out.replace(logits=_dense(cfg.d_model, cfg.num_labels, "classifier", dt)(pooled).astype(jnp.float32))
        if "regression" in cfg.heads:
            pooled = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(out.pooled)
            out = out.replace(score=_dense(cfg.d_model, 1, "regressor", dt)(pooled)[:, 0].astype(jnp.float32))
        if "span" in cfg.heads:
            span = Einsum("BTD,DO->BTO", (cfg.d_model, 2), ("embed", None), (None,), use_bias=True,
                          dtype=dt, name="span")(hidden).astype(jnp.float32)  # [B, T, 2]
            out = out.replace(start_logits=span[..., 0], end_logits=span[..., 1])
        if "mlm" in cfg.heads:
            h = hidden if mlm_positions is None else _gather(hidden, mlm_positions)
            h = Einsum("BTD,DO->BTO", (cfg.d_model, cfg.d_model), ("embed", None), (None,), use_bias=True,
                       dtype=dt, name="mlm_transform")(h)
            h = Norm(cfg, name="mlm_norm")(activation_fn(cfg.head_activation or cfg.activation)(h))
            mlm = OutputLogits(cfg, embed, name="mlm_output")(h, logits)  # LMOutput
            out = out.replace(mlm_logits=mlm.logits, mlm_unembedding=mlm.unembedding)
        return out
