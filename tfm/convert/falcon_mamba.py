"""FalconMamba (FalconMambaForCausalLM) -> tfm DecoderLM: Mamba (tfm.convert.mamba: the same tensors and fields)
whose dt, B and C pass RMSNorms without weights (epsilon mixer_rms_eps) before the scan:
mamba.inner_norms with inner_norm_weights=False. HF's norms hold all-ones buffers it does not save.
"""
from __future__ import annotations

import dataclasses

from tfm.config import ModelConfig
from tfm.convert import mamba
from tfm.convert.common import ConversionError, Converter, HFConfig
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    cfg = mamba.config(hf)
    return cfg.replace(mamba=dataclasses.replace(cfg.mamba, inner_norms=True, inner_norm_weights=False,
                                                 inner_norm_eps=hf.get("mixer_rms_eps", 1e-6)))


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    m = cfg.mamba
    if not m.inner_norms or m.inner_norm_weights:
        raise ConversionError("FalconMambaForCausalLM normalises dt, B and C without weights (mamba.inner_norms=True, "
                              "inner_norm_weights=False)")
    out = mamba.hf_config(cfg.replace(mamba=dataclasses.replace(m, inner_norms=False)))
    return {**out, "model_type": "falcon_mamba", "mixer_rms_eps": m.inner_norm_eps or cfg.norm_eps}


ARCHITECTURES = {"FalconMambaForCausalLM": Converter(DecoderLM, config, mamba.params, hf_config=hf_config,
                                                     inert=mamba.INERT, export_rank=1)}
