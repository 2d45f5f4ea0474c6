"""MiniMax-01 (MiniMaxForCausalLM) -> tfm DecoderLM: lightning attention ("lightning", HF layer_types
"linear_attention") beside GQA softmax attention with RoPE ("full_attention"), a Mixtral-style top-k MoE in
every layer.

Each sublayer takes its skip path after its norm (norm_position="normed_residual"):
x -> alpha * n(x) + beta * f(n(x)), the attention factors per layer kind (full_attn_* / linear_attn_*), the
feed-forward's mlp_*: alpha -> skip_multipliers, beta -> mixer_multipliers' outputs and ffn_multipliers' output.
HF fuses the lightning layer's q, k and v per head (`qkv_proj` rows: head n's q, k, v of head_dim each) and
holds its decay rates as the buffer `slope_rate` [N, 1, 1] (read as the layer's `slope`); the decays it
derives from them (query_decay, key_decay, diagonal_decay) are recomputed.
"""
from __future__ import annotations

import numpy as np

from tfm.config import ModelConfig
from tfm.convert import bamba, llama, mixtral
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, hybrid_mixer, model_params,
                                norm, period, rope)
from tfm.models import DecoderLM

KINDS = {"full_attention": "attention", "linear_attention": "lightning"}  # HF layer_types -> mixer_pattern
FACTORS = {"attention": "full_attn", "lightning": "linear_attn", "ffn": "mlp"}  # tfm sublayer -> HF factor prefix
DEFAULTS = dict(num_key_value_heads=8, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=4096 * 32,
                num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001)


def layer_kinds(hf: HFConfig) -> list:
    L = hf.require("num_hidden_layers")
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(L)]
    if len(types) != L or set(types) - set(KINDS):
        raise hf.unsupported("layer_types", types, f"tfm maps {sorted(KINDS)}, one per layer")
    return [KINDS[t] for t in types]


def config(hf: HFConfig) -> ModelConfig:
    hf = bamba.with_defaults(hf, DEFAULTS)
    D, N = hf.require("hidden_size"), hf.require("num_attention_heads")
    kinds = layer_kinds(hf)
    factor = lambda sublayer, which: float(hf.get(f"{FACTORS[sublayer]}_{which}_factor", 1))
    used = set(kinds)
    for sublayer in set(FACTORS) - used - {"ffn"}:  # the factors of a kind no layer has
        hf.has(f"{FACTORS[sublayer]}_alpha_factor"), hf.has(f"{FACTORS[sublayer]}_beta_factor")
    skips = tuple((k, factor(k, "alpha")) for k in sorted(used | {"ffn"}))
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads") or N,
        head_dim=hf.get("head_dim") or D // N, num_layers=len(kinds), d_ff=hf.require("intermediate_size"),
        max_len=hf.get("max_position_embeddings"), norm="rmsnorm", norm_eps=hf.get("rms_norm_eps"),
        norm_position="normed_residual", final_norm=True, position="rope", rope=rope(hf, 1e6),
        activation=hf.activation("hidden_act", "silu", gated=True), attention_bias=False, ffn_bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_id=hf.pad_id(vocab),
        attention_dropout=hf.get("attention_dropout", 0.0), sliding_window=hf.get("sliding_window"),
        mixer_pattern=period(kinds), num_experts=hf.require("num_local_experts"),
        experts_per_token=hf.get("num_experts_per_tok"), router_norm_topk=True,
        router_aux_loss_coef=hf.get("router_aux_loss_coef"),
        mixer_multipliers=tuple((k, 1.0, factor(k, "beta")) for k in sorted(used)),
        skip_multipliers=skips, ffn_multipliers=(1.0, factor("ffn", "beta")))


def lightning_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """HF's MiniMaxLightningAttention at `p` -> tfm LightningAttention params."""
    D, N, H = cfg.d_model, cfg.num_heads, cfg.head_dim
    qkv = w(f"{p}.qkv_proj.weight", (N * 3 * H, D)).reshape(N, 3, H, D).transpose(1, 3, 0, 2)  # [3, D, N, H]
    return {"query": {"kernel": qkv[0]}, "key": {"kernel": qkv[1]}, "value": {"kernel": qkv[2]},
            "slope": w(f"{p}.slope_rate", (N, 1, 1)).reshape(N), "norm": w(f"{p}.norm.weight", (N * H,)),
            "gate": {"kernel": w(f"{p}.output_gate.weight", (N * H, D)).T},
            "out": {"kernel": w(f"{p}.out_proj.weight", (D, N * H)).T.reshape(N, H, D)}}


def params(w: Weights, cfg: ModelConfig) -> dict:
    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        return dict(hybrid_mixer(w, p, cfg, i, lightning_params, at="self_attn"),
                    ffn_norm=norm(w, f"{p}.post_attention_layernorm", "rmsnorm"), ffn=mixtral.moe_ffn(w, p, cfg))
    decoder = Stack(layer, cfg.num_layers, final_norm="model.norm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    names = {kind: name for name, kind in KINDS.items()}
    kinds = [cfg.layer_mixer(i) for i in range(cfg.num_layers)]
    if set(kinds) - set(names) or not cfg.num_experts or cfg.norm_position != "normed_residual":
        raise ConversionError(f"MiniMaxForCausalLM's layers are {sorted(names)} with top-k experts, each sublayer's "
                              "skip path after its norm (norm_position='normed_residual')")
    out = dict(mixtral.hf_config(cfg), model_type="minimax", layer_types=[names[k] for k in kinds])
    for sublayer, prefix in FACTORS.items():
        beta = cfg.ffn_multipliers[1] if sublayer == "ffn" else cfg.mixer_scales(sublayer)[1]
        out.update({f"{prefix}_alpha_factor": cfg.skip_scale(sublayer), f"{prefix}_beta_factor": beta})
    return out


def decays(hf, tensors: dict) -> dict:
    """Export: each lightning layer's query_decay, key_decay [N, S, 1] and diagonal_decay [1, N, S, S] from its
    slope_rate [N, 1, 1] over blocks of S = block_size tokens, as HF derives them."""
    import torch  # export has torch; its exp, so the buffers are bit-identical to HF's own
    S = hf.block_size
    steps = torch.arange(1, S + 1)[:, None]  # [S, 1]
    out = {}
    for key, slope in tensors.items():
        if key.endswith(".self_attn.slope_rate"):
            p, s = key[:-len("slope_rate")], torch.from_numpy(np.asarray(slope, np.float32))  # [N, 1, 1]
            lag = s[None] * (steps - steps.T)[None, None]  # [1, N, S, S]
            diagonal = torch.exp(torch.where(lag >= 0, -lag, float("-inf")))
            out.update({f"{p}query_decay": torch.exp(-s * steps).numpy(),
                        f"{p}key_decay": torch.exp(-s * (S - steps)).numpy(), f"{p}diagonal_decay": diagonal.numpy()})
    return out


INERT = ("block_size", "output_router_logits", "router_jitter_noise")
IGNORE = llama.IGNORE + ("*.self_attn.query_decay", "*.self_attn.key_decay", "*.self_attn.diagonal_decay")
ARCHITECTURES = {"MiniMaxForCausalLM": Converter(DecoderLM, config, params, ignore=IGNORE, hf_config=hf_config,
                                                 inert=INERT, export_rank=1, derived=decays)}
