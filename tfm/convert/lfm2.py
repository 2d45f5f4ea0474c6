"""LFM2 (Lfm2ForCausalLM) -> tfm DecoderLM: gated short convolutions ("short_conv") beside GQA attention
layers (HF layer_types "conv" / "full_attention", or full_attn_idxs) as mixer_pattern; RMSNorm over each
query and key head before RoPE; a SwiGLU feed-forward in every layer; pre-norm (`operator_norm`,
`ffn_norm`) and a final RMSNorm HF calls `embedding_norm`.

HF's conv.in_proj rows are the b, c and h projections in that order; conv.conv is the depthwise
convolution over b * h, [D, 1, conv_L_cache]. The feed-forward's width is intermediate_size, adjusted
as HF adjusts it when block_auto_adjust_ff_dim is set (2/3 of it, times block_ffn_dim_multiplier, rounded
up to block_multiple_of); export writes the adjusted width with block_auto_adjust_ff_dim=False.
"""
from __future__ import annotations

import numpy as np

from tfm.config import ModelConfig
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, attention, dense, hf_rope,
                                linear, linear_pair, model_params, norm, period, rope)
from tfm.models import DecoderLM

KINDS = {"conv": "short_conv", "full_attention": "attention"}  # HF layer_types -> mixer_pattern


def ffn_width(hf: HFConfig) -> int:
    """The feed-forward width HF's Lfm2MLP builds from intermediate_size and the block_* fields."""
    width = hf.require("intermediate_size")
    if hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier, multiple = hf.get("block_ffn_dim_multiplier", 1.0), hf.get("block_multiple_of", 256)
        if multiplier is not None:
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    else:
        hf.has("block_ffn_dim_multiplier"), hf.has("block_multiple_of")
    return width


def layer_kinds(hf: HFConfig, L: int) -> list:
    """HF layer_types (or the layers at full_attn_idxs attend) -> tfm mixer kinds, one per layer."""
    types = hf.get("layer_types")
    attends = hf.get("full_attn_idxs")
    if types is None:
        types = ["full_attention" if attends is None or i in attends else "conv" for i in range(L)]
    if len(types) != L or set(types) - set(KINDS):
        raise hf.unsupported("layer_types", types, f"tfm maps {sorted(KINDS)}, one per layer")
    return [KINDS[t] for t in types]


def config(hf: HFConfig) -> ModelConfig:
    D, N, L = hf.require("hidden_size"), hf.require("num_attention_heads"), hf.require("num_hidden_layers")
    vocab = hf.require("vocab_size")
    mixers = period(layer_kinds(hf, L))
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads", N),
        head_dim=hf.get("head_dim", D // N), num_layers=L, d_ff=ffn_width(hf),
        max_len=hf.get("max_position_embeddings", 128_000), norm="rmsnorm", norm_eps=hf.get("norm_eps", 1e-5),
        norm_position="pre", final_norm=True, position="rope", rope=rope(hf, 1_000_000.0), activation="swiglu",
        attention_bias=False, ffn_bias=False, qk_norm=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        pad_id=hf.pad_id(vocab), mixer_pattern=None if mixers == ("attention",) else mixers,
        short_conv=dict(kernel=hf.get("conv_L_cache", 3), bias=bool(hf.get("conv_bias", False))))


def conv_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """HF's Lfm2ShortConv at `p` -> tfm GatedShortConv params."""
    D, m = cfg.d_model, cfg.short_conv
    b, c, h = np.split(w(f"{p}.in_proj.weight", (3 * D, D)), 3)
    biases = np.split(w(f"{p}.in_proj.bias", (3 * D,)), 3) if m.bias else (None,) * 3
    conv = {"kernel": w(f"{p}.conv.weight", (D, 1, m.kernel))[:, 0].T}  # [K, D]
    if m.bias:
        conv["bias"] = w(f"{p}.conv.bias", (D,))
    return {"b": dense(b, biases[0]), "c": dense(c, biases[1]), "h": dense(h, biases[2]), "conv": conv,
            "out": linear(w, f"{p}.out_proj", m.bias)}


def attention_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """HF's Lfm2Attention at `p` (q/k/v/out_proj, q_layernorm, k_layernorm) -> tfm Attention params."""
    qkvo = [linear_pair(w, f"{p}.{n}", False) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    out = attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    out["query_norm"], out["key_norm"] = norm(w, f"{p}.q_layernorm", "rmsnorm"), norm(w, f"{p}.k_layernorm", "rmsnorm")
    return out


def params(w: Weights, cfg: ModelConfig) -> dict:
    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        if cfg.layer_mixer(i) == "attention":
            out = {"attn_norm": norm(w, f"{p}.operator_norm", "rmsnorm"),
                   "self_attn": attention_params(w, f"{p}.self_attn", cfg)}
        else:
            out = {"mixer_norm": norm(w, f"{p}.operator_norm", "rmsnorm"), "mixer": conv_params(w, f"{p}.conv", cfg)}
        out["ffn_norm"] = norm(w, f"{p}.ffn_norm", "rmsnorm")
        out["ffn"] = {"wi_gate": linear(w, f"{p}.feed_forward.w1", False),
                      "wi_up": linear(w, f"{p}.feed_forward.w3", False),
                      "wo": linear(w, f"{p}.feed_forward.w2", False)}
        return out
    decoder = Stack(layer, cfg.num_layers, final_norm="model.embedding_norm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    names = {kind: name for name, kind in KINDS.items()}
    kinds = [cfg.layer_mixer(i) for i in range(cfg.num_layers)]
    if set(kinds) - set(names) or not cfg.qk_norm or cfg.ffn_pattern is not None or cfg.num_experts:
        raise ConversionError(f"mixer_pattern={cfg.mixer_pattern}: LFM2's layers are {sorted(names)}, each with "
                              f"query/key norms (qk_norm) and a dense SwiGLU feed-forward")
    return dict(
        model_type="lfm2", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.d_ff, block_auto_adjust_ff_dim=False, max_position_embeddings=cfg.max_len,
        norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id,
        layer_types=[names[k] for k in kinds], conv_L_cache=cfg.short_conv.kernel, conv_bias=cfg.short_conv.bias,
        **hf_rope(cfg))


INERT = ("full_attn_idxs",)  # HF derives layer_types from it; read where layer_types is absent
ARCHITECTURES = {"Lfm2ForCausalLM": Converter(DecoderLM, config, params, hf_config=hf_config, inert=INERT,
                                              export_rank=1)}
