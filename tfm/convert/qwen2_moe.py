"""Qwen2-MoE (Qwen2MoeForCausalLM) -> tfm DecoderLM: the Qwen2 mapping (q, k, v biases, layer_types)
with a top-k MoE feed-forward on every layer plus Qwen2-MoE's shared expert.

Experts are moe_intermediate_size wide (tfm d_ff); the shared expert, shared_expert_intermediate_size
wide, is added under a per-token sigmoid gate (`shared_expert_gate` [1, D]); norm_topk_prob=False
keeps the raw softmax probabilities of the chosen experts (router_norm_topk). Layers with a dense
feed-forward (mlp_only_layers, decoder_sparse_step > 1) are refused: tfm's MoE is on every layer.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama, mixtral, qwen2
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    hf.expect("qkv_bias", [True], True)
    hf.expect("decoder_sparse_step", [1], 1)
    if hf.get("mlp_only_layers"):
        raise hf.unsupported("mlp_only_layers", hf.get("mlp_only_layers"), "tfm puts the MoE on every layer")
    return qwen2.config(hf, d_ff=hf.require("moe_intermediate_size"), num_experts=hf.require("num_experts"),
                        experts_per_token=hf.get("num_experts_per_tok", 4),
                        router_norm_topk=bool(hf.get("norm_topk_prob", False)),
                        shared_expert_d_ff=hf.require("shared_expert_intermediate_size"),
                        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))


def moe_ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    out = mixtral.moe_ffn(w, p, cfg, hub_block="mlp", hub_names=("gate_proj", "up_proj", "down_proj"))
    out["shared_expert"] = llama.swiglu(w, f"{p}.mlp.shared_expert", bias=False)
    out["shared_expert_gate"] = {"kernel": w(f"{p}.mlp.shared_expert_gate.weight", (1, cfg.d_model))[0]}  # [D]
    return out


def params(w: Weights, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, ffn=moe_ffn)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export); a MoE without a shared expert has no Qwen2-MoE form."""
    if cfg.num_experts < 1 or cfg.shared_expert_d_ff < 1:
        raise ConversionError(f"num_experts={cfg.num_experts}, shared_expert_d_ff={cfg.shared_expert_d_ff}: "
                              "Qwen2-MoE has experts and a shared expert on every layer")
    out = qwen2.hf_config(cfg, model_type="qwen2_moe")
    return dict(out, num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                moe_intermediate_size=cfg.d_ff, shared_expert_intermediate_size=cfg.shared_expert_d_ff,
                norm_topk_prob=cfg.router_norm_topk, router_aux_loss_coef=cfg.router_aux_loss_coef,
                decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True)


ARCHITECTURES = {"Qwen2MoeForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE,
                                                     hf_config=hf_config)}
