"""ViT (ViTModel, ViTForImageClassification) -> tfm VisionEncoder.

Pre-norm blocks (layernorm_before / layernorm_after, eps 1e-12), GELU, a final `layernorm`
(block tensors named as transformers 5 writes them, `layers.{i}.attention.q_proj`, or as older
checkpoints do, `encoder.layer.{i}.attention.attention.query`);
the stride-p patch convolution [D, C, p, p] becomes the einsum kernel [p, p, C, D], cls_token
[1, 1, D] and position_embeddings [1, 1 + P, D] lose their leading 1. ViTModel keeps its tanh
pooler; ViTForImageClassification has a classifier on the [CLS] state and no pooler.
"""
from __future__ import annotations

import functools

from tfm.config import ModelConfig
from tfm.convert.common import (Converter, HFConfig, Stack, Weights, attention, hf_activation, linear, linear_pair,
                                norm, stack_params)
from tfm.models.vision import VisionEncoder, num_patches


def config(hf: HFConfig, heads=()) -> ModelConfig:
    hf.expect("pooler_act", ["tanh"], "tanh")
    D = hf.require("hidden_size")
    hf.expect("pooler_output_size", [D, None], None)
    size = hf.get("image_size", 224)
    labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 2)
    cfg = ModelConfig(
        vocab_size=1, d_model=D, num_heads=hf.require("num_attention_heads"), num_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"), norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12),
        norm_position="pre", final_norm=True, position="learned", activation=hf.activation("hidden_act", "gelu"),
        attention_bias=bool(hf.get("qkv_bias", True)), attention_out_bias=True, image_size=size, patch_size=hf.get("patch_size", 16),
        num_channels=hf.get("num_channels", 3), heads=tuple(heads), num_labels=labels,
        dropout_rate=hf.get("hidden_dropout_prob", 0.0), attention_dropout=hf.get("attention_probs_dropout_prob", 0.0))
    return cfg.replace(max_len=1 + num_patches(cfg))


# Block tensor names: transformers 5 (what save_pretrained writes now) and the Hub's older layout.
_NAMES = {"layers": ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj", "mlp.fc1",
                     "mlp.fc2"),
          "encoder.layer": ("attention.attention.query", "attention.attention.key", "attention.attention.value",
                            "attention.output.dense", "intermediate.dense", "output.dense")}


def _layer(w: Weights, p: str, names, cfg: ModelConfig) -> dict:
    q, k, v, o, fc1, fc2 = (f"{p}.{n}" for n in names)
    b = cfg.attention_bias
    qkvo = [linear_pair(w, q, b), linear_pair(w, k, b), linear_pair(w, v, b), linear_pair(w, o, True)]
    return {"attn_norm": norm(w, f"{p}.layernorm_before", cfg.norm),
            "self_attn": attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            "ffn_norm": norm(w, f"{p}.layernorm_after", cfg.norm),
            "ffn": {"wi": linear(w, fc1), "wo": linear(w, fc2)}}


def params(w: Weights, cfg: ModelConfig) -> dict:
    classifier = "classification" in cfg.heads
    p = "vit." if classifier else ""
    if not classifier:
        w.strip_prefix("vit.")
    D, P = cfg.d_model, num_patches(cfg)
    stack = "layers" if w.has(f"{p}layers.0.layernorm_before.weight") else "encoder.layer"
    conv = w(f"{p}embeddings.patch_embeddings.projection.weight",
             (D, cfg.num_channels, cfg.patch_size, cfg.patch_size))
    out = {"patch_embed": {"kernel": conv.transpose(2, 3, 1, 0),
                           "bias": w(f"{p}embeddings.patch_embeddings.projection.bias", (D,))},
           "cls": w(f"{p}embeddings.cls_token", (1, 1, D))[0, 0],
           "position": w(f"{p}embeddings.position_embeddings", (1, 1 + P, D))[0],
           **stack_params(w, cfg, {"encoder": Stack(lambda i: _layer(w, f"{p}{stack}.{i}", _NAMES[stack], cfg),
                                                    cfg.num_layers, final_norm=f"{p}layernorm")})}
    if "pooler" in cfg.heads:
        out["pooler"] = linear(w, "pooler.dense")
    if classifier:
        out["classifier"] = linear(w, "classifier")
    return out


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export); the heads pick the class."""
    return dict(model_type="vit", hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, intermediate_size=cfg.d_ff, hidden_act=hf_activation(cfg.activation),
                layer_norm_eps=cfg.norm_eps, image_size=cfg.image_size, patch_size=cfg.patch_size,
                num_channels=cfg.num_channels, qkv_bias=cfg.attention_bias, num_labels=cfg.num_labels,
                hidden_dropout_prob=cfg.dropout_rate, attention_probs_dropout_prob=cfg.attention_dropout)


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("encoder_stride",)
ARCHITECTURES = {
    "ViTModel": Converter(VisionEncoder, functools.partial(config, heads=("pooler",)), params, hf_config=hf_config,
                          inert=INERT),
    "ViTForImageClassification": Converter(VisionEncoder, functools.partial(config, heads=("classification",)),
                                           params, hf_config=hf_config, inert=INERT),
}
