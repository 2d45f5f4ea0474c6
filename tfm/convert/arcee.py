"""Arcee (AFM: ArceeForCausalLM) -> tfm DecoderLM: the Llama mapping with a feed-forward that is not gated,
down_proj(act(up_proj x)), under ReLU² (hidden_act "relu2")."""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama
from tfm.convert.common import Converter, HFConfig, Weights, linear
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    return llama.config(hf, activation=hf.activation("hidden_act", "relu2"))


def ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    return {"wi": linear(w, f"{p}.mlp.up_proj", cfg.ffn_bias), "wo": linear(w, f"{p}.mlp.down_proj", cfg.ffn_bias)}


def params(w: Weights, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, ffn=ffn)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    return llama.hf_config(cfg, model_type="arcee")


ARCHITECTURES = {"ArceeForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config)}
