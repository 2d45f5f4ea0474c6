"""Mamba-2 (Mamba2ForCausalLM) -> tfm DecoderLM with every layer a "mamba2" mixer and no feed-forward.

Pre-norm RMSNorm blocks, no positions, the final `norm_f`. HF fuses the mixer's input projection
(`in_proj` rows: gate z, x, B, C, dt) and its depthwise convolution (`conv1d` channels: x, B, C); tfm
keeps each part a projection (and a convolution) of its own, so tensor parallelism can split the
heads. `mixer_params` also serves the hybrids that use the same mixer (Bamba, Nemotron-H).
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

from tfm.config import ModelConfig
from tfm.convert.common import ConversionError, Converter, HFConfig, Stack, Weights, model_params, norm
from tfm.models import DecoderLM


# ModelConfig.mamba2 field -> the HF config field holding it (Mamba2Config's names). `expand` None: HF sizes
# the mixer by num_heads * head_dim alone (expand = that / hidden_size); `dt_limit` None: the family sets it.
MIXER_FIELDS = dict(state_size="state_size", conv_kernel="conv_kernel", expand="expand", head_dim="head_dim",
                    num_heads="num_heads", groups="n_groups", conv_bias="use_conv_bias", proj_bias="use_bias",
                    dt_limit="time_step_limit", activation="hidden_act")


def mixer_config(hf: HFConfig, fields: Mapping[str, Optional[str]] = MIXER_FIELDS) -> dict:
    """ModelConfig.mamba2 from the HF fields `fields` names (MIXER_FIELDS: Mamba2Config's; the hybrids
    pass their own, e.g. Bamba's mamba_d_state)."""
    D = hf.require("hidden_size")
    head_dim, heads = hf.require(fields["head_dim"]), hf.require(fields["num_heads"])
    if fields["expand"]:
        expand = hf.get(fields["expand"], 2)
        if heads * head_dim != expand * D:
            raise hf.unsupported(fields["num_heads"], heads, f"tfm needs {fields['num_heads']} * {fields['head_dim']} "
                                                             f"== expand * hidden_size ({heads} * {head_dim}, "
                                                             f"hidden_size {D})")
        width = dict(expand=expand)
    else:  # sized by the heads alone
        width = dict(expand=heads * head_dim // D) if heads * head_dim % D == 0 else dict(inner=heads * head_dim)
    hf.expect(fields["activation"], ["silu"], "silu")
    out = dict(state_size=hf.require(fields["state_size"]), conv_kernel=hf.get(fields["conv_kernel"], 4),
               head_dim=head_dim, groups=hf.get(fields["groups"], 1), **width,
               conv_bias=bool(hf.get(fields["conv_bias"], True)), proj_bias=bool(hf.get(fields["proj_bias"], False)))
    if fields["dt_limit"]:
        out["dt_limit"] = tuple(map(_float, hf.get(fields["dt_limit"], (0.0, float("inf")))))
    return out


def _float(value) -> float:
    """A float of an HF config, which writes infinities to JSON as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def config(hf: HFConfig) -> ModelConfig:
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=hf.require("hidden_size"), num_heads=hf.require("num_heads"),
        head_dim=hf.require("head_dim"), num_layers=hf.require("num_hidden_layers"), d_ff=1, norm="rmsnorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), norm_position="pre", position="none",
        mixer_pattern=("mamba2",), ffn_pattern=("none",), mamba2=mixer_config(hf),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_id=hf.pad_id(vocab), attention_bias=False)


def mixer_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """HF's Mamba2Mixer at prefix `p` -> tfm's Mamba2 params."""
    m, D = cfg.mamba2, cfg.d_model
    E = m.width(D)
    N, P, GS = E // m.head_dim, m.head_dim, m.groups * m.state_size
    K = m.conv_kernel
    in_proj = w(f"{p}.in_proj.weight", (2 * E + 2 * GS + N, D))
    bounds = {"gate": (0, E), "x": (E, 2 * E), "B": (2 * E, 2 * E + GS), "C": (2 * E + GS, 2 * E + 2 * GS),
              "dt": (2 * E + 2 * GS, 2 * E + 2 * GS + N)}
    shapes = {"gate": (N, P), "x": (N, P), "B": (m.groups, m.state_size), "C": (m.groups, m.state_size), "dt": (N,)}
    in_bias = w(f"{p}.in_proj.bias") if m.proj_bias else None
    out = {}
    for name, (lo, hi) in bounds.items():
        out[name] = {"kernel": in_proj[lo:hi].T.reshape((D,) + shapes[name])}
        if in_bias is not None:
            out[name]["bias"] = in_bias[lo:hi].reshape(shapes[name])
    conv = w(f"{p}.conv1d.weight", (E + 2 * GS, 1, K))[:, 0].T  # [K, E + 2GS]
    conv_bias = w(f"{p}.conv1d.bias") if m.conv_bias else None
    for name, (lo, hi) in (("conv_x", (0, E)), ("conv_B", (E, E + GS)), ("conv_C", (E + GS, E + 2 * GS))):
        out[name] = {"kernel": conv[:, lo:hi]}
        if conv_bias is not None:
            out[name]["bias"] = conv_bias[lo:hi]
    out.update(dt_bias=w(f"{p}.dt_bias", (N,)), A_log=w(f"{p}.A_log", (N,)), D=w(f"{p}.D", (N,)))
    if m.gate_norm != "none":
        out["norm"] = {"weight": w(f"{p}.norm.weight", (E,))}
    out["out"] = {"kernel": w(f"{p}.out_proj.weight", (D, E)).T.reshape(N, P, D)}
    if m.proj_bias:
        out["out"]["bias"] = w(f"{p}.out_proj.bias")
    return out


def params(w: Weights, cfg: ModelConfig, mixer: Callable = mixer_params) -> dict:
    """The `backbone` of Mamba2ForCausalLM (and MambaForCausalLM, with its `mixer`): layers of `norm` and
    `mixer`, the final `norm_f`."""
    def layer(i: int) -> dict:
        p = f"backbone.layers.{i}"
        return {"mixer_norm": norm(w, f"{p}.norm", "rmsnorm"), "mixer": mixer(w, f"{p}.mixer", cfg)}
    decoder = Stack(layer, cfg.num_layers, final_norm="backbone.norm_f")
    return model_params(w, cfg, embedding="backbone.embeddings.weight", stacks={"decoder": decoder})


def mixer_hf_config(cfg: ModelConfig, fields: Mapping[str, Optional[str]] = MIXER_FIELDS) -> dict:
    """The inverse of `mixer_config` (the HF names `fields` gives; those mapped to None are not written)."""
    m = cfg.mamba2
    if m.norm_groups not in (None, m.groups):
        raise ConversionError(f"Mamba-2 normalises its gated output in n_groups groups; mamba2.norm_groups="
                              f"{m.norm_groups} differs from mamba2.groups={m.groups}")
    if fields["expand"] and m.width(cfg.d_model) != m.expand * cfg.d_model:
        raise ConversionError(f"this family's Mamba-2 is expand * hidden_size wide; mamba2.inner={m.inner}")
    values = dict(state_size=m.state_size, conv_kernel=m.conv_kernel, expand=m.expand, head_dim=m.head_dim,
                  num_heads=m.width(cfg.d_model) // m.head_dim, groups=m.groups, conv_bias=m.conv_bias,
                  proj_bias=m.proj_bias, dt_limit=list(m.dt_limit), activation="silu")
    return {fields[name]: value for name, value in values.items() if fields[name]}


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if cfg.mixer_pattern != ("mamba2",) or cfg.ffn_pattern != ("none",):
        raise ConversionError("Mamba2ForCausalLM has a mamba2 mixer and no feed-forward in every layer")
    return dict(model_type="mamba2", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=cfg.num_layers, layer_norm_epsilon=cfg.norm_eps,
                tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id, **mixer_hf_config(cfg))


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("chunk_size", "rescale_prenorm_residual", "residual_in_fp32", "time_step_floor", "time_step_max",
         "time_step_min", "time_step_rank")
ARCHITECTURES = {"Mamba2ForCausalLM": Converter(DecoderLM, config, params, hf_config=hf_config, inert=INERT,
                                                export_rank=1)}
