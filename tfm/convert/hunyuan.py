"""HunYuan (HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM) -> tfm DecoderLM: the Llama mapping with RMSNorm
over each query and key head after RoPE (`query_layernorm`, `key_layernorm`: qk_norm_position="after_rope").
The MoE model: num_experts experts of intermediate_size, moe_topk chosen by softmax score (gates renormalised),
beside an always-on ungated shared Mlp of the same width (`shared_mlp`)."""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama, mixtral
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights
from tfm.models import DecoderLM

FEATURES = dict(qk_norm=True, qk_norm_position="after_rope")


def config(hf: HFConfig) -> ModelConfig:
    return llama.config(hf, **FEATURES)


def moe_config(hf: HFConfig) -> ModelConfig:
    k = hf.require("moe_topk")
    if isinstance(k, (list, tuple)):  # per layer
        if len(set(k)) != 1:
            raise hf.unsupported("moe_topk", k, "tfm routes every layer to the same number of experts")
        k = k[0]
    F = hf.require("intermediate_size")
    return llama.config(hf, **FEATURES, num_experts=hf.require("num_experts"), experts_per_token=k,
                        router_norm_topk=True, shared_expert_d_ff=F, shared_expert_gate=False)


def moe_ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    out = mixtral.moe_ffn(w, p, cfg, hub_block="mlp", hub_names=("gate_proj", "up_proj", "down_proj"), router="gate.wg")
    out["shared_expert"] = llama.swiglu(w, f"{p}.mlp.shared_mlp", bias=False)
    return out


QK_NORMS = dict(query="query_layernorm", key="key_layernorm")


def params(w: Weights, cfg: ModelConfig, ffn=llama.dense_ffn) -> dict:
    return llama.params(w, cfg, ffn=ffn, qk_norms=QK_NORMS)


def moe_params(w: Weights, cfg: ModelConfig) -> dict:
    return params(w, cfg, ffn=moe_ffn)


def hf_config(cfg: ModelConfig, model_type: str = "hunyuan_v1_dense") -> dict:
    """The inverse of `config` (export)."""
    if not cfg.qk_norm or cfg.qk_norm_position != "after_rope" or cfg.ffn_bias:
        raise ConversionError("HunYuan normalises each query and key head after RoPE and has no feed-forward bias")
    out = llama.hf_config(cfg, model_type=model_type, bias_fields=False)
    return dict(out, attention_bias=cfg.attention_bias)


def moe_hf_config(cfg: ModelConfig) -> dict:
    if not cfg.num_experts or cfg.shared_expert_d_ff != cfg.d_ff or cfg.shared_expert_gate:
        raise ConversionError("HunYuan MoE adds one ungated shared Mlp as wide as its experts")
    return dict(hf_config(cfg, "hunyuan_v1_moe"), num_experts=cfg.num_experts, moe_topk=cfg.experts_per_token)


INERT = ("eod_token_id",)
ARCHITECTURES = {
    "HunYuanDenseV1ForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config,
                                           inert=INERT),
    "HunYuanMoEV1ForCausalLM": Converter(DecoderLM, moe_config, moe_params, ignore=llama.IGNORE,
                                         hf_config=moe_hf_config, inert=INERT),
}
