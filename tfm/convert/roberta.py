"""RoBERTa (RobertaForMaskedLM) -> tfm EncoderModel.

BERT's blocks and embeddings with two differences: positions count non-pad tokens only and
start after the pad id (HF: cumsum of the non-pad mask + pad_token_id), and the MLM head is
`lm_head` (dense, layer_norm, decoder tied to the word embeddings, bias). No NSP head, no pooler.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import bert
from tfm.convert.common import Converter, HFConfig, Weights
from tfm.models import EncoderModel


def config(hf: HFConfig) -> ModelConfig:
    cfg = bert.config(hf, heads=("mlm",))
    return cfg.replace(position_offset=cfg.pad_id + 1, padding_positions=True)


def params(w: Weights, cfg: ModelConfig) -> dict:
    return bert.mlm_head(bert.encoder_params(w, cfg, "roberta."), w, cfg, "lm_head.dense", "lm_head.layer_norm",
                         "lm_head.bias", "lm_head.decoder.weight", tied_bias="lm_head.decoder.bias")


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export): BERT's fields under model_type "roberta"."""
    return {**bert.hf_config(cfg), "model_type": "roberta"}


ARCHITECTURES = {
    "RobertaForMaskedLM": Converter(EncoderModel, config, params, ignore=("*position_ids", "*token_type_ids"),
                                    hf_config=hf_config),
}
