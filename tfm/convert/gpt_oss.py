"""gpt-oss (GptOssForCausalLM) -> tfm DecoderLM: the Llama mapping with attention sinks (`self_attn.sinks` [N]:
attention_sinks), biases on every attention projection, HF's layer_types (sliding / full alternating) as the
attention pattern, YaRN RoPE, and a mixture of experts on every layer whose router has a logit bias
(router_logit_bias), top-k chosen on its logits and softmaxed over them (= renormalised top-k softmax gates),
and whose experts have biases (ffn_bias) and gpt-oss's clamped SwiGLU (activation "swiglu_clamped": swiglu_limit,
swiglu_alpha). The experts' gate_up_proj [E, D, 2F] interleaves gate (even columns) and up (odd)."""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama, qwen2
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    hf.expect("hidden_act", ["silu"], "silu")  # the gate's sigmoid, whatever its alpha
    return llama.config(
        hf, default_theta=150_000.0, attention_bias=bool(hf.get("attention_bias", True)), attention_sinks=True,
        num_experts=hf.require("num_local_experts"), experts_per_token=hf.require("num_experts_per_tok"),
        router_norm_topk=True, router_logit_bias=True, ffn_bias=True, activation="swiglu_clamped",
        swiglu_limit=float(hf.require("swiglu_limit")), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001), **qwen2.attention_layers(hf))


def moe_ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    E, D, F = cfg.num_experts, cfg.d_model, cfg.d_ff
    q = f"{p}.mlp"
    gate_up = w(f"{q}.experts.gate_up_proj", (E, D, 2 * F))
    gate_up_bias = w(f"{q}.experts.gate_up_proj_bias", (E, 2 * F))
    return {"router": {"kernel": w(f"{q}.router.weight", (E, D)).T, "bias": w(f"{q}.router.bias", (E,))},
            "wi_gate": gate_up[..., 0::2], "wi_up": gate_up[..., 1::2],  # [E, D, F]
            "wi_gate_bias": gate_up_bias[:, 0::2], "wi_up_bias": gate_up_bias[:, 1::2],  # [E, F]
            "wo": w(f"{q}.experts.down_proj", (E, F, D)), "wo_bias": w(f"{q}.experts.down_proj_bias", (E, D))}


def params(w: Weights, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, ffn=moe_ffn)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if not (cfg.attention_sinks and cfg.num_experts and cfg.activation == "swiglu_clamped" and cfg.ffn_bias
            and cfg.router_logit_bias and cfg.router_norm_topk):
        raise ConversionError("gpt-oss has attention sinks and biased experts with clamped SwiGLU under a biased "
                              "router on every layer")
    out = llama.hf_config(cfg.replace(activation="swiglu"), model_type="gpt_oss")  # hidden_act "silu", the gate's
    del out["mlp_bias"]
    return dict(out, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha, router_aux_loss_coef=cfg.router_aux_loss_coef,
                **qwen2.hf_attention_layers(cfg))


ARCHITECTURES = {"GptOssForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config)}
