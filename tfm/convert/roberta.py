"""RoBERTa (RobertaForMaskedLM) -> tfm EncoderModel.

BERT's blocks and embeddings with two differences: positions count non-pad tokens only and
start after the pad id (HF: cumsum of the non-pad mask + pad_token_id), and the MLM head is
`lm_head` (dense, layer_norm, decoder tied to the word embeddings, bias). No NSP head, no pooler.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import bert
from tfm.convert.common import Converter, HFConfig, Weights, linear, norm, stack_layers
from tfm.models import EncoderModel


def config(hf: HFConfig) -> ModelConfig:
    cfg = bert.config(hf, heads=("mlm",))
    return cfg.replace(position_offset=cfg.pad_id + 1, padding_positions=True)


def params(w: Weights, cfg: ModelConfig) -> dict:
    V, D = cfg.vocab_size, cfg.d_model
    embedding = w("roberta.embeddings.word_embeddings.weight", (V, D))
    bias = w("lm_head.bias", (V,))
    w.tied("lm_head.decoder.bias", bias, "the MLM decoder bias")
    out = {
        "embed": {"embedding": embedding},
        "input": {"position": {"embedding": w("roberta.embeddings.position_embeddings.weight", (cfg.max_len, D))},
                  "token_type": {"embedding": w("roberta.embeddings.token_type_embeddings.weight")},
                  "norm": norm(w, "roberta.embeddings.LayerNorm", cfg.norm)},
        "encoder": stack_layers([bert._layer(w, f"roberta.encoder.layer.{i}", cfg) for i in range(cfg.num_layers)],
                                cfg.scan_layers),
        "mlm_transform": linear(w, "lm_head.dense"),
        "mlm_norm": norm(w, "lm_head.layer_norm", cfg.norm),
        "mlm_output": {"bias": bias},
    }
    if cfg.tie_embeddings:
        w.tied("lm_head.decoder.weight", embedding, "tie_word_embeddings")
    else:
        out["mlm_output"]["lm_head"] = {"kernel": w("lm_head.decoder.weight", (V, D)).T}
    return out


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export): BERT's fields under model_type "roberta"."""
    return {**bert.hf_config(cfg), "model_type": "roberta"}


ARCHITECTURES = {
    "RobertaForMaskedLM": Converter(EncoderModel, config, params, ignore=("*position_ids", "*token_type_ids"),
                                    hf_config=hf_config),
}
