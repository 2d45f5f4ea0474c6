"""Falcon-H1 (FalconH1ForCausalLM) -> tfm DecoderLM whose every layer is the parallel composite
"attention+mamba2": GQA attention (RoPE, rotate-halves) and a Mamba-2 mixer read the same `input_layernorm`
output and their outputs are summed, then a SwiGLU feed-forward after `pre_ff_layernorm`; a final
`final_layernorm`.

Falcon-H1's µP multipliers, each a tfm config value (none folded into the weights, so fine-tuning sees the
parametrisation the model was trained in): attention_in/out and ssm_in/out -> mixer_multipliers of the two
branches; key_multiplier -> key_multiplier; mlp_multipliers (gate, down) -> ffn_multipliers;
ssm_multipliers (the in_proj segments z, x, B, C, dt) -> mamba2.proj_multipliers; embedding_multiplier ->
embedding_multiplier; lm_head_multiplier -> logits_multiplier. The Mamba-2 mixer is mamba_d_ssm wide
(expand * hidden_size when that is null) and gates its output with silu(z) alone (mamba_rms_norm=False)
or through a gated RMSNorm over mamba_n_groups groups (normalised before the gate when
mamba_norm_before_gate): mamba2.gate_norm.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import bamba, llama, mamba2
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, hf_rope, model_params, norm,
                                rope, self_attention)
from tfm.models import DecoderLM

MIXERS = ("attention+mamba2",)  # every layer's
MIXER_FIELDS = dict(bamba.MIXER_FIELDS, expand=None)  # sized by mamba_n_heads * mamba_d_head
# FalconH1Config's defaults for the fields a checkpoint's config.json may leave out
DEFAULTS = dict(num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=8192,
                mamba_d_ssm=1024, mamba_n_heads=128, mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256,
                mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True, mamba_proj_bias=False,
                mamba_norm_before_gate=True, mamba_rms_norm=False, projectors_bias=False)


def _mixer(hf: HFConfig) -> dict:
    """ModelConfig.mamba2 of Falcon-H1's mixer."""
    D = hf.require("hidden_size")
    expand = hf.get("mamba_expand")  # the width where mamba_d_ssm is null
    inner = hf.get("mamba_d_ssm") or expand * D
    if hf.get("mamba_d_head") == "auto":
        hf.fields["mamba_d_head"] = inner // hf.require("mamba_n_heads")
    if hf.get("mamba_n_heads") * hf.get("mamba_d_head") != inner:
        raise hf.unsupported("mamba_n_heads", hf.get("mamba_n_heads"),
                             f"mamba_n_heads * mamba_d_head must be the mixer's width {inner}")
    if bool(hf.get("projectors_bias")) != bool(hf.get("mamba_proj_bias")):
        raise hf.unsupported("projectors_bias", hf.get("projectors_bias"),
                             "tfm's Mamba-2 has biases on both its projections or on neither (mamba_proj_bias)")
    before_gate = bool(hf.get("mamba_norm_before_gate"))  # read either way: it says nothing without the norm
    gate_norm = ("norm_first" if before_gate else "gate_first") if hf.get("mamba_rms_norm") else "none"
    multipliers = tuple(hf.get("ssm_multipliers") or (1.0,) * 5)
    if len(multipliers) != 5:
        raise hf.unsupported("ssm_multipliers", multipliers, "one per in_proj segment (z, x, B, C, dt)")
    return dict(mamba2.mixer_config(hf, MIXER_FIELDS), gate_norm=gate_norm, proj_multipliers=multipliers)


def config(hf: HFConfig) -> ModelConfig:
    hf = bamba.with_defaults(hf, DEFAULTS)
    D, N = hf.require("hidden_size"), hf.require("num_attention_heads")
    mlp = tuple(hf.get("mlp_multipliers") or (1.0, 1.0))
    if len(mlp) != 2:
        raise hf.unsupported("mlp_multipliers", mlp, "(gate, down)")
    vocab = hf.require("vocab_size")
    scales = (("attention", float(hf.get("attention_in_multiplier", 1.0)), float(hf.get("attention_out_multiplier", 1.0))),
              ("mamba2", float(hf.get("ssm_in_multiplier", 1.0)), float(hf.get("ssm_out_multiplier", 1.0))))
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads") or N,
        head_dim=hf.get("head_dim") or D // N, num_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"), max_len=hf.get("max_position_embeddings"), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps"), norm_position="pre", final_norm=True, position="rope",
        rope=rope(hf, 10_000.0), activation=hf.activation("hidden_act", "silu", gated=True),
        attention_bias=bool(hf.get("attention_bias", False)), ffn_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_id=hf.pad_id(vocab),
        attention_dropout=hf.get("attention_dropout", 0.0), mixer_pattern=MIXERS, mamba2=_mixer(hf),
        mixer_multipliers=None if all(s == (1.0, 1.0) for _, *s in scales) else scales,
        key_multiplier=float(hf.get("key_multiplier", 1.0)), ffn_multipliers=mlp,
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        logits_multiplier=float(hf.get("lm_head_multiplier", 1.0)))


def layer(w: Weights, p: str, cfg: ModelConfig) -> dict:
    return {"attn_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"),
            "self_attn": self_attention(w, f"{p}.self_attn", cfg),
            "mixer": mamba2.mixer_params(w, f"{p}.mamba", cfg),
            "ffn_norm": norm(w, f"{p}.pre_ff_layernorm", "rmsnorm"),
            "ffn": llama.swiglu(w, f"{p}.feed_forward", cfg.ffn_bias)}


def params(w: Weights, cfg: ModelConfig) -> dict:
    decoder = Stack(lambda i: layer(w, f"model.layers.{i}", cfg), cfg.num_layers, final_norm="model.final_layernorm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if cfg.mixer_pattern != MIXERS or cfg.ffn_pattern is not None or cfg.num_experts:
        raise ConversionError(f"FalconH1ForCausalLM's layers are each {MIXERS[0]!r} with a dense SwiGLU "
                              f"feed-forward; mixer_pattern={cfg.mixer_pattern}")
    m = cfg.mamba2
    (attn_in, attn_out), (ssm_in, ssm_out) = cfg.mixer_scales("attention"), cfg.mixer_scales("mamba2")
    out = dict(llama.hf_config(cfg, model_type="falcon_h1"), projectors_bias=m.proj_bias,
               mamba_d_ssm=m.width(cfg.d_model), mamba_rms_norm=m.gate_norm != "none",
               mamba_norm_before_gate=m.gate_norm != "gate_first", ssm_multipliers=list(m.proj_multipliers),
               attention_in_multiplier=attn_in, attention_out_multiplier=attn_out, ssm_in_multiplier=ssm_in,
               ssm_out_multiplier=ssm_out, key_multiplier=cfg.key_multiplier,
               mlp_multipliers=list(cfg.ffn_multipliers), embedding_multiplier=cfg.embedding_multiplier,
               lm_head_multiplier=cfg.logits_multiplier, **mamba2.mixer_hf_config(cfg, MIXER_FIELDS))
    out.update(hf_rope(cfg))
    return out


# HF config fields that change nothing tfm computes (initialisation, kernels, caching, ...)
INERT = ("mamba_chunk_size", "num_logits_to_keep")
ARCHITECTURES = {"FalconH1ForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE,
                                                  hf_config=hf_config, inert=INERT, export_rank=1)}
