"""BART (BartForConditionalGeneration) -> tfm EncoderDecoder.

Marian's post-norm layer layout, plus: learned positions per side read at position + 2 (HF's
offset), a LayerNorm on each side's summed embeddings (`layernorm_embedding`), optional sqrt(D)
embedding scale, one shared embedding (tied output), `final_logits_bias` -> the output bias.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import marian
from tfm.convert.common import Converter, HFConfig, Weights, hf_activation, model_params, norm
from tfm.models import EncoderDecoder

POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding reads row position + 2


def config(hf: HFConfig) -> ModelConfig:
    for name in ("normalize_before", "add_final_layer_norm"):  # mBART-style pre-norm variants
        hf.expect(name, [False, None], None)
    hf.expect("scale_embedding", [False, True], False)
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=hf.require("d_model"),
        num_heads=hf.same("encoder_attention_heads", "decoder_attention_heads"),
        num_layers=hf.require("encoder_layers"), num_decoder_layers=hf.require("decoder_layers"),
        d_ff=hf.same("encoder_ffn_dim", "decoder_ffn_dim"),
        max_len=hf.get("max_position_embeddings", 1024) + POSITION_OFFSET, position_offset=POSITION_OFFSET,
        norm="layernorm", norm_eps=1e-5, norm_position="post", final_norm=False, embedding_norm=True,
        position="learned", activation=hf.activation("activation_function", "gelu"),
        scale_embeddings=bool(hf.get("scale_embedding", False)), tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        share_source_target_embeddings=True, output_bias=True, pad_id=hf.pad_id(vocab),
        dropout_rate=hf.get("dropout", 0.0), attention_dropout=hf.get("attention_dropout", 0.0))


def _side(w: Weights, side: str, cfg: ModelConfig) -> dict:
    p = f"model.{side}"
    return {"position": {"embedding": w(f"{p}.embed_positions.weight", (cfg.max_len, cfg.d_model))},
            "norm": norm(w, f"{p}.layernorm_embedding", cfg.norm)}


def params(w: Weights, cfg: ModelConfig) -> dict:
    return model_params(w, cfg, embedding="model.shared.weight", stacks=marian.stacks(w, cfg),
                        tied=[f"model.{side}.embed_tokens.weight" for side in ("encoder", "decoder")],
                        source_input=_side(w, "encoder", cfg), target_input=_side(w, "decoder", cfg),
                        output={"bias": w("final_logits_bias", (1, cfg.vocab_size))[0]})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    return dict(model_type="bart", vocab_size=cfg.vocab_size, d_model=cfg.d_model,
                encoder_attention_heads=cfg.num_heads, decoder_attention_heads=cfg.num_heads,
                encoder_layers=cfg.num_layers, decoder_layers=cfg.num_decoder_layers, encoder_ffn_dim=cfg.d_ff,
                decoder_ffn_dim=cfg.d_ff, max_position_embeddings=cfg.max_len - POSITION_OFFSET,
                activation_function=hf_activation(cfg.activation), scale_embedding=cfg.scale_embeddings,
                tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id, dropout=cfg.dropout_rate,
                attention_dropout=cfg.attention_dropout)


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("activation_dropout", "classifier_dropout", "decoder_layerdrop", "encoder_layerdrop",
         "forced_eos_token_id", "is_decoder")
ARCHITECTURES = {"BartForConditionalGeneration": Converter(EncoderDecoder, config, params, hf_config=hf_config,
                                                           inert=INERT)}
