"""GPT-J (GPTJForCausalLM) -> tfm DecoderLM.

Parallel block with one shared LayerNorm (x + attn(ln x) + mlp(ln x)); rotary positions on the
first rotary_dim dims of each head in adjacent pairs (0, 1), (2, 3), ... (rope.interleaved);
q, k, v and output projections without bias; untied output layer with a bias.
"""
from __future__ import annotations

from tfm.config import ModelConfig, RopeConfig
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, attention, hf_activation,
                                linear, linear_pair, model_params, norm)
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    D, N = hf.require("n_embd"), hf.require("n_head")
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_layers=hf.require("n_layer"), d_ff=hf.get("n_inner") or 4 * D,
        max_len=hf.get("n_positions", 2048), norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        norm_position="pre", final_norm=True, position="rope",
        rope=RopeConfig(dim=hf.get("rotary_dim") or D // N, interleaved=True), parallel_block=True, parallel_norms=1,
        attention_bias=False,
        activation=hf.activation("activation_function", "gelu_new"),
        tie_embeddings=hf.expect("tie_word_embeddings", [False], False), output_bias=True,
        pad_id=hf.pad_id(vocab), dropout_rate=hf.get("resid_pdrop", 0.0), attention_dropout=hf.get("attn_pdrop", 0.0))


def _layer(w: Weights, p: str, cfg: ModelConfig) -> dict:
    qkvo = [linear_pair(w, f"{p}.attn.{n}", False) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    return {"attn_norm": norm(w, f"{p}.ln_1", cfg.norm),
            "self_attn": attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            "ffn": {"wi": linear(w, f"{p}.mlp.fc_in"), "wo": linear(w, f"{p}.mlp.fc_out")}}


def params(w: Weights, cfg: ModelConfig) -> dict:
    decoder = Stack(lambda i: _layer(w, f"transformer.h.{i}", cfg), cfg.num_layers, final_norm="transformer.ln_f")
    return model_params(w, cfg, embedding="transformer.wte.weight", stacks={"decoder": decoder},
                        output={"bias": w("lm_head.bias", (cfg.vocab_size,))})  # + the untied lm_head


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if cfg.position != "rope":
        raise ConversionError(f"position={cfg.position!r}: GPT-J has rotary positions")
    return dict(model_type="gptj", vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_head=cfg.num_heads,
                n_layer=cfg.num_layers, n_inner=cfg.d_ff, n_positions=cfg.max_len, rotary_dim=cfg.rope.dim,
                layer_norm_epsilon=cfg.norm_eps, activation_function=hf_activation(cfg.activation),
                tie_word_embeddings=False, pad_token_id=cfg.pad_id, resid_pdrop=cfg.dropout_rate,
                embd_pdrop=cfg.dropout_rate, attn_pdrop=cfg.attention_dropout)


IGNORE = ("*.attn.bias", "*.attn.masked_bias", "*embed_positions")
# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("embd_pdrop",)
ARCHITECTURES = {"GPTJForCausalLM": Converter(DecoderLM, config, params, ignore=IGNORE, hf_config=hf_config,
                                              inert=INERT)}
