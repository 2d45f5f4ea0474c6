"""BLOOM (BloomForCausalLM) -> tfm DecoderLM.

ALiBi instead of position embeddings (BLOOM's slopes, non-powers of two included, are tfm's
`alibi_slopes`), a LayerNorm on the word embeddings, pre-norm blocks with tanh-GELU, fused
query_key_value interleaved per head ([N, 3, H]), tied output.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import gpt_neox
from tfm.convert.common import Converter, HFConfig, Stack, Weights, model_params, norm
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    hf.expect("apply_residual_connection_post_layernorm", [False], False)
    # pretraining_tp / slow_but_exact only change how the dense layers are summed (tensor-parallel slices).
    D, N = hf.require("hidden_size"), hf.require("n_head")
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_layers=hf.require("n_layer"), d_ff=4 * D,
        max_len=hf.get("seq_length", 2048), norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        norm_position="pre", final_norm=True, embedding_norm=True, position="alibi", activation="gelu_tanh",
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), pad_id=hf.pad_id(vocab),
        dropout_rate=hf.get("hidden_dropout", 0.0), attention_dropout=hf.get("attention_dropout", 0.0))


def params(w: Weights, cfg: ModelConfig) -> dict:
    decoder = Stack(lambda i: gpt_neox.layer(w, f"transformer.h.{i}", cfg, "self_attention"), cfg.num_layers,
                    final_norm="transformer.ln_f")
    return model_params(w, cfg, embedding="transformer.word_embeddings.weight", stacks={"decoder": decoder},
                        input={"norm": norm(w, "transformer.word_embeddings_layernorm", cfg.norm)})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export); seq_length (not a BloomConfig field) keeps max_len."""
    return dict(model_type="bloom", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, n_head=cfg.num_heads,
                n_layer=cfg.num_layers, seq_length=cfg.max_len, layer_norm_epsilon=cfg.norm_eps,
                tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id, hidden_dropout=cfg.dropout_rate,
                attention_dropout=cfg.attention_dropout)


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("slow_but_exact",)
ARCHITECTURES = {"BloomForCausalLM": Converter(DecoderLM, config, params, hf_config=hf_config, inert=INERT)}
