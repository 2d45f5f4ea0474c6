"""Kimi Linear (KimiLinearForCausalLM) -> tfm DecoderLM: Kimi Delta Attention layers ("kda", HF layer_types
"linear_attention") beside multi-head latent attention without positions ("full_attention": DeepSeek-V3's MLA
with its RoPE part unrotated, position="none"), DeepSeek-V3's feed-forward (the first layers dense, then
sigmoid-routed experts with balancing biases, grouped choice, renormalised and scaled gates, shared experts).

HF's KDA layer projects q, k and v apart and convolves them as one conv1d (channels q, k, v), holds the decay's
rank-head_dim projections in `forget_gate` (f_a_proj, f_b_proj; dt_bias [N * H], A_log [1, 1, N, 1]) and the
output gate's as g_a_proj, g_b_proj. A checkpoint's config.json may give the KDA layers' fields and the layer
kinds in `linear_attn_config` (1-indexed full_attn_layers and kda_layers) and the dense layers as
first_k_dense_replace, as KimiLinearConfig reads them.
"""
from __future__ import annotations

from tfm.config import KdaConfig, MlaConfig, ModelConfig
from tfm.convert import bamba, deepseek_v3, llama
from tfm.convert.common import ConversionError, Converter, HFConfig, Stack, Weights, dense, model_params, norm, period
from tfm.models import DecoderLM

KINDS = {"full_attention": "attention", "linear_attention": "kda"}  # HF layer_types -> mixer_pattern
DEFAULTS = dict(hidden_act="silu", rms_norm_eps=1e-5, model_max_length=1048576, num_shared_experts=1,
                routed_scaling_factor=2.446, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
                qk_nope_head_dim=128, num_expert_group=1, topk_group=1, num_experts_per_token=8, moe_renormalize=True,
                num_experts=256, linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4)
# KimiLinearConfig's attribute_map: the names a checkpoint may use -> the names it saves
RENAMED = dict(max_position_embeddings="model_max_length", norm_topk_prob="moe_renormalize",
               n_group="num_expert_group", num_local_experts="num_experts", num_experts_per_tok="num_experts_per_token",
               n_shared_experts="num_shared_experts")


def _layers(hf: HFConfig, L: int) -> tuple:
    """(mixer kinds, dense layer count) from layer_types / mlp_layer_types or their config.json forms."""
    linear = hf.get("linear_attn_config") or {}
    types = hf.get("layer_types")
    if types is None and {"full_attn_layers", "kda_layers"} <= set(linear):
        types = [None] * L
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in linear[key]:
                types[layer - 1] = kind
    types = types or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
    if len(types) != L or set(types) - set(KINDS):
        raise hf.unsupported("layer_types", types, f"tfm maps {sorted(KINDS)}, one per layer")
    ffns = hf.get("mlp_layer_types") or ["dense" if i < hf.get("first_k_dense_replace", 1) else "sparse"
                                         for i in range(L)]
    dense_layers = ffns.count("dense")
    if ffns != ["dense"] * dense_layers + ["sparse"] * (L - dense_layers):
        raise hf.unsupported("mlp_layer_types", ffns, "tfm takes dense layers first, then the experts'")
    return [KINDS[t] for t in types], dense_layers


def config(hf: HFConfig) -> ModelConfig:
    hf = bamba.with_defaults(hf, DEFAULTS, RENAMED)
    D, N, L = hf.require("hidden_size"), hf.require("num_attention_heads"), hf.require("num_hidden_layers")
    hf.expect("hidden_act", ["silu"])
    hf.expect("num_key_value_heads", [N], N)  # HF repeats the keys num_heads // num_key_value_heads times
    kinds, dense_layers = _layers(hf, L)
    linear = hf.get("linear_attn_config") or {}
    kda = dict(heads=linear.get("num_heads", hf.get("linear_num_heads")),
               head_dim=linear.get("head_dim", hf.get("linear_head_dim")),
               conv_kernel=linear.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim")))
    nope, rope_dim = hf.require("qk_nope_head_dim"), hf.require("qk_rope_head_dim")
    moe = {}
    if dense_layers < L:
        F = hf.require("moe_intermediate_size")
        moe = dict(num_experts=hf.get("num_experts"), experts_per_token=hf.get("num_experts_per_token"), d_ff=F,
                   dense_layers=dense_layers, dense_d_ff=hf.require("intermediate_size"), router_score="sigmoid",
                   router_groups=hf.get("num_expert_group"), router_group_top=hf.get("topk_group"), router_bias=True,
                   router_scale=float(hf.get("routed_scaling_factor")), router_norm_topk=bool(hf.get("moe_renormalize")),
                   shared_expert_d_ff=F * hf.get("num_shared_experts"), shared_expert_gate=False,
                   router_aux_loss_coef=0.0)
    else:
        for name in ("moe_intermediate_size", "num_experts", "num_experts_per_token", "num_expert_group", "topk_group",
                     "routed_scaling_factor", "moe_renormalize", "num_shared_experts"):
            hf.has(name)  # the experts' fields say nothing without experts
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=N, head_dim=nope + rope_dim, num_layers=L,
        d_ff=moe.get("d_ff", hf.get("intermediate_size")), max_len=hf.get("model_max_length"), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps"), norm_position="pre", final_norm=True, position="none", activation="swiglu",
        attention_bias=bool(hf.get("attention_bias", False)), ffn_bias=False,
        attention_dropout=hf.get("attention_dropout", 0.0), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        pad_id=hf.pad_id(vocab), mixer_pattern=None if set(kinds) == {"attention"} else period(kinds),
        mla=MlaConfig(kv_rank=hf.require("kv_lora_rank"), rope_dim=rope_dim, q_rank=hf.get("q_lora_rank"),
                      value_dim=hf.get("v_head_dim") or nope + rope_dim, latent_norm_eps=deepseek_v3.LATENT_NORM_EPS),
        kda=kda if "kda" in kinds else None, **{k: v for k, v in moe.items() if k != "d_ff"})


def kda_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """HF's KimiLinearDeltaAttention at `p` -> tfm KimiDeltaAttention params: transformers' in-memory layout
    (one conv1d over q, k, v; the decay's tensors in `forget_gate`) or the checkpoint's (q_conv1d, k_conv1d,
    v_conv1d; the decay's beside the others)."""
    m, D = cfg.kda, cfg.d_model
    N, H, C = m.heads, m.head_dim, m.heads * m.head_dim
    heads = lambda key, rows: {"kernel": w(key, (C, rows)).reshape(N, H, rows).transpose(2, 0, 1)}  # [rows, N, H]
    if w.has(f"{p}.conv1d.weight"):
        qkv = w(f"{p}.conv1d.weight", (3 * C, 1, m.conv_kernel))[:, 0].T  # [K, 3 C]: q, k, v
        convs = [qkv[:, i * C:(i + 1) * C] for i in range(3)]
    else:
        convs = [w(f"{p}.{n}_conv1d.weight", (C, 1, m.conv_kernel))[:, 0].T for n in "qkv"]
    f = f"{p}.forget_gate" if w.has(f"{p}.forget_gate.A_log") else p
    return {"query": heads(f"{p}.q_proj.weight", D), "key": heads(f"{p}.k_proj.weight", D),
            "value": heads(f"{p}.v_proj.weight", D), **{f"conv_{n}": {"kernel": c} for n, c in zip("qkv", convs)},
            "decay_down": dense(w(f"{f}.f_a_proj.weight", (H, D))), "decay_up": heads(f"{f}.f_b_proj.weight", H),
            "dt_bias": w(f"{f}.dt_bias", (C,)).reshape(N, H), "A_log": w(f"{f}.A_log", (1, 1, N, 1)).reshape(N),
            "beta": dense(w(f"{p}.b_proj.weight", (N, D))),
            "gate_down": dense(w(f"{p}.g_a_proj.weight", (H, D))), "gate_up": heads(f"{p}.g_b_proj.weight", H),
            "norm": {"weight": w(f"{p}.o_norm.weight", (H,))},
            "out": {"kernel": w(f"{p}.o_proj.weight", (D, C)).T.reshape(N, H, D)}}


def ffn(w: Weights, p: str, cfg: ModelConfig, dense_layer: bool) -> dict:
    """DeepSeek-V3's feed-forward at `{p}.mlp` (in memory) or `{p}.block_sparse_moe` (the checkpoint's, its
    experts' w1, w3, w2 apart; dense layers there too)."""
    if w.has(f"{p}.block_sparse_moe.gate.weight") or w.has(f"{p}.block_sparse_moe.gate_proj.weight"):
        return deepseek_v3.ffn(w, p, cfg, dense_layer, block="block_sparse_moe", hub_names=("w1", "w3", "w2"))
    return deepseek_v3.ffn(w, p, cfg, dense_layer)


def params(w: Weights, cfg: ModelConfig) -> dict:
    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        if cfg.layer_mixer(i) == "attention":
            out = {"attn_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"),
                   "self_attn": deepseek_v3.attention(w, p, cfg)}
        else:
            out = {"mixer_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"),
                   "mixer": kda_params(w, f"{p}.self_attn", cfg)}
        return dict(out, ffn_norm=norm(w, f"{p}.post_attention_layernorm", "rmsnorm"),
                    ffn=ffn(w, p, cfg, dense_layer=not cfg.num_experts or i < cfg.dense_layers))
    decoder = Stack(layer, cfg.num_layers, final_norm="model.norm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    names = {kind: name for name, kind in KINDS.items()}
    kinds = [cfg.layer_mixer(i) for i in range(cfg.num_layers)]
    if set(kinds) - set(names) or cfg.mla is None or cfg.position != "none":
        raise ConversionError(f"KimiLinearForCausalLM's layers are {sorted(names)}, its attention multi-head latent "
                              "attention without positions (mla, position='none')")
    out = deepseek_v3.hf_config(cfg.replace(position="rope"))
    for name in ("rope_parameters", "rope_scaling", "rope_theta", "rope_interleave", "max_position_embeddings",
                 "n_routed_experts", "n_group", "num_experts_per_tok", "norm_topk_prob", "n_shared_experts",
                 "first_k_dense_replace"):
        out.pop(name, None)
    kda = cfg.kda or KdaConfig()
    L, dense_layers = cfg.num_layers, cfg.dense_layers if cfg.num_experts else cfg.num_layers
    out.update(model_type="kimi_linear", model_max_length=cfg.max_len, layer_types=[names[k] for k in kinds],
               mlp_layer_types=["dense" if i < dense_layers else "sparse" for i in range(L)],
               linear_num_heads=kda.heads, linear_head_dim=kda.head_dim, linear_conv_kernel_dim=kda.conv_kernel)
    if cfg.num_experts:
        out.update(num_experts=cfg.num_experts, num_experts_per_token=cfg.experts_per_token,
                   num_expert_group=cfg.router_groups, moe_renormalize=cfg.router_norm_topk,
                   num_shared_experts=cfg.shared_expert_d_ff // cfg.d_ff)
    return out


INERT = ("qk_head_dim", "head_dim")  # KimiLinearConfig derives them from the MLA head dims
ARCHITECTURES = {"KimiLinearForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config,
                                                    inert=INERT, export_rank=1)}
