"""Marian (MarianMTModel) -> tfm EncoderDecoder.

Post-norm blocks (LayerNorm eps 1e-5), sinusoidal positions in the sin-then-cos layout (Marian's
`embed_positions` tables are checked against tfm's, not stored), optional sqrt(D) embedding scale,
one shared source/target embedding, `final_logits_bias` -> the output bias.
"""
from __future__ import annotations

import numpy as np

from tfm.config import ModelConfig
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, add_output_head, attention,
                                hf_activation, linear, linear_pair, norm, stack_params)
from tfm.layers.positions import sinusoidal_table
from tfm.models import EncoderDecoder


def config(hf: HFConfig) -> ModelConfig:
    # Fields of older BART-style configs that Marian checkpoints leave off; tfm maps only "off".
    for name in ("normalize_before", "add_final_layer_norm", "normalize_embedding", "add_bias_logits"):
        hf.expect(name, [False, None], None)
    vocab = hf.require("vocab_size")
    if hf.get("decoder_vocab_size", vocab) != vocab:
        raise hf.unsupported("decoder_vocab_size", hf.get("decoder_vocab_size"),
                             f"tfm needs one vocabulary (vocab_size={vocab})")
    share = bool(hf.get("share_encoder_decoder_embeddings", True))
    return ModelConfig(
        vocab_size=vocab, d_model=hf.require("d_model"),
        num_heads=hf.same("encoder_attention_heads", "decoder_attention_heads"),
        num_layers=hf.require("encoder_layers"), num_decoder_layers=hf.require("decoder_layers"),
        d_ff=hf.same("encoder_ffn_dim", "decoder_ffn_dim"), max_len=hf.get("max_position_embeddings", 1024),
        norm="layernorm", norm_eps=1e-5, norm_position="post", final_norm=False, position="sinusoidal",
        activation=hf.activation("activation_function", "gelu"), scale_embeddings=bool(hf.get("scale_embedding", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), share_source_target_embeddings=share,
        output_bias=True, pad_id=hf.pad_id(vocab), dropout_rate=hf.get("dropout", 0.0),
        attention_dropout=hf.get("attention_dropout", 0.0))


def _attention(w: Weights, p: str, cfg: ModelConfig) -> dict:
    qkvo = [linear_pair(w, f"{p}.{n}_proj", True) for n in ("q", "k", "v", "out")]
    return attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


def layer(w: Weights, p: str, cfg: ModelConfig, cross: bool) -> dict:
    """One post-norm block (self-attention, cross-attention if `cross`, feed-forward); BART's too."""
    out = {"self_attn": _attention(w, f"{p}.self_attn", cfg),
           "attn_norm": norm(w, f"{p}.self_attn_layer_norm", cfg.norm),
           "ffn": {"wi": linear(w, f"{p}.fc1"), "wo": linear(w, f"{p}.fc2")},
           "ffn_norm": norm(w, f"{p}.final_layer_norm", cfg.norm)}
    if cross:
        out["cross_attn"] = _attention(w, f"{p}.encoder_attn", cfg)
        out["cross_norm"] = norm(w, f"{p}.encoder_attn_layer_norm", cfg.norm)
    return out


def _check_positions(w: Weights, side: str, cfg: ModelConfig):
    key = f"model.{side}.embed_positions.weight"
    if w.has(key):
        table = w(key)
        expected = np.asarray(sinusoidal_table(np.arange(table.shape[0]), cfg.d_model))
        if table.shape[1] != cfg.d_model or not np.allclose(table, expected, atol=1e-5):
            raise ConversionError(f"{w.source}: {key} is not the sin-then-cos sinusoidal table tfm computes")


def stacks(w: Weights, cfg: ModelConfig) -> dict:
    """The encoder and decoder of Marian's layout (BART's too)."""
    return {"encoder": Stack(lambda i: layer(w, f"model.encoder.layers.{i}", cfg, False), cfg.num_layers),
            "decoder": Stack(lambda i: layer(w, f"model.decoder.layers.{i}", cfg, True), cfg.num_decoder_layers)}


def params(w: Weights, cfg: ModelConfig) -> dict:
    V, D = cfg.vocab_size, cfg.d_model
    if cfg.share_source_target_embeddings:
        target = source = w("model.shared.weight", (V, D))
        w.tied("model.encoder.embed_tokens.weight", source, "share_encoder_decoder_embeddings")
        w.tied("model.decoder.embed_tokens.weight", source, "share_encoder_decoder_embeddings")
        out = {"embed": {"embedding": source}}
    else:
        source = w("model.encoder.embed_tokens.weight", (V, D))
        target = w("model.decoder.embed_tokens.weight", (V, D))
        w.tied("model.shared.weight", source, "share_encoder_decoder_embeddings=False (shared is the encoder's)")
        out = {"source_embed": {"embedding": source}, "target_embed": {"embedding": target}}
    for side in ("encoder", "decoder"):
        _check_positions(w, side, cfg)
    out.update(stack_params(w, cfg, stacks(w, cfg)))
    out["output"] = {"bias": w("final_logits_bias", (1, V))[0]}
    add_output_head(out, w, target, cfg)
    return out


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export); decoding starts from the pad token, as in Marian."""
    return dict(model_type="marian", vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                encoder_attention_heads=cfg.num_heads, decoder_attention_heads=cfg.num_heads,
                encoder_layers=cfg.num_layers, decoder_layers=cfg.num_decoder_layers, encoder_ffn_dim=cfg.d_ff,
                decoder_ffn_dim=cfg.d_ff, max_position_embeddings=cfg.max_len,
                activation_function=hf_activation(cfg.activation), scale_embedding=cfg.scale_embeddings,
                tie_word_embeddings=cfg.tie_embeddings, share_encoder_decoder_embeddings=cfg.share_source_target_embeddings,
                pad_token_id=cfg.pad_id, decoder_start_token_id=cfg.pad_id, dropout=cfg.dropout_rate,
                attention_dropout=cfg.attention_dropout)


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("activation_dropout", "decoder_layerdrop", "encoder_layerdrop", "forced_eos_token_id", "is_decoder")
ARCHITECTURES = {"MarianMTModel": Converter(EncoderDecoder, config, params, hf_config=hf_config, inert=INERT)}
