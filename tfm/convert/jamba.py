"""Jamba (JambaForCausalLM) -> tfm DecoderLM mixing Mamba-1 and attention layers, dense and MoE feed-forwards.

Layer i's mixer is attention when i % attn_layer_period == attn_layer_offset, else Mamba-1 with RMSNorms
on dt, B and C (mamba.inner_norms); its feed-forward is a Mixtral-style MoE (top-k of the softmax, the
chosen probabilities not renormalised) when i % expert_layer_period == expert_layer_offset and
num_experts > 1, else a SwiGLU MLP of the same width. Attention has GQA and no positions (Jamba's
Mamba layers carry the order). tfm writes each layout as the shortest pattern that repeats over the
layers (mixer_pattern, ffn_pattern); export finds the period and offset back. use_mamba_kernels,
use_mambapy and use_associative_scan pick implementations; router_aux_loss_coef is kept for training.
"""
from __future__ import annotations


from tfm.config import ModelConfig
from tfm.convert import llama, mamba, mixtral
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, hybrid_mixer, model_params,
                                norm, period)
from tfm.models import DecoderLM

JAMBA_NAMES = dict(state_size="mamba_d_state", conv_kernel="mamba_d_conv", expand="mamba_expand",
                   dt_rank="mamba_dt_rank", conv_bias="mamba_conv_bias", proj_bias="mamba_proj_bias")


def _placed(hf: HFConfig, name: str, layers: int) -> list:
    """[whether layer i is one the HF fields `{name}_layer_period` / `_offset` place] for each layer."""
    period, offset = hf.get(f"{name}_layer_period", 1), hf.get(f"{name}_layer_offset", 0)
    if not 0 <= offset < period:
        raise hf.unsupported(f"{name}_layer_offset", offset, f"it must lie in [0, {name}_layer_period={period})")
    return [i % period == offset for i in range(layers)]


def config(hf: HFConfig) -> ModelConfig:
    vocab, D, N = hf.require("vocab_size"), hf.require("hidden_size"), hf.require("num_attention_heads")
    L = hf.require("num_hidden_layers")
    hf.expect("hidden_act", ["silu"], "silu")  # the MLPs' gate and the Mamba convolution's activation
    E = hf.get("num_experts", 16)
    attn = _placed(hf, "attn", L)
    moe = [chosen and E > 1 for chosen in _placed(hf, "expert", L)]
    experts = dict(num_experts=E, experts_per_token=hf.get("num_experts_per_tok", 2), router_norm_topk=False,
                   router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001)) if any(moe) else {}
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads", N),
        head_dim=hf.get("head_dim", D // N), num_layers=L, d_ff=hf.require("intermediate_size"),
        max_len=hf.get("max_position_embeddings", 262144), norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_position="pre", position="none", activation="swiglu", attention_bias=False, ffn_bias=False,
        mixer_pattern=period(["attention" if a else "mamba" for a in attn]),
        ffn_pattern=period(["moe" if m else "dense" for m in moe]),
        mamba=mamba.mixer_config(hf, D, JAMBA_NAMES, inner_norms=True),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_id=hf.pad_id(vocab),
        attention_dropout=hf.get("attention_dropout", 0.0), **experts)


def params(w: Weights, cfg: ModelConfig) -> dict:
    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        out = hybrid_mixer(w, p, cfg, i, mamba.mixer_params)
        if cfg.layer_ffn(i) == "moe":
            ffn = mixtral.moe_ffn(w, p, cfg, hub_block="feed_forward", hub_names=("gate_proj", "up_proj", "down_proj"),
                                  block="feed_forward", router="router")
        else:
            ffn = llama.swiglu(w, f"{p}.feed_forward", False)
        return {**out, "ffn_norm": norm(w, f"{p}.pre_ff_layernorm", "rmsnorm"), "ffn": ffn}
    decoder = Stack(layer, cfg.num_layers, final_norm="model.final_layernorm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def _period_fields(cfg: ModelConfig, kind_of, kind: str, others: str, name: str) -> dict:
    """{name}_layer_period / _offset placing `kind` where layer i's kind_of(i) has it (else `others`)."""
    kinds = [kind_of(i) for i in range(cfg.num_layers)]
    if set(kinds) - {kind, others}:
        raise ConversionError(f"JambaForCausalLM's layers are {kind!r} or {others!r}; this config has "
                              f"{sorted(set(kinds) - {kind, others})}")
    at = [i for i, k in enumerate(kinds) if k == kind]
    L = cfg.num_layers
    period = at[1] - at[0] if len(at) > 1 else L + 1 if not at else L
    offset = at[0] if at else L
    if [i % period == offset for i in range(L)] != [k == kind for k in kinds]:
        raise ConversionError(f"JambaForCausalLM places its {kind!r} layers once every {name}_layer_period layers "
                              f"from {name}_layer_offset; this config's layers are {kinds}")
    return {f"{name}_layer_period": period, f"{name}_layer_offset": offset}


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    out = dict(model_type="jamba", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
               num_hidden_layers=cfg.num_layers, intermediate_size=cfg.d_ff, max_position_embeddings=cfg.max_len,
               rms_norm_eps=cfg.norm_eps, hidden_act="silu", tie_word_embeddings=cfg.tie_embeddings,
               pad_token_id=cfg.pad_id, attention_dropout=cfg.attention_dropout,
               num_experts=max(cfg.num_experts, 1), num_experts_per_tok=cfg.experts_per_token,
               router_aux_loss_coef=cfg.router_aux_loss_coef, **mamba.mixer_hf_config(cfg, JAMBA_NAMES))
    out.update(_period_fields(cfg, cfg.layer_mixer, "attention", "mamba", "attn"))
    if cfg.num_experts:
        out.update(_period_fields(cfg, cfg.layer_ffn, "moe", "dense", "expert"))
    else:
        out.update(expert_layer_period=1, expert_layer_offset=0)
    return out


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("use_associative_scan", "use_mamba_kernels", "use_mambapy")
ARCHITECTURES = {"JambaForCausalLM": Converter(DecoderLM, config, params, hf_config=hf_config, inert=INERT,
                                               export_rank=1)}
