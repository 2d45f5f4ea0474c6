"""GLM and GLM-4 (GlmForCausalLM, Glm4ForCausalLM) -> tfm DecoderLM: the Llama mapping with a fused
`gate_up_proj`, biases on q, k, v only (attention_bias; none on o_proj), and RoPE on adjacent pairs of the first
partial_rotary_factor of each head. GLM-4 puts each sublayer between two norms (norm_position="sandwich":
input_layernorm / post_self_attn_layernorm, post_attention_layernorm / post_mlp_layernorm)."""
from __future__ import annotations

import dataclasses

from tfm.config import ModelConfig
from tfm.convert import llama
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights, rope
from tfm.models import DecoderLM

GLM4_NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_self_attn_layernorm",
              "ffn_norm": "post_attention_layernorm", "ffn_post_norm": "post_mlp_layernorm"}


def config(hf: HFConfig, **extra) -> ModelConfig:
    rotary = dataclasses.replace(rope(hf, 10_000.0, partial=True), interleaved=True)
    return llama.config(hf, rope=rotary, attention_out_bias=False, **extra)


def glm4_config(hf: HFConfig) -> ModelConfig:
    return config(hf, norm_position="sandwich")


def params(w: Weights, cfg: ModelConfig) -> dict:
    norms = GLM4_NORMS if cfg.norm_position == "sandwich" else llama.NORMS
    return llama.params(w, cfg, ffn=llama.fused_ffn, norms=norms)


def hf_config(cfg: ModelConfig, model_type: str = "glm") -> dict:
    """The inverse of `config` (export)."""
    if not cfg.rope.interleaved or cfg.attention_out_bias is not False or cfg.ffn_bias:
        raise ConversionError("GLM rotates adjacent pairs, and has no bias on o_proj and the feed-forward")
    out = llama.hf_config(cfg, model_type=model_type)
    del out["mlp_bias"]
    out["rope_parameters"]["partial_rotary_factor"] = cfg.rope.dim / cfg.head_dim
    return out


def glm4_hf_config(cfg: ModelConfig) -> dict:
    if cfg.norm_position != "sandwich":
        raise ConversionError("GLM-4 puts each sublayer between two norms (norm_position='sandwich')")
    return hf_config(cfg, "glm4")


ARCHITECTURES = {
    "GlmForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config),
    "Glm4ForCausalLM": Converter(DecoderLM, glm4_config, params, ignore=llama.IGNORE, hf_config=glm4_hf_config),
}
