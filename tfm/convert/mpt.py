"""MPT (MptForCausalLM) -> tfm DecoderLM.

ALiBi (slopes from alibi_bias_max), LayerNorms without bias and linear layers without bias
(HF's MPT has none, whatever no_bias says), exact GELU feed-forward of width 4 D, fused Wqkv
with q, k, v one after another, tied output.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert.common import (Converter, HFConfig, Stack, Weights, attention, linear, linear_pair, model_params,
                                norm, split_qkv)
from tfm.models import DecoderLM

# attn_config fields whose non-default values change the math tfm reproduces.
_ATTN_DEFAULTS = {"clip_qkv": None, "softmax_scale": None, "prefix_lm": False, "qk_ln": False,
                  "attn_uses_sequence_id": False, "alibi": True, "alibi_bias_max": 8}


def config(hf: HFConfig) -> ModelConfig:
    attn = hf.get("attn_config") or {}
    if not isinstance(attn, dict):
        attn = attn.to_dict()
    for name, default in _ATTN_DEFAULTS.items():
        value = attn.get(name, default)
        if value != default:
            detail = ("HF's MptModel builds its ALiBi with the default 8 whatever this says"
                      if name == "alibi_bias_max" else f"tfm supports {default!r}")
            raise hf.unsupported(f"attn_config.{name}", value, detail)
    hf.expect("expansion_ratio", [4], 4)  # HF's MptMLP is 4 * d_model wide whatever this says
    hf.expect("logit_scale", [None], None)
    hf.expect("embedding_fraction", [1.0, 1], 1.0)
    D = hf.require("d_model")
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=hf.require("n_heads"), num_layers=hf.require("n_layers"), d_ff=4 * D,
        max_len=hf.get("max_seq_len", 2048), norm="layernorm", norm_bias=False,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_position="pre", final_norm=True, position="alibi",
        alibi_bias_max=8.0, attention_bias=False, ffn_bias=False, activation="gelu",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), pad_id=hf.pad_id(vocab),
        dropout_rate=hf.get("resid_pdrop", 0.0), attention_dropout=float(attn.get("attn_pdrop", 0.0)))


def _layer(w: Weights, p: str, cfg: ModelConfig) -> dict:
    q, k, v = split_qkv(*linear_pair(w, f"{p}.attn.Wqkv", False), cfg.num_heads, per_head=False)
    o = linear_pair(w, f"{p}.attn.out_proj", False)
    return {"attn_norm": norm(w, f"{p}.norm_1", "rmsnorm"),  # scale only
            "self_attn": attention(q, k, v, o, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            "ffn_norm": norm(w, f"{p}.norm_2", "rmsnorm"),
            "ffn": {"wi": linear(w, f"{p}.ffn.up_proj", False), "wo": linear(w, f"{p}.ffn.down_proj", False)}}


def params(w: Weights, cfg: ModelConfig) -> dict:
    decoder = Stack(lambda i: _layer(w, f"transformer.blocks.{i}", cfg), cfg.num_layers,
                    final_norm="transformer.norm_f", norm_kind="rmsnorm")  # scale only
    return model_params(w, cfg, embedding="transformer.wte.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    return dict(model_type="mpt", vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_heads=cfg.num_heads,
                n_layers=cfg.num_layers, max_seq_len=cfg.max_len, layer_norm_epsilon=cfg.norm_eps,
                tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id, resid_pdrop=cfg.dropout_rate,
                attn_config={"attn_pdrop": cfg.attention_dropout or 0})  # HF types it int; 0.0 fails


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("emb_pdrop", "init_device", "learned_pos_emb", "no_bias", "norm_type")
ARCHITECTURES = {"MptForCausalLM": Converter(DecoderLM, config, params, hf_config=hf_config, inert=INERT)}
