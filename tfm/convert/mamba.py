"""Mamba (MambaForCausalLM) -> tfm DecoderLM with every layer a "mamba" mixer and no feed-forward.

Pre-norm RMSNorm blocks, no positions, the final `norm_f`, the output tied by default. HF fuses the
mixer's input projection (`in_proj` rows: x, then the gate z) and its selective projection (`x_proj`
rows: dt, B, C); tfm keeps each part a projection of its own, so tensor parallelism can split the E
channels. HF's other fields (time_step_scale, time_step_min/max/floor, time_step_init_scheme,
rescale_prenorm_residual, initializer_range) only initialise; use_mambapy and use_associative_scan
pick an implementation; residual_in_fp32 keeps the residual in float32, which tfm's float32 import
does anyway. `mixer_params` also serves Jamba, whose mixer adds RMSNorms on dt, B and C.
"""
from __future__ import annotations

import math

from tfm.config import ModelConfig
from tfm.convert import mamba2
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights, norm
from tfm.models import DecoderLM


def mixer_config(hf: HFConfig, D: int, names: dict, inner_norms: bool = False) -> dict:
    """ModelConfig.mamba from HF fields; `names` maps state_size, conv_kernel, expand, dt_rank, conv_bias and
    proj_bias to the family's field names (MambaConfig's: state_size, ..., time_step_rank, use_conv_bias, use_bias)."""
    expand = hf.get(names["expand"], 2)
    if int(expand) != expand:
        raise hf.unsupported(names["expand"], expand, "tfm needs a whole expand (E = expand * hidden_size)")
    rank = hf.get(names["dt_rank"], "auto")
    rank = None if rank in ("auto", math.ceil(D / 16)) else int(rank)  # None: tfm's default, ceil(D / 16)
    return dict(state_size=hf.get(names["state_size"], 16), conv_kernel=hf.get(names["conv_kernel"], 4),
                expand=int(expand), dt_rank=rank, conv_bias=bool(hf.get(names["conv_bias"], True)),
                proj_bias=bool(hf.get(names["proj_bias"], False)), inner_norms=inner_norms)


def mixer_hf_config(cfg: ModelConfig, names: dict) -> dict:
    """The inverse of `mixer_config` under the same `names`."""
    m = cfg.mamba
    values = dict(state_size=m.state_size, conv_kernel=m.conv_kernel, expand=m.expand,
                  dt_rank=m.dt_rank or math.ceil(cfg.d_model / 16), conv_bias=m.conv_bias, proj_bias=m.proj_bias)
    return {names[k]: v for k, v in values.items()}


MAMBA_NAMES = dict(state_size="state_size", conv_kernel="conv_kernel", expand="expand", dt_rank="time_step_rank",
                   conv_bias="use_conv_bias", proj_bias="use_bias")


def config(hf: HFConfig) -> ModelConfig:
    vocab, D = hf.require("vocab_size"), hf.require("hidden_size")
    hf.expect("hidden_act", ["silu"], "silu")
    hf.expect("intermediate_size", [hf.get("expand", 2) * D], hf.get("expand", 2) * D)  # HF's mixer reads it
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=1, num_layers=hf.require("num_hidden_layers"), d_ff=1,
        norm="rmsnorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_position="pre", position="none",
        mixer_pattern=("mamba",), ffn_pattern=("none",), mamba=mixer_config(hf, D, MAMBA_NAMES),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), pad_id=hf.pad_id(vocab), attention_bias=False)


def mixer_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """HF's MambaMixer (or JambaMambaMixer, with cfg.mamba.inner_norms) at prefix `p` -> tfm's Mamba params."""
    m, D = cfg.mamba, cfg.d_model
    E, S, R, K = m.expand * D, m.state_size, m.dt_rank or math.ceil(D / 16), m.conv_kernel

    def part(weight, lo, hi, bias=None):
        out = {"kernel": weight[lo:hi].T}
        if bias is not None:
            out["bias"] = bias[lo:hi]
        return out

    in_proj = w(f"{p}.in_proj.weight", (2 * E, D))
    in_bias = w(f"{p}.in_proj.bias", (2 * E,)) if m.proj_bias else None
    x_proj = w(f"{p}.x_proj.weight", (R + 2 * S, E))
    out = {"x": part(in_proj, 0, E, in_bias), "gate": part(in_proj, E, 2 * E, in_bias),
           "conv": {"kernel": w(f"{p}.conv1d.weight", (E, 1, K))[:, 0].T},  # [K, E]: tap K-1 reads the current input
           "dt_in": part(x_proj, 0, R), "B": part(x_proj, R, R + S), "C": part(x_proj, R + S, R + 2 * S),
           "dt": {"kernel": w(f"{p}.dt_proj.weight", (E, R)).T}, "dt_bias": w(f"{p}.dt_proj.bias", (E,)),
           "A_log": w(f"{p}.A_log", (E, S)), "D": w(f"{p}.D", (E,)),
           "out": part(w(f"{p}.out_proj.weight", (D, E)), 0, D, w(f"{p}.out_proj.bias", (D,)) if m.proj_bias else None)}
    if m.conv_bias:
        out["conv"]["bias"] = w(f"{p}.conv1d.bias", (E,))
    if m.inner_norms and m.inner_norm_weights:
        out.update(dt_norm=norm(w, f"{p}.dt_layernorm", "rmsnorm"), B_norm=norm(w, f"{p}.b_layernorm", "rmsnorm"),
                   C_norm=norm(w, f"{p}.c_layernorm", "rmsnorm"))
    return out


def params(w: Weights, cfg: ModelConfig) -> dict:
    return mamba2.params(w, cfg, mixer_params)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if cfg.mixer_pattern != ("mamba",) or cfg.ffn_pattern != ("none",):
        raise ConversionError("MambaForCausalLM has a mamba mixer and no feed-forward in every layer")
    if cfg.mamba.inner_norms:
        raise ConversionError("mamba.inner_norms=True: MambaForCausalLM has no norms on dt, B and C (Jamba has)")
    return dict(model_type="mamba", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=cfg.num_layers, layer_norm_epsilon=cfg.norm_eps, hidden_act="silu",
                tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id, **mixer_hf_config(cfg, MAMBA_NAMES))


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("rescale_prenorm_residual", "residual_in_fp32", "time_step_floor", "time_step_init_scheme",
         "time_step_max", "time_step_min", "time_step_scale", "use_associative_scan", "use_mambapy")
ARCHITECTURES = {"MambaForCausalLM": Converter(DecoderLM, config, params, hf_config=hf_config, inert=INERT,
                                               export_rank=1)}
