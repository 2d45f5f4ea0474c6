"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM) -> tfm DecoderLM: the Llama mapping with each
sublayer's RMSNorm on its output inside the residual (x + norm(f(x)): norm_position="post_sublayer";
`post_attention_layernorm`, `post_feedforward_layernorm`), and q/k RMSNorm over all heads of a token together
(`q_norm` [N*H], `k_norm` [K*H]: qk_norm_scope="heads"), before RoPE; no biases. OLMo 3 adds sliding-window
layers (layer_types, as Qwen2's)."""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama, qwen2
from tfm.convert.common import Converter, HFConfig, Weights, hf_layer_ropes, layer_ropes
from tfm.models import DecoderLM

FEATURES = dict(norm_position="post_sublayer", qk_norm=True, qk_norm_scope="heads")


def config(hf: HFConfig) -> ModelConfig:
    return llama.config(hf, **FEATURES)


def olmo3_config(hf: HFConfig) -> ModelConfig:
    return llama.config(hf, **FEATURES, **qwen2.attention_layers(hf), **layer_ropes(hf, 10_000.0))


NORMS = {"attn_norm": "post_attention_layernorm", "ffn_norm": "post_feedforward_layernorm"}


def params(w: Weights, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, norms=NORMS)


def hf_config(cfg: ModelConfig) -> dict:
    out = llama.hf_config(cfg, model_type="olmo2")
    del out["mlp_bias"], out["head_dim"]
    return out


def olmo3_hf_config(cfg: ModelConfig) -> dict:
    return dict(hf_config(cfg), model_type="olmo3", **qwen2.hf_attention_layers(cfg), **hf_layer_ropes(cfg))


ARCHITECTURES = {
    "Olmo2ForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config),
    "Olmo3ForCausalLM": Converter(DecoderLM, olmo3_config, params, ignore=llama.IGNORE, hf_config=olmo3_hf_config),
}
