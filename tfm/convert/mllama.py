"""Llama 3.2 Vision's text model (MllamaForCausalLM) -> tfm DecoderLM with gated cross-attention layers.

A Llama decoder (`llama`) whose layers at `cross_attention_layers` attend to image features
instead of to the text: q/k RMSNorm on the cross-attention, tanh gates (HF tensors of shape [1])
on its attention and feed-forward outputs. The token table has 8 rows past vocab_size (the image
tokens), which the untied output projection does not predict.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama
from tfm.convert.common import Converter, HFConfig, Stack, Weights, attention, linear_pair, model_params, norm
from tfm.models import DecoderLM

EXTRA_TOKENS = 8  # MllamaTextModel embeds vocab_size + 8 ids


def config(hf: HFConfig) -> ModelConfig:
    D, N = hf.require("hidden_size"), hf.require("num_attention_heads")
    layers = tuple(hf.get("cross_attention_layers", ()))
    return llama.config(hf, head_dim=D // N,
                        multimodal=dict(cross_attention_layers=layers, extra_tokens=EXTRA_TOKENS))


def cross_layer(w: Weights, p: str, cfg: ModelConfig) -> dict:
    qkvo = [linear_pair(w, f"{p}.cross_attn.{n}_proj", False) for n in ("q", "k", "v", "o")]
    cross = attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    cross.update(query_norm=norm(w, f"{p}.cross_attn.q_norm", "rmsnorm"),
                 key_norm=norm(w, f"{p}.cross_attn.k_norm", "rmsnorm"))
    return {"cross_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"), "cross_attn": cross,
            "cross_gate": w(f"{p}.cross_attn_attn_gate", (1,)).reshape(()),
            "ffn_norm": norm(w, f"{p}.post_attention_layernorm", "rmsnorm"), "ffn": llama.dense_ffn(w, p, cfg),
            "ffn_gate": w(f"{p}.cross_attn_mlp_gate", (1,)).reshape(())}


def params(w: Weights, cfg: ModelConfig) -> dict:
    def layer(i):
        p = f"model.layers.{i}"
        if i in cfg.multimodal.cross_attention_layers:
            return cross_layer(w, p, cfg)
        return llama.layer(w, p, cfg, llama.dense_ffn)

    decoder = Stack(layer, cfg.num_layers, final_norm="model.norm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    out = llama.hf_config(cfg, "mllama_text_model", bias_fields=False)
    del out["head_dim"], out["attention_dropout"]
    return {**out, "cross_attention_layers": list(cfg.multimodal.cross_attention_layers)}


ARCHITECTURES = {"MllamaForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config)}
