"""Gemma 2 and Gemma 3 text (Gemma2ForCausalLM, Gemma3ForCausalLM) -> tfm DecoderLM: the Llama mapping with
zero-centred RMSNorm scales (1 + w: norm_scale_offset 1), each sublayer between two norms (norm_position="sandwich":
input / post_attention, pre_feedforward / post_feedforward), embeddings times sqrt(D), tanh-GeLU gates,
attention logits times query_pre_attn_scalar**-0.5, HF's layer_types (sliding or full) as the attention pattern;
Gemma 2 soft-caps attention and final logits; Gemma 3 normalises each query and key head and rotates its sliding
layers by their own base (rope_parameters["sliding_attention"] -> local_rope)."""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama, qwen2
from tfm.convert.common import ConversionError, Converter, HFConfig, hf_activation, hf_layer_ropes, layer_ropes
from tfm.models import DecoderLM

NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
         "ffn_norm": "pre_feedforward_layernorm", "ffn_post_norm": "post_feedforward_layernorm"}


def config(hf: HFConfig, **extra) -> ModelConfig:
    hf.expect("use_bidirectional_attention", [None, False], None)
    cap = lambda name: None if hf.get(name) is None else float(hf.get(name))
    return llama.config(
        hf, norm_scale_offset=1.0, norm_position="sandwich", scale_embeddings=True,
        activation=hf.activation("hidden_activation", "gelu_pytorch_tanh", gated=True),
        attention_scale=float(hf.require("query_pre_attn_scalar")) ** -0.5,
        attn_logit_softcap=cap("attn_logit_softcapping"), final_logit_softcap=cap("final_logit_softcapping"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), **qwen2.attention_layers(hf), **extra)


def gemma3_config(hf: HFConfig) -> ModelConfig:
    return config(hf, qk_norm=True, **layer_ropes(hf, 10_000.0))


def params(w, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, norms=NORMS)


def hf_config(cfg: ModelConfig, model_type: str = "gemma2") -> dict:
    """The inverse of `config` (export)."""
    if cfg.attention_scale is None or cfg.norm_position != "sandwich":
        raise ConversionError("Gemma scales its attention logits by query_pre_attn_scalar (attention_scale) and "
                              "sandwiches each sublayer between two norms")
    out = llama.hf_config(cfg, model_type=model_type)
    del out["hidden_act"], out["mlp_bias"]
    return dict(out, hidden_activation=hf_activation(cfg.activation, gated=True),
                query_pre_attn_scalar=_whole(cfg.attention_scale ** -2), attn_logit_softcapping=cfg.attn_logit_softcap,
                final_logit_softcapping=cfg.final_logit_softcap, **qwen2.hf_attention_layers(cfg))


def _whole(x: float):
    """x as the integer it rounds to when it is one (HF configs give query_pre_attn_scalar as an int)."""
    return round(x) if abs(x - round(x)) < 1e-6 else x


def gemma3_hf_config(cfg: ModelConfig) -> dict:
    return dict(hf_config(cfg, "gemma3_text"), **hf_layer_ropes(cfg))


INERT = ("_sliding_window_pattern",)  # Gemma 3's, which layer_types spells out
ARCHITECTURES = {
    "Gemma2ForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config),
    "Gemma3ForCausalLM": Converter(DecoderLM, gemma3_config, params, ignore=llama.IGNORE, hf_config=gemma3_hf_config,
                                   inert=INERT),
}
