"""ERNIE 4.5 (Ernie4_5ForCausalLM, Ernie4_5_MoeForCausalLM) -> tfm DecoderLM: the Llama mapping with RoPE on
adjacent pairs (interleaved) and biases on every projection or none (use_bias). The MoE model: a dense
feed-forward (intermediate_size) on its first moe_layer_start_index layers, then moe_num_experts experts of
moe_intermediate_size, moe_k chosen by softmax score plus the correction bias `moe_statics` (tfm's score_bias),
gates renormalised; moe_num_shared_experts always-on experts as one ungated Mlp that many times as wide."""
from __future__ import annotations

import dataclasses

from tfm.config import ModelConfig
from tfm.convert import llama, mixtral
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights, rope
from tfm.models import DecoderLM


def config(hf: HFConfig, **extra) -> ModelConfig:
    bias = bool(hf.require("use_bias"))  # every ERNIE 4.5 config says it; a config without it is another family's
    return llama.config(hf, default_theta=500_000.0, rope=dataclasses.replace(rope(hf, 500_000.0), interleaved=True),
                        attention_bias=bias, ffn_bias=bias, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                        **extra)


def moe_config(hf: HFConfig) -> ModelConfig:
    L, start = hf.require("num_hidden_layers"), hf.require("moe_layer_start_index")
    hf.expect("moe_layer_interval", [1], 1)
    hf.expect("moe_layer_end_index", [L - 1, -1], L - 1)
    hf.expect("moe_norm_min", [1e-12], 1e-12)  # tfm renormalises with 1e-20 added: the same below 1e-12 of a sum
    F = hf.require("moe_intermediate_size")
    return config(hf, d_ff=F, num_experts=hf.require("moe_num_experts"), experts_per_token=hf.require("moe_k"),
                  dense_layers=start, dense_d_ff=hf.require("intermediate_size"), router_bias=True,
                  router_norm_topk=True, shared_expert_d_ff=F * hf.get("moe_num_shared_experts", 0),
                  shared_expert_gate=False, router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def moe_ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    out = mixtral.moe_ffn(w, p, cfg, hub_block="mlp", hub_names=("gate_proj", "up_proj", "down_proj"))
    E = cfg.num_experts
    bias = f"{p}.mlp.gate.moe_statics.e_score_correction_bias"  # in memory; save_pretrained drops `gate.`
    bias = bias if w.has(bias) else f"{p}.mlp.moe_statics.e_score_correction_bias"
    out["score_bias"] = w(bias, (1, E)).reshape(E)
    if cfg.shared_expert_d_ff:
        out["shared_expert"] = llama.swiglu(w, f"{p}.mlp.shared_experts", bias=cfg.ffn_bias)
    return out


def moe_params(w: Weights, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, ffn=moe_ffn)


def hf_config(cfg: ModelConfig, model_type: str = "ernie4_5") -> dict:
    """The inverse of `config` (export)."""
    if not cfg.rope.interleaved or cfg.attention_bias != cfg.ffn_bias:
        raise ConversionError("ERNIE 4.5 rotates adjacent pairs and has biases on every projection or none")
    out = llama.hf_config(cfg, model_type=model_type, bias_fields=False)
    del out["attention_dropout"]
    return dict(out, use_bias=cfg.attention_bias)


def moe_hf_config(cfg: ModelConfig) -> dict:
    if not (cfg.num_experts and cfg.router_bias and cfg.router_score == "softmax"):
        raise ConversionError("ERNIE 4.5 MoE routes by softmax scores with a correction bias")
    out = hf_config(cfg, "ernie4_5_moe")
    del out["head_dim"]
    return dict(out, intermediate_size=cfg.dense_d_ff or cfg.d_ff, moe_intermediate_size=cfg.d_ff,
                moe_num_experts=cfg.num_experts, moe_k=cfg.experts_per_token, moe_layer_start_index=cfg.dense_layers,
                moe_layer_end_index=cfg.num_layers - 1, moe_layer_interval=1,
                moe_num_shared_experts=cfg.shared_expert_d_ff // cfg.d_ff, router_aux_loss_coef=cfg.router_aux_loss_coef)


ARCHITECTURES = {
    "Ernie4_5ForCausalLM": Converter(DecoderLM, config, llama.params, ignore=llama.IGNORE, hf_config=hf_config),
    "Ernie4_5_MoeForCausalLM": Converter(DecoderLM, moe_config, moe_params, ignore=llama.IGNORE,
                                         hf_config=moe_hf_config),
}
