"""Llama 4 text (Llama4ForCausalLM: Scout, Maverick) -> tfm DecoderLM: the Llama mapping with RoPE on adjacent
pairs (interleaved), NoPE layers (no_rope_layers -> position_pattern), the RoPE layers' chunked attention
(layer_types "chunked_attention" -> attention_pattern "span", attention_chunk_size -> attention_span), their
queries and keys RMS-normalised without a weight after RoPE (use_qk_norm -> rope_qk_rms_norm), the NoPE layers'
attention temperature (attn_temperature_tuning: attn_scale, floor_scale), and a mixture of experts on the
moe_layers (every interleave_moe_layer_step-th): one expert chosen by sigmoid score, whose input (not output) the
gate scales (router_gate_input), beside an ungated shared expert; the other layers dense (intermediate_size_mlp)."""
from __future__ import annotations

import dataclasses

from tfm.config import ModelConfig
from tfm.convert import llama, qwen2, smollm3
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights, dense, period, rope
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    L, F = hf.require("num_hidden_layers"), hf.require("intermediate_size")
    flags = hf.require("no_rope_layers")
    moe_layers = set(hf.require("moe_layers"))
    ffns = period("moe" if i in moe_layers else "dense" for i in range(L))
    hf.expect("num_experts_per_tok", [1], 1)
    tuning = bool(hf.get("attn_temperature_tuning", False))
    return llama.config(
        hf, default_theta=500_000.0, rope=dataclasses.replace(rope(hf, 500_000.0), interleaved=True),
        rope_qk_rms_norm=bool(hf.get("use_qk_norm", False)),
        nope_temperature=float(hf.require("attn_scale")) if tuning else 0.0,
        nope_temperature_floor=int(hf.require("floor_scale")), num_experts=hf.require("num_local_experts"),
        experts_per_token=1, router_score="sigmoid", router_norm_topk=False, router_gate_input=True,
        shared_expert_d_ff=F, shared_expert_gate=False, router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
        ffn_pattern=None if ffns == ("moe",) else ffns, dense_d_ff=hf.require("intermediate_size_mlp"),
        **_layers(hf), **smollm3.position_pattern(hf, flags))


def _layers(hf: HFConfig) -> dict:
    """attention_pattern from layer_types (chunked -> "span", full -> "global") and attention_span."""
    hf.require("layer_types")
    layers = qwen2.attention_layers(hf, {**qwen2.KINDS, "chunked_attention": "span"})
    if layers["sliding_window"] is not None:
        raise ConversionError(f"{hf.architecture}: layer_types has sliding layers; Llama 4's local layers are chunked")
    span = "span" in (layers["attention_pattern"] or ())
    return dict(layers, attention_span=hf.require("attention_chunk_size") if span else None)


def moe_ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    E, D, F = cfg.num_experts, cfg.d_model, cfg.d_ff
    q = f"{p}.feed_forward"
    gate_up = w(f"{q}.experts.gate_up_proj", (E, D, 2 * F))
    return {"router": dense(w(f"{q}.router.weight", (E, D))),
            "wi_gate": gate_up[..., :F], "wi_up": gate_up[..., F:], "wo": w(f"{q}.experts.down_proj", (E, F, D)),
            "shared_expert": llama.swiglu(w, f"{q}.shared_expert", bias=False)}


def dense_ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    return llama.swiglu(w, f"{p}.feed_forward", bias=False)


def params(w: Weights, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, ffn=moe_ffn, dense=dense_ffn)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if not (cfg.num_experts and cfg.router_gate_input and cfg.rope.interleaved):
        raise ConversionError("Llama 4 rotates adjacent pairs and gates its one expert's input")
    out = llama.hf_config(cfg, model_type="llama4_text")
    del out["mlp_bias"]
    layers = qwen2.hf_attention_layers(cfg)
    names = {"global": "full_attention", "span": "chunked_attention"}
    layers["layer_types"] = [names[cfg.attention_pattern[i % len(cfg.attention_pattern)]] if cfg.attention_pattern
                             else "full_attention" for i in range(cfg.num_layers)]
    del layers["use_sliding_window"], layers["sliding_window"]
    return dict(out, **layers, attention_chunk_size=cfg.attention_span or cfg.max_len,
                no_rope_layers=[int(cfg.layer_rope(i) is not None) for i in range(cfg.num_layers)],
                use_qk_norm=cfg.rope_qk_rms_norm, attn_temperature_tuning=bool(cfg.nope_temperature),
                attn_scale=cfg.nope_temperature, floor_scale=cfg.nope_temperature_floor,
                num_local_experts=cfg.num_experts, num_experts_per_tok=1, intermediate_size=cfg.d_ff,
                intermediate_size_mlp=cfg.dense_d_ff or cfg.d_ff, router_aux_loss_coef=cfg.router_aux_loss_coef,
                moe_layers=[i for i in range(cfg.num_layers) if cfg.layer_ffn(i) == "moe"])


INERT = ("interleave_moe_layer_step", "no_rope_layer_interval")  # moe_layers and no_rope_layers spell them out
ARCHITECTURES = {"Llama4ForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config,
                                                   inert=INERT)}
