"""Granite (GraniteForCausalLM) -> tfm DecoderLM: the Llama mapping with µP's four multipliers: embeddings times
embedding_multiplier, each sublayer's output times residual_multiplier, attention logits times attention_multiplier
(instead of head_dim**-0.5), logits divided by logits_scaling."""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama
from tfm.convert.common import Converter, HFConfig
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    """Every multiplier is required: a config without them is not a Granite's (its defaults are 1)."""
    return llama.config(hf, embedding_multiplier=float(hf.require("embedding_multiplier")),
                        residual_multiplier=float(hf.require("residual_multiplier")),
                        attention_scale=float(hf.require("attention_multiplier")),
                        logits_multiplier=1.0 / float(hf.require("logits_scaling")))


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    return dict(llama.hf_config(cfg, model_type="granite"), embedding_multiplier=cfg.embedding_multiplier,
                residual_multiplier=cfg.residual_multiplier, logits_scaling=1.0 / cfg.logits_multiplier,
                attention_multiplier=cfg.head_dim ** -0.5 if cfg.attention_scale is None else cfg.attention_scale)


# export_rank 1: a Llama is a Granite with unit multipliers, and exports as the Llama it is.
ARCHITECTURES = {"GraniteForCausalLM": Converter(DecoderLM, config, llama.params, ignore=llama.IGNORE,
                                                    hf_config=hf_config, export_rank=1)}
