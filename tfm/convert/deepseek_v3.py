"""DeepSeek-V3 (DeepseekV3ForCausalLM) -> tfm DecoderLM with multi-head latent attention.

The Llama decoder with `ModelConfig.mla`: queries through the latent q_a_proj -> q_a_layernorm ->
q_b_proj (or one q_proj), keys and values up from the normed kv latent (kv_a_proj_with_mqa's
first kv_lora_rank rows -> kv_a_layernorm -> kv_b_proj), and the RoPE key shared by the heads
(kv_a_proj_with_mqa's last qk_rope_head_dim rows). HF lays a query/key head out as [no-position
part, RoPE part]; tfm puts the RoPE part first (RoPE rotates a head's first rope.dim dims), a
permutation of head dims that leaves every q.k unchanged. HF's `rope_interleave` (pairs rotated
together) is tfm's rope.interleaved. YaRN's mscale_all_dim scales the softmax as HF does
(mla.softmax_scale_factor).

Feed-forward: the first first_k_dense_replace layers dense (intermediate_size: tfm dense_d_ff), the
rest DeepSeekMoE: n_routed_experts of moe_intermediate_size (tfm d_ff) chosen by sigmoid scores plus
the balancing bias `e_score_correction_bias` (tfm score_bias) within the topk_group best of n_group
groups, gates renormalised and times routed_scaling_factor, plus n_shared_experts always-on experts
(one ungated Mlp n_shared_experts times as wide). HF computes no auxiliary loss: router_aux_loss_coef 0.
"""
from __future__ import annotations

import math

import numpy as np

from tfm.config import MlaConfig, ModelConfig
from tfm.convert import llama, mixtral
from tfm.convert.common import ConversionError, Converter, HFConfig, Stack, Weights, dense, model_params, norm
from tfm.models import DecoderLM

# The latent norms are built by HF without an eps, so they use RMSNorm's default (mla.latent_norm_eps).
LATENT_NORM_EPS = 1e-6


def config(hf: HFConfig) -> ModelConfig:
    nope, rope_dim = hf.require("qk_nope_head_dim"), hf.require("qk_rope_head_dim")
    layers, dense = hf.require("num_hidden_layers"), hf.get("first_k_dense_replace", 3)
    moe = {}
    if dense < layers:
        F = hf.require("moe_intermediate_size")
        moe = dict(num_experts=hf.require("n_routed_experts"), experts_per_token=hf.get("num_experts_per_tok", 8),
                   d_ff=F, dense_layers=dense, dense_d_ff=hf.require("intermediate_size"), router_score="sigmoid",
                   router_groups=hf.get("n_group", 1), router_group_top=hf.get("topk_group", 1), router_bias=True,
                   router_scale=float(hf.get("routed_scaling_factor", 1.0)),
                   router_norm_topk=bool(hf.get("norm_topk_prob", True)),
                   shared_expert_d_ff=F * hf.get("n_shared_experts", 0), shared_expert_gate=False,
                   router_aux_loss_coef=0.0)
    base = llama.config(hf, head_dim=nope + rope_dim, num_kv_heads=hf.require("num_attention_heads"), **moe)
    mla = MlaConfig(kv_rank=hf.require("kv_lora_rank"), rope_dim=rope_dim, q_rank=hf.get("q_lora_rank"),
                    value_dim=hf.get("v_head_dim") or nope + rope_dim, softmax_scale_factor=_softmax_factor(hf),
                    latent_norm_eps=LATENT_NORM_EPS)
    rope = {"interleaved": bool(hf.get("rope_interleave", True))}
    return base.replace(mla=mla, rope=rope)


def _softmax_factor(hf: HFConfig) -> float:
    """HF's yarn_apply_mscale: with a scaled RoPE and mscale_all_dim, the logits' scale times mscale**2."""
    scaling = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor, all_dim = scaling.get("factor", 1.0), scaling.get("mscale_all_dim")
    if kind == "default" or not all_dim or factor <= 1:
        return 1.0
    return (0.1 * all_dim * math.log(factor) + 1.0) ** 2


def _rope_first(kernel: np.ndarray, nope: int) -> np.ndarray:
    """[..., N, nope + R] with HF's head layout -> tfm's [..., N, R + nope]."""
    return np.concatenate([kernel[..., nope:], kernel[..., :nope]], axis=-1)


def attention(w: Weights, p: str, cfg: ModelConfig) -> dict:
    mla, N, H, D = cfg.mla, cfg.num_heads, cfg.head_dim, cfg.d_model
    C, R, Hv = mla.kv_rank, mla.rope_dim, mla.value_dim
    nope, bias = H - R, cfg.attention_bias
    a = f"{p}.self_attn"
    out = {}
    if mla.q_rank is None:
        out["query"] = {"kernel": _rope_first(w(f"{a}.q_proj.weight", (N * H, D)).T.reshape(D, N, H), nope)}
    else:
        Q = mla.q_rank
        out["q_down"] = dense(w(f"{a}.q_a_proj.weight", (Q, D)), w(f"{a}.q_a_proj.bias") if bias else None)
        out["q_norm"] = norm(w, f"{a}.q_a_layernorm", "rmsnorm")
        out["q_up"] = {"kernel": _rope_first(w(f"{a}.q_b_proj.weight", (N * H, Q)).T.reshape(Q, N, H), nope)}
    kv_a = w(f"{a}.kv_a_proj_with_mqa.weight", (C + R, D))
    kv_a_bias = w(f"{a}.kv_a_proj_with_mqa.bias") if bias else None
    out["kv_down"] = dense(kv_a[:C], None if kv_a_bias is None else kv_a_bias[:C])
    out["key_rope"] = dense(kv_a[C:], None if kv_a_bias is None else kv_a_bias[C:])
    out["kv_norm"] = norm(w, f"{a}.kv_a_layernorm", "rmsnorm")
    kv_b = w(f"{a}.kv_b_proj.weight", (N * (nope + Hv), C)).T.reshape(C, N, nope + Hv)
    out["key_up"], out["value_up"] = {"kernel": kv_b[..., :nope]}, {"kernel": kv_b[..., nope:]}
    o = dense(w(f"{a}.o_proj.weight", (D, N * Hv)), w(f"{a}.o_proj.bias") if bias else None)
    out["out"] = dict(o, kernel=o["kernel"].reshape(N, Hv, D))
    return out


def ffn(w: Weights, p: str, cfg: ModelConfig, dense: bool, block: str = "mlp",
        hub_names: tuple = ("gate_proj", "up_proj", "down_proj")) -> dict:
    """A dense SwiGLU, or the routed experts with the router's balancing bias and the shared experts, at
    `{p}.{block}` (the checkpoint's experts named hub_names, as `mixtral.moe_ffn` reads them)."""
    if dense:
        return llama.swiglu(w, f"{p}.{block}", cfg.ffn_bias)
    out = mixtral.moe_ffn(w, p, cfg, hub_block=block, hub_names=hub_names)
    out["score_bias"] = w(f"{p}.{block}.gate.e_score_correction_bias", (cfg.num_experts,))
    if cfg.shared_expert_d_ff:
        out["shared_expert"] = llama.swiglu(w, f"{p}.{block}.shared_experts", bias=False)
    return out


def layer(w: Weights, p: str, cfg: ModelConfig, i: int) -> dict:
    dense = not cfg.num_experts or i < cfg.dense_layers
    return {"attn_norm": norm(w, f"{p}.input_layernorm", cfg.norm), "self_attn": attention(w, p, cfg),
            "ffn_norm": norm(w, f"{p}.post_attention_layernorm", cfg.norm), "ffn": ffn(w, p, cfg, dense)}


def params(w: Weights, cfg: ModelConfig) -> dict:
    decoder = Stack(lambda i: layer(w, f"model.layers.{i}", cfg, i), cfg.num_layers, final_norm="model.norm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if cfg.mla is None:
        raise ConversionError("DeepSeek-V3's attention is multi-head latent attention: ModelConfig.mla is None")
    if (cfg.mla.latent_norm_eps or cfg.norm_eps) != LATENT_NORM_EPS:
        raise ConversionError(f"mla.latent_norm_eps={cfg.mla.latent_norm_eps or cfg.norm_eps}: transformers builds "
                              f"the latent norms with {LATENT_NORM_EPS}")
    out = llama.hf_config(cfg, model_type="deepseek_v3", bias_fields=False)
    del out["head_dim"]
    mla = cfg.mla
    out = dict(out, attention_bias=cfg.attention_bias, kv_lora_rank=mla.kv_rank, q_lora_rank=mla.q_rank,
               qk_rope_head_dim=mla.rope_dim, qk_nope_head_dim=cfg.head_dim - mla.rope_dim,
               v_head_dim=mla.value_dim, rope_interleave=cfg.rope.interleaved)
    if not cfg.num_experts:
        return dict(out, first_k_dense_replace=cfg.num_layers, n_routed_experts=1, num_experts_per_tok=1,
                    n_group=1, topk_group=1)
    return dict(out, intermediate_size=cfg.dense_d_ff or cfg.d_ff, moe_intermediate_size=cfg.d_ff,
                first_k_dense_replace=cfg.dense_layers, n_routed_experts=cfg.num_experts,
                num_experts_per_tok=cfg.experts_per_token, n_group=cfg.router_groups, topk_group=cfg.router_group_top,
                routed_scaling_factor=cfg.router_scale, norm_topk_prob=cfg.router_norm_topk,
                n_shared_experts=cfg.shared_expert_d_ff // cfg.d_ff)


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("num_nextn_predict_layers", "qk_head_dim")
ARCHITECTURES = {"DeepseekV3ForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE,
                                                    hf_config=hf_config, inert=INERT, export_rank=1)}
