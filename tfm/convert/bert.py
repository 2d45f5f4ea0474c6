"""BERT (BertForPreTraining, BertModel) -> tfm EncoderModel.

Post-norm blocks, learned absolute positions, token types, LayerNorm on the summed embeddings.
BertForPreTraining keeps the MLM head (transform, LayerNorm, tied decoder + bias) and the NSP head
(pooler + seq_relationship). BertModel keeps its pooler (heads ("pooler",): `pooler_output` is
"pooled"); a BertModel checkpoint saved without one (E5-style, `add_pooling_layer=False`) imports
with no heads, and export refuses such a config, since transformers' BertModel always has a pooler
and would initialise it at random.
"""
from __future__ import annotations

import functools
from typing import Optional

from tfm.config import ModelConfig
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, add_output_head, attention,
                                hf_activation, linear, linear_pair, model_params, norm)
from tfm.models import EncoderModel


def config(hf: HFConfig, heads=()) -> ModelConfig:
    hf.expect("position_embedding_type", ["absolute"], "absolute")
    hf.expect("is_decoder", [False], False)
    hf.expect("add_cross_attention", [False], False)
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=hf.require("hidden_size"), num_heads=hf.require("num_attention_heads"),
        num_layers=hf.require("num_hidden_layers"), d_ff=hf.require("intermediate_size"),
        max_len=hf.get("max_position_embeddings", 512), norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12),
        norm_position="post", final_norm=False, embedding_norm=True, position="learned",
        activation=hf.activation("hidden_act", "gelu"), type_vocab_size=hf.get("type_vocab_size", 2),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), output_bias="mlm" in heads, heads=tuple(heads),
        pad_id=hf.pad_id(vocab), dropout_rate=hf.get("hidden_dropout_prob", 0.0),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.0))


def layer(w: Weights, p: str, cfg: ModelConfig) -> dict:
    qkvo = [linear_pair(w, f"{p}.attention.self.{n}", True) for n in ("query", "key", "value")]
    qkvo.append(linear_pair(w, f"{p}.attention.output.dense", True))
    return {"self_attn": attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            "attn_norm": norm(w, f"{p}.attention.output.LayerNorm", cfg.norm),
            "ffn": {"wi": linear(w, f"{p}.intermediate.dense"), "wo": linear(w, f"{p}.output.dense")},
            "ffn_norm": norm(w, f"{p}.output.LayerNorm", cfg.norm)}


def pooler_if_saved(cfg: ModelConfig, w: Weights) -> ModelConfig:
    """BertModel's config without its pooler when the checkpoint saved none."""
    saved = any(w.has(f"{p}pooler.dense.weight") for p in ("", "bert."))
    return cfg if saved else cfg.replace(heads=())


def encoder_params(w: Weights, cfg: ModelConfig, p: str, token_types: bool = True, layer_params=layer,
                   **extra) -> dict:
    """Word and position embeddings (`p`embeddings.*), their LayerNorm and the BERT encoder
    (`p`encoder.layer.{i}, each read by `layer_params`); RoBERTa's and BERT's, DistilBERT's with its names,
    Longformer's with its global projections."""
    inputs = {"position": {"embedding": w(f"{p}embeddings.position_embeddings.weight", (cfg.max_len, cfg.d_model))}}
    if token_types:
        inputs["token_type"] = {"embedding": w(f"{p}embeddings.token_type_embeddings.weight")}
    inputs["norm"] = norm(w, f"{p}embeddings.LayerNorm", cfg.norm)
    encoder = Stack(lambda i: layer_params(w, f"{p}encoder.layer.{i}", cfg), cfg.num_layers)
    return model_params(w, cfg, embedding=f"{p}embeddings.word_embeddings.weight", stacks={"encoder": encoder},
                        head=None, input=inputs, **extra)


def mlm_head(out: dict, w: Weights, cfg: ModelConfig, transform: str, layer_norm: str, bias: str, decoder: str,
             tied_bias: Optional[str] = None) -> dict:
    """The MLM head (transform dense, its LayerNorm, output bias, decoder tied to the word embeddings
    unless untied) added to `out`; `tied_bias`: a copy of the bias the checkpoint may hold."""
    out["mlm_transform"] = linear(w, transform)
    out["mlm_norm"] = norm(w, layer_norm, cfg.norm)
    out["mlm_output"] = {"bias": w(bias, (cfg.vocab_size,))}
    if tied_bias is not None:
        w.tied(tied_bias, out["mlm_output"]["bias"], "the MLM decoder bias")
    add_output_head(out, w, out["embed"]["embedding"], cfg, decoder, into="mlm_output")
    return out


def params(w: Weights, cfg: ModelConfig) -> dict:
    pretraining = "mlm" in cfg.heads  # BertForPreTraining; else BertModel
    if not pretraining:
        w.strip_prefix("bert.")  # BertModel weights saved with or without the "bert." wrapper
    p = "bert." if pretraining else ""
    out = encoder_params(w, cfg, p)
    if {"nsp", "pooler"} & set(cfg.heads):
        out["pooler"] = linear(w, f"{p}pooler.dense")
    if "nsp" in cfg.heads:
        out["nsp"] = linear(w, "cls.seq_relationship")
    if "mlm" in cfg.heads:
        mlm_head(out, w, cfg, "cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                 "cls.predictions.bias", "cls.predictions.decoder.weight", tied_bias="cls.predictions.decoder.bias")
    return out


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export); the heads pick the class."""
    return dict(model_type="bert", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_attention_heads=cfg.num_heads, num_hidden_layers=cfg.num_layers, intermediate_size=cfg.d_ff,
                max_position_embeddings=cfg.max_len, layer_norm_eps=cfg.norm_eps, hidden_act=hf_activation(cfg.activation),
                type_vocab_size=cfg.type_vocab_size, tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id,
                hidden_dropout_prob=cfg.dropout_rate, attention_probs_dropout_prob=cfg.attention_dropout)


def model_hf_config(cfg: ModelConfig) -> dict:
    """`hf_config` for BertModel, whose pooler HF always builds: a config without one is refused."""
    if "pooler" not in cfg.heads:
        raise ConversionError(f"heads={cfg.heads} has no pooler, and transformers' BertModel always has one "
                              "(from_pretrained would fill it at random); export heads=('pooler',) with trained pooler params")
    return hf_config(cfg)


ARCHITECTURES = {
    "BertForPreTraining": Converter(EncoderModel, functools.partial(config, heads=("mlm", "nsp")), params,
                                    ignore=("*position_ids", "*token_type_ids"), hf_config=hf_config),
    "BertModel": Converter(EncoderModel, functools.partial(config, heads=("pooler",)), params,
                           ignore=("*position_ids", "*token_type_ids"), hf_config=model_hf_config,
                           refine=pooler_if_saved),
}
