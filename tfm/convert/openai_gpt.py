"""GPT-1 (OpenAIGPTDoubleHeadsModel, OpenAIGPTLMHeadModel) -> tfm DecoderLM.

Post-norm blocks (LayerNorm after each residual, none at the end), learned positions, tanh-GELU,
tied output; Conv1D weights are [in, out] and c_attn packs q, k, v along the output axis. The
double-heads model's multiple-choice head (summary_type "cls_index", a projection to num_labels)
is tfm's "classification" head: the final hidden state at cls_positions, dropout, a dense layer.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import gpt2
from tfm.convert.common import ConversionError, Converter, HFConfig, Stack, Weights, model_params
from tfm.models import DecoderLM


# GPT-1's activation names (its "gelu" is the tanh approximation) -> tfm's.
AFN = {"gelu": "gelu_tanh", "relu": "relu", "silu": "silu", "swish": "silu"}


def config(hf: HFConfig, heads=()) -> ModelConfig:
    D = hf.require("n_embd")
    vocab = hf.require("vocab_size")
    num_labels = 2
    if heads:
        hf.expect("summary_type", ["cls_index"], "cls_index")
        hf.expect("summary_use_proj", [True], True)
        hf.expect("summary_proj_to_labels", [True], True)
        hf.expect("summary_activation", [None], None)
        num_labels = hf.get("num_labels") or len(hf.get("id2label") or {}) or 2
    afn = hf.get("afn", "gelu")
    if afn not in AFN:
        raise hf.unsupported("afn", afn, f"tfm maps {sorted(AFN)}")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=hf.require("n_head"), num_layers=hf.require("n_layer"), d_ff=4 * D,
        max_len=hf.get("n_positions", 512), norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        norm_position="post", final_norm=False, position="learned",
        activation=AFN[afn],
        tie_embeddings=hf.expect("tie_word_embeddings", [True], True), pad_id=hf.pad_id(vocab), heads=tuple(heads),
        num_labels=num_labels,
        dropout_rate=hf.get("resid_pdrop", 0.0), attention_dropout=hf.get("attn_pdrop", 0.0))


def params(w: Weights, cfg: ModelConfig) -> dict:
    D = cfg.d_model
    # save_pretrained keeps the tied pair under the head's name, the Hub's files under the embedding's
    embedding = "transformer.tokens_embed.weight" if w.has("transformer.tokens_embed.weight") else "lm_head.weight"
    extra = {}
    if "classification" in cfg.heads:
        summary = w("multiple_choice_head.summary.weight", (cfg.num_labels, D))
        extra["classifier"] = {"dense": {"kernel": summary.T, "bias": w("multiple_choice_head.summary.bias")}}
    decoder = Stack(lambda i: gpt2.layer(w, f"transformer.h.{i}", cfg), cfg.num_layers)
    return model_params(w, cfg, embedding=embedding, stacks={"decoder": decoder},
                        head=None if embedding == "lm_head.weight" else "lm_head.weight",
                        input={"position": {"embedding": w("transformer.positions_embed.weight", (cfg.max_len, D))}},
                        **extra)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export); GPT-1 names tanh-GELU "gelu"."""
    afn = {tfm: name for name, tfm in reversed(list(AFN.items()))}.get(cfg.activation)
    if afn is None:
        raise ConversionError(f"activation={cfg.activation!r} has no GPT-1 name; it writes {sorted(set(AFN.values()))}")
    return dict(model_type="openai-gpt", vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_head=cfg.num_heads,
                n_layer=cfg.num_layers, n_positions=cfg.max_len, layer_norm_epsilon=cfg.norm_eps, afn=afn,
                pad_token_id=cfg.pad_id, num_labels=cfg.num_labels, resid_pdrop=cfg.dropout_rate,
                embd_pdrop=cfg.dropout_rate, attn_pdrop=cfg.attention_dropout)


IGNORE = ("*.attn.bias", "transformer.position_ids")
# HF config fields that change nothing tfm computes: dropout, and the double-heads model's summary head settings
# (the LM head model has none)
INERT = ("embd_pdrop", "summary_first_dropout", "summary_proj_to_labels", "summary_type", "summary_use_proj")
ARCHITECTURES = {
    "OpenAIGPTLMHeadModel": Converter(DecoderLM, config, params, ignore=IGNORE, hf_config=hf_config, inert=INERT),
    "OpenAIGPTDoubleHeadsModel": Converter(DecoderLM, lambda hf: config(hf, heads=("classification",)), params,
                                           ignore=IGNORE, hf_config=hf_config, inert=INERT[:2]),
}
