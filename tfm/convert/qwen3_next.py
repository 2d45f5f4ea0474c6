"""Qwen3-Next (Qwen3NextForCausalLM) -> tfm DecoderLM: gated DeltaNet and gated attention layers
(HF layer_types, or one full-attention layer every full_attention_interval) as mixer_pattern, each with
Qwen2-MoE's feed-forward (top-k experts plus a shared expert under a sigmoid gate).

The attention layers are Qwen3's (RMSNorm over each query and key head, GQA) with RoPE on the first
partial_rotary_factor of each head and an output gate: HF's q_proj holds, per head, the query's
head_dim rows and then the gate's (ModelConfig.attention_output_gate). Every RMSNorm but the
DeltaNet's gated one multiplies by (1 + weight) (norm_scale_offset=1). HF fuses the DeltaNet's
projections per key head: in_proj_qkvz rows are, for each key head, its q, k, and then the v and z
rows of the value heads it serves; in_proj_ba likewise b then a; conv1d's channels are q, k, v.
tfm keeps each a projection (and a convolution) of its own. Layers outside the MoE (mlp_only_layers,
decoder_sparse_step > 1) become ffn_pattern's "dense" layers of intermediate_size (dense_d_ff).
The multi-token-prediction head (`mtp.*`) is not kept.
"""
from __future__ import annotations


from tfm.config import ModelConfig
from tfm.convert import llama, qwen2_moe
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, attention, hf_rope,
                                linear_pair, model_params, norm, period, rope)
from tfm.models import DecoderLM

MIXERS = {"linear_attention": "gated_deltanet", "full_attention": "attention"}  # HF layer_types -> mixer_pattern


def config(hf: HFConfig) -> ModelConfig:
    D, N, L = hf.require("hidden_size"), hf.require("num_attention_heads"), hf.require("num_hidden_layers")
    vocab = hf.require("vocab_size")
    hf.expect("hidden_act", ["silu"], "silu")  # the experts' gates and the DeltaNet's convolution
    interval = hf.get("full_attention_interval", 4)
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
    unknown = sorted(set(layer_types) - set(MIXERS))
    if unknown or len(layer_types) != L:
        raise hf.unsupported("layer_types", layer_types, f"tfm maps {sorted(MIXERS)}, one per layer")
    mixers = period([MIXERS[t] for t in layer_types])
    E, step = hf.get("num_experts", 0), hf.get("decoder_sparse_step", 1)
    if not E:  # the experts' fields say nothing without experts
        for name in ("moe_intermediate_size", "norm_topk_prob", "num_experts_per_tok", "router_aux_loss_coef",
                     "shared_expert_intermediate_size"):
            hf.has(name)
    dense_only = set(hf.get("mlp_only_layers") or ())
    ffns = ["moe" if E and i not in dense_only and (i + 1) % step == 0 else "dense" for i in range(L)]
    moe = dict(num_experts=0, d_ff=hf.get("intermediate_size"))
    if "moe" in ffns:
        shared = hf.require("shared_expert_intermediate_size")
        if shared < 1:
            raise hf.unsupported("shared_expert_intermediate_size", shared, "Qwen3-Next's MoE has a shared expert")
        F = hf.require("moe_intermediate_size")
        moe = dict(num_experts=E, d_ff=F, experts_per_token=hf.get("num_experts_per_tok", 10),
                   router_norm_topk=bool(hf.get("norm_topk_prob", True)), shared_expert_d_ff=shared,
                   router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
                   ffn_pattern=None if "dense" not in ffns else period(ffns),
                   dense_d_ff=None if hf.get("intermediate_size", F) == F else hf.require("intermediate_size"))
    elif moe["d_ff"] is None:
        raise ConversionError(f"{hf.architecture}: config field 'intermediate_size' is missing")
    deltanet = dict(key_heads=hf.require("linear_num_key_heads"), value_heads=hf.require("linear_num_value_heads"),
                    key_head_dim=hf.require("linear_key_head_dim"), value_head_dim=hf.require("linear_value_head_dim"),
                    conv_kernel=hf.get("linear_conv_kernel_dim", 4))
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads", N),
        head_dim=hf.get("head_dim", D // N), num_layers=L, max_len=hf.get("max_position_embeddings", 32768),
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), norm_position="pre", final_norm=True,
        norm_scale_offset=1.0, position="rope", rope=rope(hf, 10_000.0, partial=True), activation="swiglu",
        attention_bias=bool(hf.get("attention_bias", False)), ffn_bias=False, qk_norm=True,
        attention_output_gate=True, attention_dropout=hf.get("attention_dropout", 0.0),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_id=hf.pad_id(vocab),
        mixer_pattern=None if mixers == ("attention",) else mixers, deltanet=deltanet, **moe)


def attention_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """HF's Qwen3NextAttention at `p` -> tfm Attention params; q_proj's rows are [N, 2 (query, gate), H]."""
    N, H, D, bias = cfg.num_heads, cfg.head_dim, cfg.d_model, cfg.attention_bias
    qg = w(f"{p}.q_proj.weight", (2 * N * H, D)).reshape(N, 2, H, D)
    qg_bias = w(f"{p}.q_proj.bias", (2 * N * H,)).reshape(N, 2, H) if bias else None
    q = (qg[:, 0].reshape(N * H, D), None if qg_bias is None else qg_bias[:, 0].reshape(N * H))
    kvo = [linear_pair(w, f"{p}.{n}_proj", bias) for n in ("k", "v", "o")]
    out = attention(q, *kvo, N, cfg.num_kv_heads, H)
    out["gate"] = {"kernel": qg[:, 1].transpose(2, 0, 1)}  # [D, N, H]
    if qg_bias is not None:
        out["gate"]["bias"] = qg_bias[:, 1]
    out["query_norm"], out["key_norm"] = norm(w, f"{p}.q_norm", "rmsnorm"), norm(w, f"{p}.k_norm", "rmsnorm")
    return out


def deltanet_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """HF's gated DeltaNet at `p` -> tfm GatedDeltaNet params: Qwen3-Next's fused projections (in_proj_qkvz,
    in_proj_ba, interleaved per key head) or Qwen3.5's separate ones (in_proj_qkv: q, k, v rows; in_proj_z,
    in_proj_b, in_proj_a)."""
    m, D = cfg.deltanet, cfg.d_model
    Nk, Hk, Nv, Hv = m.key_heads, m.key_head_dim, m.value_heads, m.value_head_dim
    heads = lambda part, n, h: {"kernel": part.reshape(n, h, D).transpose(2, 0, 1)}  # [D, n, h]
    if w.has(f"{p}.in_proj_qkv.weight"):
        qkv = w(f"{p}.in_proj_qkv.weight", (2 * Nk * Hk + Nv * Hv, D))
        q, k, v = qkv[:Nk * Hk], qkv[Nk * Hk:2 * Nk * Hk], qkv[2 * Nk * Hk:]
        z = w(f"{p}.in_proj_z.weight", (Nv * Hv, D))
        b, a = w(f"{p}.in_proj_b.weight", (Nv, D)), w(f"{p}.in_proj_a.weight", (Nv, D))
    else:
        r = Nv // Nk  # value heads per key head
        rows = 2 * Hk + 2 * r * Hv
        qkvz = w(f"{p}.in_proj_qkvz.weight", (Nk * rows, D)).reshape(Nk, rows, D)
        q, k, v, z = qkvz[:, :Hk], qkvz[:, Hk:2 * Hk], qkvz[:, 2 * Hk:2 * Hk + r * Hv], qkvz[:, 2 * Hk + r * Hv:]
        ba = w(f"{p}.in_proj_ba.weight", (2 * Nv, D)).reshape(Nk, 2 * r, D)
        b, a = ba[:, :r].reshape(Nv, D), ba[:, r:].reshape(Nv, D)
    conv = w(f"{p}.conv1d.weight", (2 * Nk * Hk + Nv * Hv, 1, m.conv_kernel))[:, 0].T  # [K, C]
    return {"query": heads(q, Nk, Hk), "key": heads(k, Nk, Hk), "value": heads(v, Nv, Hv), "gate": heads(z, Nv, Hv),
            "beta": {"kernel": b.T}, "alpha": {"kernel": a.T},
            "conv_q": {"kernel": conv[:, :Nk * Hk]}, "conv_k": {"kernel": conv[:, Nk * Hk:2 * Nk * Hk]},
            "conv_v": {"kernel": conv[:, 2 * Nk * Hk:]},
            "dt_bias": w(f"{p}.dt_bias", (Nv,)), "A_log": w(f"{p}.A_log", (Nv,)),
            "norm": {"weight": w(f"{p}.norm.weight", (Hv,))},
            "out": {"kernel": w(f"{p}.out_proj.weight", (D, Nv * Hv)).T.reshape(Nv, Hv, D)}}


def params(w: Weights, cfg: ModelConfig) -> dict:
    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        if cfg.layer_mixer(i) == "attention":
            out = {"attn_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"),
                   "self_attn": attention_params(w, f"{p}.self_attn", cfg)}
        else:
            out = {"mixer_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"),
                   "mixer": deltanet_params(w, f"{p}.linear_attn", cfg)}
        out["ffn_norm"] = norm(w, f"{p}.post_attention_layernorm", "rmsnorm")
        out["ffn"] = (qwen2_moe.moe_ffn(w, p, cfg) if cfg.layer_ffn(i) == "moe"
                      else llama.swiglu(w, f"{p}.mlp", bias=False))
        return out
    decoder = Stack(layer, cfg.num_layers, final_norm="model.norm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig, model_type: str = "qwen3_next") -> dict:
    """The inverse of `config` (export)."""
    L = cfg.num_layers
    names = {kind: name for name, kind in MIXERS.items()}
    kinds = [cfg.layer_mixer(i) for i in range(L)]
    if set(kinds) - set(names):
        raise ConversionError(f"mixer_pattern={cfg.mixer_pattern}: Qwen3-Next's layers are {sorted(names)}")
    if not (cfg.qk_norm and cfg.attention_output_gate and cfg.norm_scale_offset == 1.0 and cfg.position == "rope"):
        raise ConversionError("Qwen3-Next's attention normalises queries and keys, gates its output and rotates "
                              "(qk_norm, attention_output_gate, position='rope'); its norms scale by 1 + w "
                              "(norm_scale_offset=1)")
    moe = [cfg.layer_ffn(i, dense=i < cfg.dense_layers) == "moe" for i in range(L)]
    if cfg.num_experts and not cfg.shared_expert_d_ff:
        raise ConversionError(f"num_experts={cfg.num_experts} with shared_expert_d_ff=0: Qwen3-Next's MoE has a "
                              "shared expert")
    rope_fields = hf_rope(cfg)
    rope_fields["rope_parameters"]["partial_rotary_factor"] = cfg.rope.dim / cfg.head_dim
    m = cfg.deltanet
    return dict(
        model_type=model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=L,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=(cfg.dense_d_ff or cfg.d_ff), max_position_embeddings=cfg.max_len,
        rms_norm_eps=cfg.norm_eps, hidden_act="silu", attention_bias=cfg.attention_bias,
        attention_dropout=cfg.attention_dropout, tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id,
        layer_types=[names[k] for k in kinds], linear_num_key_heads=m.key_heads, linear_num_value_heads=m.value_heads,
        linear_key_head_dim=m.key_head_dim, linear_value_head_dim=m.value_head_dim, linear_conv_kernel_dim=m.conv_kernel,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.d_ff,
        shared_expert_intermediate_size=cfg.shared_expert_d_ff, norm_topk_prob=cfg.router_norm_topk,
        router_aux_loss_coef=cfg.router_aux_loss_coef, decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(L) if not moe[i]] if cfg.num_experts else [], **rope_fields)


def qwen3_5_hf_config(cfg: ModelConfig) -> dict:
    """Qwen3.5 (dense): Qwen3-Next's fields without its experts'."""
    if cfg.num_experts:
        raise ConversionError("Qwen3_5ForCausalLM is dense: Qwen3_5MoeForCausalLM has the experts")
    out = hf_config(cfg, "qwen3_5_text")
    for name in QWEN3_NEXT_MOE_FIELDS + ("shared_expert_intermediate_size", "num_experts", "num_experts_per_tok",
                                         "moe_intermediate_size", "router_aux_loss_coef"):
        del out[name]
    return out


def qwen3_5_moe_hf_config(cfg: ModelConfig) -> dict:
    """Qwen3.5 MoE: experts on every layer, renormalised top-k gates; no dense width."""
    if not cfg.num_experts or cfg.ffn_pattern is not None or not cfg.router_norm_topk:
        raise ConversionError("Qwen3.5-MoE puts experts on every layer and renormalises its top-k gates")
    out = hf_config(cfg, "qwen3_5_moe_text")
    for name in QWEN3_NEXT_MOE_FIELDS + ("intermediate_size",):
        del out[name]
    return out


QWEN3_NEXT_MOE_FIELDS = ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")  # Qwen3.5's configs have none
IGNORE = llama.IGNORE + ("mtp.*",)
ARCHITECTURES = {
    "Qwen3NextForCausalLM": Converter(DecoderLM, config, params, ignore=IGNORE, hf_config=hf_config, export_rank=1),
    "Qwen3_5ForCausalLM": Converter(DecoderLM, config, params, ignore=IGNORE, hf_config=qwen3_5_hf_config,
                                    export_rank=1),
    "Qwen3_5MoeForCausalLM": Converter(DecoderLM, config, params, ignore=IGNORE, hf_config=qwen3_5_moe_hf_config,
                                       export_rank=1),
}
