"""SmolLM3 (SmolLM3ForCausalLM) -> tfm DecoderLM: the Llama mapping with NoPE layers, HF's per-layer
`no_rope_layers` (1 rotates, 0 does not; every no_rope_layer_interval-th layer by default) as tfm's repeating
position_pattern, and Qwen2-style layer_types."""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama, qwen2
from tfm.convert.common import Converter, HFConfig, period
from tfm.models import DecoderLM


def position_pattern(hf: HFConfig, flags) -> dict:
    """HF's per-layer rotate flags (1/True = RoPE) -> ModelConfig.position_pattern (None: every layer rotates)."""
    pattern = period("rope" if f else "none" for f in flags)
    return dict(position_pattern=None if pattern == ("rope",) else pattern)


def config(hf: HFConfig) -> ModelConfig:
    L, interval = hf.require("num_hidden_layers"), hf.get("no_rope_layer_interval", 4)
    flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(L)]
    return llama.config(hf, default_theta=2e6, **qwen2.attention_layers(hf), **position_pattern(hf, flags))


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    flags = [int(cfg.layer_rope(i) is not None) for i in range(cfg.num_layers)]
    return dict(llama.hf_config(cfg, model_type="smollm3"), no_rope_layers=flags, **qwen2.hf_attention_layers(cfg))


ARCHITECTURES = {"SmolLM3ForCausalLM": Converter(DecoderLM, config, llama.params, ignore=llama.IGNORE,
                                                    hf_config=hf_config)}
