"""T5 v1.0 and v1.1 (T5ForConditionalGeneration) -> tfm EncoderDecoder.

Pre-norm RMS LayerNorm (no mean subtraction, no bias), no biases anywhere, unscaled attention
logits, relative position bias (one table per stack, in block 0: bidirectional buckets in the
encoder, causal in the decoder; none in cross-attention), one shared embedding.
v1.0: ReLU, output tied to the embedding with the decoder output scaled by d_model**-0.5.
v1.1: gated-GELU (wi_0 gate, wi_1 up), no rescale; an untied `lm_head` where the config says
so (legacy `tie_word_embeddings: false` configs; transformers 5 always ties).
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, attention, linear, model_params,
                                norm)
from tfm.models import EncoderDecoder

_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh"}  # plain feed-forward
_GATED = {"gelu": "geglu", "gelu_new": "geglu", "silu": "swiglu"}  # gated-<act> (wi_0 gate, wi_1 up)


def _activation(hf: HFConfig) -> str:
    proj = hf.get("feed_forward_proj", "relu")
    gated, _, act = proj.rpartition("-")
    table = _GATED if gated == "gated" else _ACTIVATIONS if not gated else {}
    if act not in table:
        raise hf.unsupported("feed_forward_proj", proj, f"tfm maps {list(_ACTIVATIONS)} and "
                             f"{['gated-' + a for a in _GATED]}")
    return table[act]


def config(hf: HFConfig) -> ModelConfig:
    hf.expect("is_encoder_decoder", [True], True)
    vocab = hf.require("vocab_size")
    # transformers 5 keeps v1.0's output rescale as scale_decoder_outputs and always ties the
    # output; older configs said both with tie_word_embeddings.
    if hf.has("scale_decoder_outputs"):
        tied, rescale = True, bool(hf.fields["scale_decoder_outputs"])
    else:
        tied = bool(hf.get("tie_word_embeddings", True))
        rescale = tied
    return ModelConfig(
        vocab_size=vocab, d_model=hf.require("d_model"), num_heads=hf.require("num_heads"),
        head_dim=hf.require("d_kv"), num_layers=hf.require("num_layers"),
        num_decoder_layers=hf.get("num_decoder_layers", hf.require("num_layers")), d_ff=hf.require("d_ff"),
        max_len=hf.get("n_positions", 512), norm="rmsnorm", norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        norm_position="pre", final_norm=True, position="relative",
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128), scale_attention=False,
        attention_bias=False, ffn_bias=False, activation=_activation(hf), tie_embeddings=tied,
        rescale_tied_output=rescale, share_source_target_embeddings=True, pad_id=hf.pad_id(vocab),
        dropout_rate=hf.get("dropout_rate", 0.0))


def _attention(w: Weights, p: str, cfg: ModelConfig) -> dict:
    qkvo = [(w(f"{p}.{n}.weight"), None) for n in ("q", "k", "v", "o")]
    return attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


def _ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    if cfg.activation in ("geglu", "swiglu"):
        return {"wi_gate": linear(w, f"{p}.wi_0", False), "wi_up": linear(w, f"{p}.wi_1", False),
                "wo": linear(w, f"{p}.wo", False)}
    return {"wi": linear(w, f"{p}.wi", False), "wo": linear(w, f"{p}.wo", False)}


def _layer(w: Weights, p: str, cfg: ModelConfig, cross: bool) -> dict:
    ff = f"{p}.layer.{2 if cross else 1}"
    out = {"self_attn": _attention(w, f"{p}.layer.0.SelfAttention", cfg),
           "attn_norm": norm(w, f"{p}.layer.0.layer_norm", cfg.norm),
           "ffn": _ffn(w, f"{ff}.DenseReluDense", cfg), "ffn_norm": norm(w, f"{ff}.layer_norm", cfg.norm)}
    if cross:
        out["cross_attn"] = _attention(w, f"{p}.layer.1.EncDecAttention", cfg)
        out["cross_norm"] = norm(w, f"{p}.layer.1.layer_norm", cfg.norm)
    return out


def _stack(w: Weights, side: str, cfg: ModelConfig, num_layers: int) -> Stack:
    bias = w(f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
             (cfg.relative_buckets, cfg.num_heads))
    return Stack(lambda i: _layer(w, f"{side}.block.{i}", cfg, side == "decoder"), num_layers,
                 final_norm=f"{side}.final_layer_norm", extra={"relative_bias": {"embedding": bias}})


def params(w: Weights, cfg: ModelConfig) -> dict:
    stacks = {"encoder": _stack(w, "encoder", cfg, cfg.num_layers),
              "decoder": _stack(w, "decoder", cfg, cfg.num_decoder_layers)}
    return model_params(w, cfg, embedding="shared.weight", stacks=stacks,
                        tied=[f"{side}.embed_tokens.weight" for side in ("encoder", "decoder")])


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export). transformers 5 derives scale_decoder_outputs from the
    tie_word_embeddings it is given, then ties the output regardless."""
    proj = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "geglu": "gated-gelu",
            "swiglu": "gated-silu"}.get(cfg.activation)
    if proj is None:
        raise ConversionError(f"activation={cfg.activation!r} has no T5 feed_forward_proj")
    return dict(model_type="t5", vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.head_dim, d_ff=cfg.d_ff,
                num_layers=cfg.num_layers, num_decoder_layers=cfg.num_decoder_layers, num_heads=cfg.num_heads,
                relative_attention_num_buckets=cfg.relative_buckets,
                relative_attention_max_distance=cfg.relative_max_distance, layer_norm_epsilon=cfg.norm_eps,
                feed_forward_proj=proj, tie_word_embeddings=cfg.rescale_tied_output,
                scale_decoder_outputs=cfg.rescale_tied_output, pad_token_id=cfg.pad_id, dropout_rate=cfg.dropout_rate)


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("classifier_dropout", "dense_act_fn", "is_decoder", "is_gated_act", "tie_word_embeddings")
ARCHITECTURES = {"T5ForConditionalGeneration": Converter(EncoderDecoder, config, params, hf_config=hf_config,
                                                         inert=INERT)}
