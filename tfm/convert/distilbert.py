"""DistilBERT (DistilBertForMaskedLM) -> tfm EncoderModel.

BERT's post-norm blocks (LayerNorm eps 1e-12) without token types; learned positions; the MLM
head is vocab_transform (dense) -> activation -> vocab_layer_norm -> vocab_projector (tied to
the word embeddings, with a bias).
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import bert
from tfm.convert.common import (Converter, HFConfig, Stack, Weights, attention, hf_activation, linear, linear_pair,
                                model_params, norm)
from tfm.models import EncoderModel


def config(hf: HFConfig) -> ModelConfig:
    hf.expect("sinusoidal_pos_embds", [False], False)
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=hf.require("dim"), num_heads=hf.require("n_heads"),
        num_layers=hf.require("n_layers"), d_ff=hf.require("hidden_dim"),
        max_len=hf.get("max_position_embeddings", 512), norm="layernorm", norm_eps=1e-12, norm_position="post",
        final_norm=False, embedding_norm=True, position="learned", activation=hf.activation("activation", "gelu"),
        type_vocab_size=0, tie_embeddings=bool(hf.get("tie_word_embeddings", True)), output_bias=True,
        heads=("mlm",), pad_id=hf.pad_id(vocab), dropout_rate=hf.get("dropout", 0.0),
        attention_dropout=hf.get("attention_dropout", 0.0))


def _layer(w: Weights, p: str, cfg: ModelConfig) -> dict:
    qkvo = [linear_pair(w, f"{p}.attention.{n}_lin", True) for n in ("q", "k", "v", "out")]
    return {"self_attn": attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            "attn_norm": norm(w, f"{p}.sa_layer_norm", cfg.norm),
            "ffn": {"wi": linear(w, f"{p}.ffn.lin1"), "wo": linear(w, f"{p}.ffn.lin2")},
            "ffn_norm": norm(w, f"{p}.output_layer_norm", cfg.norm)}


def params(w: Weights, cfg: ModelConfig) -> dict:
    position = w("distilbert.embeddings.position_embeddings.weight", (cfg.max_len, cfg.d_model))
    inputs = {"position": {"embedding": position},
              "norm": norm(w, "distilbert.embeddings.LayerNorm", cfg.norm)}
    encoder = Stack(lambda i: _layer(w, f"distilbert.transformer.layer.{i}", cfg), cfg.num_layers)
    out = model_params(w, cfg, embedding="distilbert.embeddings.word_embeddings.weight", stacks={"encoder": encoder},
                       head=None, input=inputs)
    return bert.mlm_head(out, w, cfg, "vocab_transform", "vocab_layer_norm", "vocab_projector.bias",
                         "vocab_projector.weight")


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    return dict(model_type="distilbert", vocab_size=cfg.vocab_size, dim=cfg.d_model, n_heads=cfg.num_heads,
                n_layers=cfg.num_layers, hidden_dim=cfg.d_ff, max_position_embeddings=cfg.max_len,
                activation=hf_activation(cfg.activation), sinusoidal_pos_embds=False,
                tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id, dropout=cfg.dropout_rate,
                attention_dropout=cfg.attention_dropout)


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("qa_dropout", "seq_classif_dropout")
ARCHITECTURES = {
    "DistilBertForMaskedLM": Converter(EncoderModel, config, params, ignore=("*position_ids",), hf_config=hf_config,
                                       inert=INERT),
}
