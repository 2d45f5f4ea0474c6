"""Mistral (MistralForCausalLM) -> tfm DecoderLM: the Llama mapping with a sliding attention
window on every layer (a query sees itself and the sliding_window - 1 keys before it)."""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama
from tfm.convert.common import Converter, HFConfig
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    return llama.config(hf, sliding_window=hf.get("sliding_window"))


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export): Llama's fields less the biases Mistral has no field for."""
    out = llama.hf_config(cfg, model_type="mistral", bias_fields=False)
    return dict(out, sliding_window=cfg.sliding_window)


ARCHITECTURES = {"MistralForCausalLM": Converter(DecoderLM, config, llama.params, ignore=llama.IGNORE,
                                                    hf_config=hf_config)}
