"""Bamba (BambaForCausalLM) -> tfm DecoderLM: Mamba-2 mixers with Llama attention at attn_layer_indices.

Every layer is pre-norm RMSNorm: its token mixer (a "mamba2" mixer, or GQA attention with RoPE over
the first partial_rotary_factor of each head, rotate-halves layout; BambaConfig fixes that factor at 0.5
unless rope_parameters names one) after `input_layernorm`, then a SwiGLU feed-forward after
`pre_ff_layernorm`. The mixer is Mamba2ForCausalLM's (`mamba2.mixer_params`) with its fields prefixed
mamba_; its gated RMSNorm normalises mamba_n_groups groups, tfm's mamba2.norm_groups default.
`mixer_pattern` is the shortest period of the layer kinds that divides num_hidden_layers.
"""
from __future__ import annotations

from typing import Mapping, Optional

from tfm.config import ModelConfig
from tfm.convert import llama, mamba2
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, hybrid_mixer, model_params,
                                norm, period, rope)
from tfm.models import DecoderLM

MIXER_FIELDS = dict(state_size="mamba_d_state", conv_kernel="mamba_d_conv", expand="mamba_expand",
                    head_dim="mamba_d_head", num_heads="mamba_n_heads", groups="mamba_n_groups",
                    conv_bias="mamba_conv_bias", proj_bias="mamba_proj_bias", dt_limit="time_step_limit",
                    activation="hidden_act")
# BambaConfig's defaults for the fields a checkpoint's config.json may leave out.
DEFAULTS = dict(num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=262144,
                mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4,
                mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False)
PARTIAL_ROTARY_FACTOR = 0.5  # BambaConfig's, unless rope_parameters gives partial_rotary_factor


def with_defaults(hf: HFConfig, defaults: Mapping, renamed: Optional[Mapping[str, str]] = None) -> HFConfig:
    """`hf` with the HF config class's `defaults` where a field is absent (None stays None: it may mean
    something) and the legacy names in `renamed` (old -> new) moved to their new names, as HF's class does."""
    fields = {**defaults, **hf.fields}
    for old, new in (renamed or {}).items():
        hf.read.add(old)
        if fields.get(old) is not None:
            fields[new] = fields.pop(old)
    return HFConfig(fields, hf.architecture, hf.read)


def layer_kinds(hf: HFConfig) -> list:
    layers = hf.require("num_hidden_layers")
    indices = list(hf.get("attn_layer_indices") or [])
    if any(not 0 <= i < layers for i in indices):
        raise hf.unsupported("attn_layer_indices", indices, f"each must be in [0, num_hidden_layers={layers})")
    return ["attention" if i in indices else "mamba2" for i in range(layers)]


def config(hf: HFConfig) -> ModelConfig:
    hf = with_defaults(hf, DEFAULTS)
    D, N = hf.require("hidden_size"), hf.require("num_attention_heads")
    if hf.get("mamba_d_head") == "auto":
        hf.fields["mamba_d_head"] = hf.get("mamba_expand") * D // hf.require("mamba_n_heads")
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads", N),
        head_dim=hf.get("head_dim", D // N), num_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"), max_len=hf.get("max_position_embeddings"), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps"), norm_position="pre", final_norm=True, position="rope",
        rope=_rope(hf), activation=hf.activation("hidden_act", "silu", gated=True),
        attention_bias=bool(hf.get("attention_bias", False)), ffn_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_id=hf.pad_id(vocab),
        attention_dropout=hf.get("attention_dropout", 0.0), mixer_pattern=period(layer_kinds(hf)),
        ffn_pattern=("dense",), mamba2=mamba2.mixer_config(hf, MIXER_FIELDS))


def _rope(hf: HFConfig):
    """RoPE with Bamba's partial_rotary_factor (only rope_parameters may change it from 0.5)."""
    params = dict(hf.get("rope_parameters") or {})
    params.setdefault("partial_rotary_factor", PARTIAL_ROTARY_FACTOR)
    params.setdefault("rope_theta", hf.get("rope_theta", 10_000.0))
    return rope(hf.with_fields(rope_parameters=params, partial_rotary_factor=None),
                10_000.0, partial=True)


def layer(w: Weights, p: str, cfg: ModelConfig, i: int) -> dict:
    return {**hybrid_mixer(w, p, cfg, i, mamba2.mixer_params), "ffn_norm": norm(w, f"{p}.pre_ff_layernorm", "rmsnorm"),
            "ffn": llama.swiglu(w, f"{p}.feed_forward", cfg.ffn_bias)}


def params(w: Weights, cfg: ModelConfig) -> dict:
    decoder = Stack(lambda i: layer(w, f"model.layers.{i}", cfg, i), cfg.num_layers, final_norm="model.final_layernorm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    kinds = [cfg.layer_mixer(i) for i in range(cfg.num_layers)]
    if cfg.position != "rope":
        raise ConversionError(f"BambaForCausalLM rotates its attention layers' queries and keys; position={cfg.position!r}")
    if set(kinds) - {"attention", "mamba2"} or any(cfg.layer_ffn(i) != "dense" for i in range(cfg.num_layers)):
        raise ConversionError("BambaForCausalLM has an attention or mamba2 mixer and a dense feed-forward in "
                              f"every layer; mixer_pattern={cfg.mixer_pattern}, ffn_pattern={cfg.ffn_pattern}")
    out = llama.hf_config(cfg, model_type="bamba")
    del out["head_dim"]  # BambaConfig has none: its attention heads are hidden_size / num_attention_heads wide
    out["rope_parameters"]["partial_rotary_factor"] = cfg.rope.dim / cfg.head_dim
    return dict(out, attn_layer_indices=[i for i, k in enumerate(kinds) if k == "attention"],
                **mamba2.mixer_hf_config(cfg, MIXER_FIELDS))


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("mamba_chunk_size", "num_logits_to_keep", "z_loss_coefficient")
ARCHITECTURES = {"BambaForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config,
                                               inert=INERT, export_rank=1)}
