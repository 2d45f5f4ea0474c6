"""Cohere (Command R: CohereForCausalLM) and Cohere 2 (Command R7B / A: Cohere2ForCausalLM) -> tfm DecoderLM:
a parallel block under one bias-free LayerNorm (x + attn(n x) + mlp(n x)), RoPE on adjacent pairs (interleaved),
SwiGLU, a tied output whose logits are multiplied by logit_scale. Cohere 2 adds HF's layer_types: sliding layers
rotate, full layers have no positions (position_pattern "none" there). Cohere's use_qk_norm (per-head LayerNorm
weights) is refused by name."""
from __future__ import annotations

import dataclasses

from tfm.config import ModelConfig
from tfm.convert import llama, qwen2
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights, rope
from tfm.models import DecoderLM


def config(hf: HFConfig, **extra) -> ModelConfig:
    hf.expect("use_qk_norm", [False], False)
    return llama.config(
        hf, norm="layernorm", norm_bias=False, norm_eps=hf.get("layer_norm_eps", 1e-5), parallel_block=True,
        rope=dataclasses.replace(rope(hf, 10_000.0), interleaved=True),
        logits_multiplier=float(hf.get("logit_scale", 1.0)), tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        **extra)


def cohere2_config(hf: HFConfig) -> ModelConfig:
    hf.require("layer_types")  # which layers rotate: a config without them is not Cohere 2's
    layers = qwen2.attention_layers(hf)
    kinds = layers["attention_pattern"] or ("local" if layers["sliding_window"] else "global",)
    positions = tuple("rope" if kind == "local" else "none" for kind in kinds)
    return config(hf, **layers, position_pattern=None if set(positions) == {"rope"} else positions)


def params(w: Weights, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, norms={"attn_norm": "input_layernorm"})  # the parallel block's one norm


def hf_config(cfg: ModelConfig, model_type: str = "cohere") -> dict:
    """The inverse of `config` (export)."""
    if not (cfg.parallel_block and cfg.rope.interleaved):
        raise ConversionError("Cohere runs a parallel block and rotates adjacent pairs")
    out = llama.hf_config(cfg, model_type=model_type)
    del out["rms_norm_eps"], out["mlp_bias"]
    return dict(out, layer_norm_eps=cfg.norm_eps, logit_scale=cfg.logits_multiplier, use_qk_norm=False)


def cohere2_hf_config(cfg: ModelConfig) -> dict:
    out = dict(hf_config(cfg, "cohere2"), **qwen2.hf_attention_layers(cfg))
    del out["use_qk_norm"]
    return out


ARCHITECTURES = {
    "CohereForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config),
    "Cohere2ForCausalLM": Converter(DecoderLM, cohere2_config, params, ignore=llama.IGNORE,
                                    hf_config=cohere2_hf_config),
}
