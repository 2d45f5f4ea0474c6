"""Qwen3 (Qwen3ForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM) -> tfm DecoderLM: the Llama mapping
with RMSNorm over each query and key head before RoPE (`q_norm`, `k_norm` -> ModelConfig.qk_norm),
no biases by default; Qwen3-MoE puts a top-k MoE (moe_intermediate_size wide, tfm d_ff) on every
layer without a shared expert, its gates renormalised only with norm_topk_prob (router_norm_topk).
Qwen3's sliding-window layers are its layer_types, as Qwen2's; Qwen3-MoE's window (use_sliding_window)
and dense layers inside a MoE model (mlp_only_layers, decoder_sparse_step > 1) are refused by name.
"""
from __future__ import annotations


from tfm.config import ModelConfig
from tfm.convert import llama, mixtral, qwen2
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights
from tfm.models import DecoderLM


def config(hf: HFConfig, **extra) -> ModelConfig:
    return llama.config(hf, default_theta=1e6, qk_norm=True, **qwen2.attention_layers(hf), **extra)


def moe_config(hf: HFConfig) -> ModelConfig:
    hf.expect("use_sliding_window", [False], False)  # Qwen3-MoE's window, when on, is on every layer
    hf.expect("decoder_sparse_step", [1], 1)
    if hf.get("mlp_only_layers"):
        raise hf.unsupported("mlp_only_layers", hf.get("mlp_only_layers"), "tfm puts the MoE on every layer")
    experts = hf.get("num_local_experts") or hf.require("num_experts")  # transformers 5 writes the former
    return config(hf, d_ff=hf.require("moe_intermediate_size"), num_experts=experts,
                  experts_per_token=hf.get("num_experts_per_tok", 8),
                  router_norm_topk=bool(hf.get("norm_topk_prob", False)),
                  router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def moe_ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    return mixtral.moe_ffn(w, p, cfg, hub_block="mlp", hub_names=("gate_proj", "up_proj", "down_proj"))


def moe_params(w: Weights, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, ffn=moe_ffn)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if not cfg.qk_norm or cfg.num_experts:
        raise ConversionError("Qwen3 normalises queries and keys (qk_norm=True) and has a dense feed-forward")
    out = llama.hf_config(cfg, model_type="qwen3", bias_fields=False)
    return dict(out, attention_bias=cfg.attention_bias, **qwen2.hf_attention_layers(cfg))


def moe_hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `moe_config` (export)."""
    if not cfg.qk_norm or not cfg.num_experts or cfg.shared_expert_d_ff:
        raise ConversionError("Qwen3-MoE normalises queries and keys and has routed experts only on every layer")
    out = llama.hf_config(cfg, model_type="qwen3_moe", bias_fields=False)
    return dict(out, attention_bias=cfg.attention_bias, use_sliding_window=False, num_experts=cfg.num_experts,
                num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.d_ff,
                norm_topk_prob=cfg.router_norm_topk, router_aux_loss_coef=cfg.router_aux_loss_coef,
                decoder_sparse_step=1, mlp_only_layers=[])


ARCHITECTURES = {
    "Qwen3ForCausalLM": Converter(DecoderLM, config, llama.params, ignore=llama.IGNORE, hf_config=hf_config),
    "Qwen3MoeForCausalLM": Converter(DecoderLM, moe_config, moe_params, ignore=llama.IGNORE,
                                     hf_config=moe_hf_config),
}
