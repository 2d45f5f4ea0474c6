"""Llama (LlamaForCausalLM) -> tfm DecoderLM; its pieces also serve Mistral, Qwen2 and Mixtral.

Pre-norm RMSNorm, RoPE in the rotate-halves layout (HF checkpoints are already permuted for it)
with Llama 3.x's long-context scalings (llama3, yarn, dynamic; `common.rope`), GQA, SwiGLU,
untied output by default.
"""
from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from tfm.config import GATED_ACTIVATIONS as GATED, ModelConfig
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, attention, dense, hf_activation, hf_rope,
                                linear, linear_pair, model_params, norm, rope)
from tfm.models import DecoderLM


def config(hf: HFConfig, default_theta: float = 10_000.0, **extra) -> ModelConfig:
    """Decoder fields shared by the Llama family; `extra` adds the variant's own (MoE, window)."""
    D, N = hf.require("hidden_size"), hf.require("num_attention_heads")
    vocab = hf.require("vocab_size")
    kw = dict(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads", N),
        head_dim=hf.get("head_dim", D // N), num_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"), max_len=hf.get("max_position_embeddings", 2048), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), norm_position="pre", final_norm=True, position="rope",
        attention_bias=bool(hf.get("attention_bias", False)), ffn_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_id=hf.pad_id(vocab),
        attention_dropout=hf.get("attention_dropout", 0.0))
    if "rope" not in extra:  # a variant's own reading replaces Llama's (which might refuse what it allows)
        kw["rope"] = rope(hf, default_theta)
    if "activation" not in extra:
        kw["activation"] = hf.activation("hidden_act", "silu", gated=True)
    return ModelConfig(**{**kw, **extra})


def swiglu(w: Weights, prefix: str, bias: bool) -> dict:
    """`prefix.{gate,up,down}_proj` -> an Mlp's wi_gate, wi_up, wo (also the MoE families' shared experts)."""
    return {"wi_gate": linear(w, f"{prefix}.gate_proj", bias), "wi_up": linear(w, f"{prefix}.up_proj", bias),
            "wo": linear(w, f"{prefix}.down_proj", bias)}


def dense_ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    return swiglu(w, f"{p}.mlp", cfg.ffn_bias)


def fused_ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """`p.mlp.gate_up_proj` [2F, D] (gate rows, then up) and `p.mlp.down_proj` (Phi-3, GLM), no biases."""
    gate, up = np.split(w(f"{p}.mlp.gate_up_proj.weight", (2 * cfg.d_ff, cfg.d_model)), 2)
    return {"wi_gate": dense(gate), "wi_up": dense(up), "wo": linear(w, f"{p}.mlp.down_proj", False)}


def fused_qkv(w: Weights, p: str, cfg: ModelConfig) -> list:
    """`p.qkv_proj` [(N + 2K) * H, D], q rows then k then v, as q/k/v (weight, bias-or-None) pairs (Phi-3)."""
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    weight = w(f"{p}.qkv_proj.weight", ((N + 2 * K) * H, cfg.d_model))
    bias = w(f"{p}.qkv_proj.bias") if cfg.attention_bias else None
    cuts = [N * H, (N + K) * H]
    biases = [None] * 3 if bias is None else np.split(bias, cuts)
    return list(zip(np.split(weight, cuts), biases))


# A layer's norms: {tfm Block param: HF module name}; its per-head q/k norms: {tfm: HF name in self_attn}
NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
QK_NORMS = {"query": "q_norm", "key": "k_norm"}


def qkv(w: Weights, p: str, cfg: ModelConfig) -> list:
    """`p.{q,k,v}_proj` as (weight, bias-or-None) pairs in torch Linear layout."""
    return [linear_pair(w, f"{p}.{n}_proj", cfg.attention_bias) for n in ("q", "k", "v")]


def layer(w: Weights, p: str, cfg: ModelConfig, ffn: Callable, norms: Mapping[str, str] = NORMS,
          projections: Callable = qkv, qk_norms: Mapping[str, str] = QK_NORMS) -> dict:
    """HF layer `p` (self_attn with `projections(w, p.self_attn, cfg)` and o_proj, the norms `norms`, the
    feed-forward `ffn(w, p, cfg)`) -> a Block's params; per-head q/k norms as `self_attn.{q,k}_norm` with
    cfg.qk_norm (flat over all heads with qk_norm_scope="heads"), and `self_attn.sinks` with cfg.attention_sinks."""
    b = cfg.attention_bias
    out_bias = b if cfg.attention_out_bias is None else cfg.attention_out_bias
    qkvo = projections(w, f"{p}.self_attn", cfg) + [linear_pair(w, f"{p}.self_attn.o_proj", out_bias)]
    out = {name: norm(w, f"{p}.{hf_name}", cfg.norm, cfg.norm_bias) for name, hf_name in norms.items()}
    out["self_attn"] = attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if cfg.attention_sinks:
        out["self_attn"]["sinks"] = w(f"{p}.self_attn.sinks", (cfg.num_heads,))
    if cfg.qk_norm:
        flat = cfg.qk_norm_scope == "heads"
        for name, heads in (("query", cfg.num_heads), ("key", cfg.num_kv_heads)):
            shape = (heads * cfg.head_dim,) if flat else (cfg.head_dim,)
            out["self_attn"][f"{name}_norm"] = {"scale": w(f"{p}.self_attn.{qk_norms[name]}.weight", shape)}
    out["ffn"] = ffn(w, p, cfg)
    return out


def params(w: Weights, cfg: ModelConfig, ffn: Callable = dense_ffn, dense: Callable = dense_ffn, **layout) -> dict:
    """The Llama layout's param tree; `layout`: `layer`'s norms and projections. A MoE model's dense layers (its
    first cfg.dense_layers, and "dense" ones of ffn_pattern) take `dense` instead of `ffn`."""
    ffns = lambda i: dense if cfg.num_experts and cfg.layer_ffn(i, dense=i < cfg.dense_layers) == "dense" else ffn
    decoder = Stack(lambda i: layer(w, f"model.layers.{i}", cfg, ffns(i), **layout), cfg.num_layers,
                    final_norm="model.norm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig, model_type: str = "llama", bias_fields: bool = True) -> dict:
    """The inverse of `config` (export); variants add their own fields (bias_fields=False: the
    variant has no attention_bias / mlp_bias field, its biases are fixed)."""
    if cfg.position != "rope":
        raise ConversionError(f"{model_type} rotates its queries and keys (position='rope'), got {cfg.position!r}")
    out = dict(model_type=model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                num_hidden_layers=cfg.num_layers, intermediate_size=cfg.d_ff, max_position_embeddings=cfg.max_len,
                rms_norm_eps=cfg.norm_eps, hidden_act=hf_activation(cfg.activation, gated=cfg.activation in GATED),
                attention_bias=cfg.attention_bias, mlp_bias=cfg.ffn_bias, tie_word_embeddings=cfg.tie_embeddings,
                pad_token_id=cfg.pad_id, attention_dropout=cfg.attention_dropout, **hf_rope(cfg))
    if not bias_fields:
        del out["attention_bias"], out["mlp_bias"]
    return out


IGNORE = ("*rotary_emb.inv_freq",)
ARCHITECTURES = {"LlamaForCausalLM": Converter(DecoderLM, config, params, ignore=IGNORE, hf_config=hf_config)}
