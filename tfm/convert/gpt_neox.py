"""GPT-NeoX / Pythia (GPTNeoXForCausalLM) -> tfm DecoderLM.

Parallel residual with two LayerNorms, x + attn(ln1 x) + mlp(ln2 x) (use_parallel_residual;
False gives the sequential pre-norm block); rotary positions in the rotate-halves layout on the
first rotary_pct of each head; fused query_key_value interleaved per head ([N, 3, H]); untied
output layer `embed_out` without bias.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, attention, hf_activation,
                                hf_rope, linear, linear_pair, model_params, norm, rope, split_qkv)
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    D, N = hf.require("hidden_size"), hf.require("num_attention_heads")
    vocab = hf.require("vocab_size")
    parallel = bool(hf.get("use_parallel_residual", True))
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"), max_len=hf.get("max_position_embeddings", 2048), norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-5), norm_position="pre", final_norm=True, position="rope",
        parallel_block=parallel, parallel_norms=2 if parallel else 1, attention_bias=bool(hf.get("attention_bias", True)),
        activation=hf.activation("hidden_act", "gelu"), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        pad_id=hf.pad_id(vocab), dropout_rate=hf.get("hidden_dropout", 0.0),
        attention_dropout=hf.get("attention_dropout", 0.0), rope=rope(hf, 10_000.0, partial=True))


def layer(w: Weights, p: str, cfg: ModelConfig, attn: str = "attention") -> dict:
    """One block with the fused per-head query_key_value under `attn` (BLOOM's too: "self_attention")."""
    b = cfg.attention_bias
    q, k, v = split_qkv(*linear_pair(w, f"{p}.{attn}.query_key_value", b), cfg.num_heads, per_head=True)
    o = linear_pair(w, f"{p}.{attn}.dense", b)
    return {"attn_norm": norm(w, f"{p}.input_layernorm", cfg.norm),
            "ffn_norm": norm(w, f"{p}.post_attention_layernorm", cfg.norm),
            "self_attn": attention(q, k, v, o, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            "ffn": {"wi": linear(w, f"{p}.mlp.dense_h_to_4h"), "wo": linear(w, f"{p}.mlp.dense_4h_to_h")}}


def params(w: Weights, cfg: ModelConfig) -> dict:
    decoder = Stack(lambda i: layer(w, f"gpt_neox.layers.{i}", cfg), cfg.num_layers,
                    final_norm="gpt_neox.final_layer_norm")
    head = "embed_out.weight" if w.has("embed_out.weight") else "lm_head.weight"  # older / newer name
    return model_params(w, cfg, embedding="gpt_neox.embed_in.weight", stacks={"decoder": decoder}, head=head)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export); the rotated fraction goes in rope_parameters."""
    if cfg.position != "rope":
        raise ConversionError(f"position={cfg.position!r}: GPT-NeoX has rotary positions")
    rope = hf_rope(cfg)
    rope["rope_parameters"]["partial_rotary_factor"] = cfg.rope.dim / cfg.head_dim
    return dict(model_type="gpt_neox", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_attention_heads=cfg.num_heads, num_hidden_layers=cfg.num_layers, intermediate_size=cfg.d_ff,
                max_position_embeddings=cfg.max_len, layer_norm_eps=cfg.norm_eps,
                hidden_act=hf_activation(cfg.activation), use_parallel_residual=cfg.parallel_block,
                attention_bias=cfg.attention_bias, tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id,
                hidden_dropout=cfg.dropout_rate, attention_dropout=cfg.attention_dropout, **rope)


IGNORE = ("*.attention.bias", "*.attention.masked_bias", "*rotary_emb.inv_freq")
# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("classifier_dropout", "is_decoder")
ARCHITECTURES = {"GPTNeoXForCausalLM": Converter(DecoderLM, config, params, ignore=IGNORE, hf_config=hf_config,
                                                 inert=INERT)}
