"""GLM-4.5 (GLM-4.5 / 4.5-Air / 4.6: Glm4MoeForCausalLM) -> tfm DecoderLM: the Llama mapping with biases on q, k,
v only, RoPE on the first partial_rotary_factor of each head (halves rotated), optional per-head q/k RMSNorm
(use_qk_norm), and DeepSeek-V3's feed-forward: the first first_k_dense_replace layers dense, then n_routed_experts
chosen by sigmoid score plus the correction bias within the topk_group best of n_group groups, gates renormalised
(norm_topk_prob) and times routed_scaling_factor, beside n_shared_experts always-on experts (`deepseek_v3.ffn`)."""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import deepseek_v3, llama
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights, rope
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    layers, dense = hf.require("num_hidden_layers"), hf.require("first_k_dense_replace")
    F = hf.require("moe_intermediate_size")
    moe = dict(num_experts=hf.require("n_routed_experts"), experts_per_token=hf.require("num_experts_per_tok"),
               d_ff=F, dense_layers=dense, dense_d_ff=hf.require("intermediate_size"), router_score="sigmoid",
               router_groups=hf.get("n_group", 1), router_group_top=hf.get("topk_group", 1), router_bias=True,
               router_scale=float(hf.get("routed_scaling_factor", 1.0)),
               router_norm_topk=bool(hf.get("norm_topk_prob", True)), shared_expert_d_ff=F * hf.get("n_shared_experts", 0),
               shared_expert_gate=False, router_aux_loss_coef=0.0)
    if dense >= layers:
        raise hf.unsupported("first_k_dense_replace", dense, f"tfm's MoE model needs a MoE layer of {layers}")
    return llama.config(hf, rope=rope(hf, 10_000.0, partial=True), attention_out_bias=False,
                        qk_norm=bool(hf.get("use_qk_norm", False)), **moe)


def ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    return deepseek_v3.ffn(w, p, cfg, dense=False)


def params(w: Weights, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, ffn=ffn)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if not (cfg.num_experts and cfg.router_score == "sigmoid" and cfg.attention_out_bias is False):
        raise ConversionError("GLM-4.5 routes by sigmoid scores and has no bias on o_proj")
    out = llama.hf_config(cfg, model_type="glm4_moe")
    del out["mlp_bias"]
    out["rope_parameters"]["partial_rotary_factor"] = cfg.rope.dim / cfg.head_dim
    return dict(out, use_qk_norm=cfg.qk_norm, intermediate_size=cfg.dense_d_ff or cfg.d_ff,
                moe_intermediate_size=cfg.d_ff, first_k_dense_replace=cfg.dense_layers,
                n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token, n_group=cfg.router_groups,
                topk_group=cfg.router_group_top, routed_scaling_factor=cfg.router_scale,
                norm_topk_prob=cfg.router_norm_topk, n_shared_experts=cfg.shared_expert_d_ff // cfg.d_ff)


INERT = ("num_nextn_predict_layers",)  # the multi-token-prediction layers, which HF's model does not build
ARCHITECTURES = {"Glm4MoeForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config,
                                                    inert=INERT)}
