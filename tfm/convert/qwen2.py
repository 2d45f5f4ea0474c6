"""Qwen2 (Qwen2ForCausalLM) -> tfm DecoderLM: the Llama mapping with biases on the q, k, v
projections (none on the output one), and HF's per-layer `layer_types` (full or sliding
attention) as tfm's repeating attention_pattern."""
from __future__ import annotations

from typing import Mapping, Sequence, Tuple

from tfm.config import ModelConfig
from tfm.convert import llama
from tfm.convert.common import ConversionError, Converter, HFConfig
from tfm.models import DecoderLM

KINDS = {"full_attention": "global", "sliding_attention": "local"}


def config(hf: HFConfig, **extra) -> ModelConfig:
    """`extra` adds a variant's own fields (Qwen2-MoE's experts)."""
    hf.expect("attention_bias", [True], True)
    return llama.config(hf, default_theta=1e6, attention_bias=True, attention_out_bias=False,
                        **attention_layers(hf), **extra)


def attention_layers(hf: HFConfig, kinds: Mapping[str, str] = KINDS) -> dict:
    """ModelConfig's sliding_window and attention_pattern from HF's per-layer `layer_types`, or, in a config
    saved without them, from use_sliding_window / max_window_layers as HF derives them (layers from
    max_window_layers on slide)."""
    layer_types = hf.get("layer_types")
    use, first = hf.get("use_sliding_window", False), hf.get("max_window_layers", 0)
    window = hf.get("sliding_window")
    if layer_types is None:
        if window and not hf.has("use_sliding_window"):
            raise ConversionError(f"{hf.architecture}: sliding_window={window} without layer_types or "
                                  f"use_sliding_window does not say which layers slide; give layer_types")
        L = hf.require("num_hidden_layers")
        layer_types = ["sliding_attention" if use and window and i >= first else "full_attention" for i in range(L)]
    pattern = attention_pattern(hf, layer_types, kinds)
    if "local" not in pattern:
        window = None
    if len(set(pattern)) == 1 and pattern[0] != "span":
        pattern = None  # one kind on every layer: sliding_window alone says which
    return dict(sliding_window=window, attention_pattern=pattern)


def attention_pattern(hf: HFConfig, layer_types: Sequence[str], names: Mapping[str, str] = KINDS) -> Tuple[str, ...]:
    """HF layer_types -> the shortest repeating tuple of tfm's attention kinds (`names` maps them) that gives them."""
    unknown = sorted(set(layer_types) - set(names))
    if unknown:
        raise hf.unsupported("layer_types", unknown, f"tfm maps {sorted(names)}")
    kinds = tuple(names[t] for t in layer_types)
    if "local" in kinds and not hf.get("sliding_window"):
        raise ConversionError(f"{hf.architecture}: layer_types has sliding layers but sliding_window is unset")
    for period in range(1, len(kinds) + 1):
        if len(kinds) % period == 0 and kinds == kinds[:period] * (len(kinds) // period):
            return kinds[:period]
    return kinds


def hf_config(cfg: ModelConfig, model_type: str = "qwen2") -> dict:
    """The inverse of `config` (export): the attention pattern as HF's per-layer layer_types."""
    return dict(llama.hf_config(cfg, model_type=model_type, bias_fields=False), **hf_attention_layers(cfg))


def hf_attention_layers(cfg: ModelConfig) -> dict:
    """The inverse of `attention_layers`: HF's layer_types, sliding_window and use_sliding_window."""
    names = {kind: name for name, kind in KINDS.items()}
    layer_types = [names["global" if cfg.layer_window(i) is None else "local"] for i in range(cfg.num_layers)]
    return dict(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                layer_types=layer_types)


ARCHITECTURES = {"Qwen2ForCausalLM": Converter(DecoderLM, config, llama.params, ignore=llama.IGNORE,
                                                  hf_config=hf_config)}
