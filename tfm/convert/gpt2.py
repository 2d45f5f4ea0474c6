"""GPT-2 (GPT2LMHeadModel) -> tfm DecoderLM.

Pre-norm, learned positions, tanh-GELU, tied output. GPT-2's `Conv1D` weights are [in, out]
(the transpose of nn.Linear) and `c_attn` packs q, k, v along the output axis.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert.common import (Converter, HFConfig, Stack, Weights, attention, conv1d, dense, hf_activation,
                                model_params, norm, split_qkv)
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    hf.expect("scale_attn_weights", [True], True)
    hf.expect("scale_attn_by_inverse_layer_idx", [False], False)
    hf.expect("add_cross_attention", [False], False)
    # reorder_and_upcast_attn only changes the precision of the logits, which tfm keeps in fp32.
    D = hf.require("n_embd")
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=hf.require("n_head"), num_layers=hf.require("n_layer"),
        d_ff=hf.get("n_inner") or 4 * D, max_len=hf.get("n_positions", 1024), norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_position="pre", final_norm=True, position="learned",
        activation=hf.activation("activation_function", "gelu_new"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), pad_id=hf.pad_id(vocab),
        dropout_rate=hf.get("resid_pdrop", 0.0), attention_dropout=hf.get("attn_pdrop", 0.0))


def layer(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """One block of Conv1D layers (GPT-2's, and GPT-1's under the same names)."""
    q, k, v = split_qkv(*conv1d(w, f"{p}.attn.c_attn"), cfg.num_heads, per_head=False)  # c_attn [3D, D], [3D]
    o = conv1d(w, f"{p}.attn.c_proj")
    dense = lambda name: {"kernel": w(f"{p}.mlp.{name}.weight"), "bias": w(f"{p}.mlp.{name}.bias")}
    return {"attn_norm": norm(w, f"{p}.ln_1", cfg.norm),
            "self_attn": attention(q, k, v, o, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            "ffn_norm": norm(w, f"{p}.ln_2", cfg.norm),
            "ffn": {"wi": dense("c_fc"), "wo": dense("c_proj")}}  # Conv1D is already [in, out]


def params(w: Weights, cfg: ModelConfig) -> dict:
    decoder = Stack(lambda i: layer(w, f"transformer.h.{i}", cfg), cfg.num_layers, final_norm="transformer.ln_f")
    position = w("transformer.wpe.weight", (cfg.max_len, cfg.d_model))
    return model_params(w, cfg, embedding="transformer.wte.weight", stacks={"decoder": decoder},
                        input={"position": {"embedding": position}})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    return dict(model_type="gpt2", vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_head=cfg.num_heads,
                n_layer=cfg.num_layers, n_inner=cfg.d_ff, n_positions=cfg.max_len, layer_norm_epsilon=cfg.norm_eps,
                activation_function=hf_activation(cfg.activation), tie_word_embeddings=cfg.tie_embeddings,
                pad_token_id=cfg.pad_id, resid_pdrop=cfg.dropout_rate, embd_pdrop=cfg.dropout_rate,
                attn_pdrop=cfg.attention_dropout)


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("embd_pdrop", "reorder_and_upcast_attn", "summary_first_dropout", "summary_proj_to_labels",
         "summary_type", "summary_use_proj")
ARCHITECTURES = {
    "GPT2LMHeadModel": Converter(DecoderLM, config, params, ignore=("*.attn.bias", "*.attn.masked_bias"),
                                 hf_config=hf_config, inert=INERT),
}
