"""Granite 4.0-H (GraniteMoeHybridForCausalLM) -> tfm DecoderLM: Bamba's Mamba-2 and GQA attention layers (HF
layer_types "linear_attention" / "full_attention") with GraniteMoe's feed-forward and Granite's µP multipliers.

Every layer: the mixer after `input_layernorm`, then after `post_attention_layernorm` top-k experts (softmax
over the top-k logits: tfm's renormalised top-k of the softmax) plus the always-on, ungated `shared_mlp` of
shared_intermediate_size; without experts (num_local_experts=0) the shared MLP alone, a dense feed-forward.
Attention rotates with position_embedding_type="rope" and has no positions otherwise (Granite 4.0-H's
"nope"). Embeddings times embedding_multiplier, sublayer outputs times residual_multiplier, attention logits
times attention_multiplier, logits divided by logits_scaling. The experts' tensors come in transformers'
in-memory layout (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj`, `router.weight`) or the Hub's
(`input_linear`, `output_linear`, `router.layer`).
"""
from __future__ import annotations

import numpy as np

from tfm.config import ModelConfig
from tfm.convert import bamba, mamba2
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, dense, hf_rope, hybrid_mixer,
                                linear, model_params, norm, period, rope)
from tfm.models import DecoderLM

KINDS = {"linear_attention": "mamba2", "full_attention": "attention"}  # HF layer_types -> mixer_pattern
# GraniteMoeHybridConfig's defaults for the fields a checkpoint's config.json may leave out
DEFAULTS = dict(bamba.DEFAULTS, rms_norm_eps=1e-6, max_position_embeddings=2048,
                num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=1024)


def config(hf: HFConfig) -> ModelConfig:
    hf = bamba.with_defaults(hf, DEFAULTS)
    D, N, L = hf.require("hidden_size"), hf.require("num_attention_heads"), hf.require("num_hidden_layers")
    if hf.get("mamba_d_head") == "auto":
        hf.fields["mamba_d_head"] = hf.get("mamba_expand") * D // hf.require("mamba_n_heads")
    types = hf.get("layer_types") or ["linear_attention"] * L
    if len(types) != L or set(types) - set(KINDS):
        raise hf.unsupported("layer_types", types, f"tfm maps {sorted(KINDS)}, one per layer")
    positions = hf.expect("position_embedding_type", ["rope", "nope", None])
    if positions != "rope":
        hf.has("rope_parameters"), hf.has("rope_theta")  # written by HF, used by no layer
    E, shared = hf.get("num_local_experts"), hf.require("shared_intermediate_size")
    if E:
        moe = dict(num_experts=E, d_ff=hf.require("intermediate_size"), experts_per_token=hf.get("num_experts_per_tok"),
                   router_norm_topk=True, shared_expert_d_ff=shared, shared_expert_gate=False,
                   router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
    else:  # the shared MLP alone; the experts' fields say nothing
        for name in ("intermediate_size", "num_experts_per_tok", "router_aux_loss_coef"):
            hf.has(name)
        moe = dict(d_ff=shared)
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads") or N,
        head_dim=hf.get("head_dim", D // N), num_layers=L, max_len=hf.get("max_position_embeddings"),
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps"), norm_position="pre", final_norm=True,
        position="rope" if positions == "rope" else "none",
        **(dict(rope=rope(hf, 10_000.0)) if positions == "rope" else {}),
        activation=hf.activation("hidden_act", "silu", gated=True), attention_bias=bool(hf.get("attention_bias", False)),
        ffn_bias=False, tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_id=hf.pad_id(vocab),
        attention_dropout=hf.get("attention_dropout", 0.0), mixer_pattern=period([KINDS[t] for t in types]),
        mamba2=mamba2.mixer_config(hf, bamba.MIXER_FIELDS),
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        attention_scale=float(hf.get("attention_multiplier", 1.0)),
        logits_multiplier=1.0 / float(hf.get("logits_scaling", 1.0)), **moe)


def _gate_up(fused: np.ndarray) -> tuple:
    """[..., 2F, D] rows gate then up -> (gate, up), each [..., F, D]."""
    return np.split(fused, 2, axis=-2)


def ffn_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """Layer `p`'s experts (if any) and shared MLP -> a MoeMlp's params (its `shared_expert`), or an Mlp's."""
    D, E, F = cfg.d_model, cfg.num_experts, cfg.d_ff
    S = cfg.shared_expert_d_ff or F
    gate, up = _gate_up(w(f"{p}.shared_mlp.input_linear.weight", (2 * S, D)))
    shared = {"wi_gate": dense(gate), "wi_up": dense(up), "wo": linear(w, f"{p}.shared_mlp.output_linear", False)}
    if not E:
        return shared
    q = f"{p}.block_sparse_moe"
    if w.has(f"{q}.experts.gate_up_proj"):  # transformers' in-memory layout
        router, fused, down = f"{q}.router.weight", f"{q}.experts.gate_up_proj", f"{q}.experts.down_proj"
    else:  # the Hub's
        router, fused, down = f"{q}.router.layer.weight", f"{q}.input_linear.weight", f"{q}.output_linear.weight"
    gate, up = _gate_up(w(fused, (E, 2 * F, D)))
    return {"router": {"kernel": w(router, (E, D)).T}, "wi_gate": gate.transpose(0, 2, 1),
            "wi_up": up.transpose(0, 2, 1), "wo": w(down, (E, D, F)).transpose(0, 2, 1), "shared_expert": shared}


def params(w: Weights, cfg: ModelConfig) -> dict:
    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        return {**hybrid_mixer(w, p, cfg, i, mamba2.mixer_params),
                "ffn_norm": norm(w, f"{p}.post_attention_layernorm", "rmsnorm"), "ffn": ffn_params(w, p, cfg)}
    decoder = Stack(layer, cfg.num_layers, final_norm="model.norm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    names = {kind: name for name, kind in KINDS.items()}
    kinds = [cfg.layer_mixer(i) for i in range(cfg.num_layers)]
    if set(kinds) - set(names) or cfg.ffn_pattern is not None or (cfg.num_experts and (
            cfg.shared_expert_gate or not cfg.shared_expert_d_ff or not cfg.router_norm_topk)):
        raise ConversionError(f"GraniteMoeHybridForCausalLM's layers are {sorted(names)}, each with top-k experts "
                              "(renormalised) beside an ungated shared MLP, or that MLP alone")
    E = cfg.num_experts
    out = dict(
        model_type="granitemoehybrid", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.norm_eps,
        attention_bias=cfg.attention_bias, attention_dropout=cfg.attention_dropout,
        tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id, layer_types=[names[k] for k in kinds],
        num_local_experts=E, num_experts_per_tok=cfg.experts_per_token, router_aux_loss_coef=cfg.router_aux_loss_coef,
        intermediate_size=cfg.d_ff, shared_intermediate_size=cfg.shared_expert_d_ff if E else cfg.d_ff,
        embedding_multiplier=cfg.embedding_multiplier, residual_multiplier=cfg.residual_multiplier,
        attention_multiplier=cfg.head_dim ** -0.5 if cfg.attention_scale is None else cfg.attention_scale,
        logits_scaling=1.0 / cfg.logits_multiplier, position_embedding_type="rope" if cfg.position == "rope" else "nope",
        **mamba2.mixer_hf_config(cfg, bamba.MIXER_FIELDS))
    if cfg.position == "rope":
        out.update(hf_rope(cfg))
    return out


INERT = bamba.INERT + ("output_router_logits",)
ARCHITECTURES = {"GraniteMoeHybridForCausalLM": Converter(DecoderLM, config, params, ignore=("*rotary_emb.inv_freq",),
                                                          hf_config=hf_config, inert=INERT, export_rank=1)}
