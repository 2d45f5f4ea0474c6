"""RecurrentGemma (RecurrentGemmaForCausalLM; Griffin, De et al. 2024) -> tfm DecoderLM.

Layers follow HF's block_types ("recurrent" -> an "rglru" mixer, "attention" -> local attention over
attention_window_size keys): mixer_pattern is block_types when it divides the layers, else spelt out layer
by layer (the 2B checkpoint's 26 layers over a period of 3). Pre-norm zero-centred RMSNorms (1 + w),
embeddings times sqrt(D) rounded to bfloat16 (HF keeps that constant in bfloat16), MQA/GQA with RoPE on
the first partial_rotary_factor of each head and a bias on the output projection only, a GeGLU
feed-forward of intermediate_size / 2 with biases, logits soft-capped at logits_soft_cap, tied output.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, attention, hf_rope, linear,
                                linear_pair, model_params, norm, rope)
from tfm.models import DecoderLM

KINDS = {"recurrent": "rglru", "attention": "attention"}  # HF block_types -> tfm mixer_pattern


def config(hf: HFConfig) -> ModelConfig:
    D, N = hf.require("hidden_size"), hf.require("num_attention_heads")
    vocab, L = hf.require("vocab_size"), hf.require("num_hidden_layers")
    blocks = list(hf.get("block_types", ("recurrent", "recurrent", "attention")))
    if not blocks or set(blocks) - set(KINDS):
        raise hf.unsupported("block_types", blocks, f"tfm maps {sorted(KINDS)}")
    pattern = tuple(KINDS[b] for b in blocks)
    if L % len(pattern):
        pattern = tuple((pattern * L)[:L])
    if hf.activation("hidden_activation", "gelu_pytorch_tanh", gated=True) != "geglu":
        raise hf.unsupported("hidden_activation", hf.get("hidden_activation"),
                             "tfm's recurrent block gates with tanh GeLU (gelu_pytorch_tanh)")
    params = hf.get("rope_parameters") or {}
    if "partial_rotary_factor" not in params and hf.get("partial_rotary_factor") is None:
        hf = hf.with_fields(partial_rotary_factor=0.5)  # HF's default
    rotary = rope(hf, 10_000.0, partial=True)
    if rotary.scaling is not None:
        raise hf.unsupported("rope_parameters.rope_type", rotary.scaling, "RecurrentGemma rotates by 'default' only")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads", N), head_dim=D // N,
        num_layers=L, d_ff=hf.require("intermediate_size") // 2, norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_scale_offset=1.0, norm_position="pre", final_norm=True, position="rope", rope=rotary,
        activation="geglu", ffn_bias=True, attention_bias=bool(hf.get("attention_bias", False)),
        attention_out_bias=True, attention_dropout=hf.get("attention_dropout", 0.0),
        sliding_window=hf.require("attention_window_size"), mixer_pattern=pattern,
        rglru=dict(width=None if hf.get("lru_width", D) == D else hf.get("lru_width"),
                   conv_kernel=hf.get("conv1d_width", 4)),
        scale_embeddings=True, embedding_scale_rounding="bfloat16",
        final_logit_softcap=float(hf.require("logits_soft_cap")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), pad_id=hf.pad_id(vocab))


def mixer_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """HF's RecurrentGemmaRecurrentBlock at prefix `p` -> tfm's RecurrentBlock params."""
    D, N, K = cfg.d_model, cfg.num_heads, cfg.rglru.conv_kernel
    W = cfg.rglru.width or D
    P = W // N

    def proj(name):
        return {"kernel": w(f"{p}.{name}.weight", (W, D)).T.reshape(D, N, P),
                "bias": w(f"{p}.{name}.bias", (W,)).reshape(N, P)}

    def gate(name):
        return {"kernel": w(f"{p}.rg_lru.{name}_weight", (N, P, P)), "bias": w(f"{p}.rg_lru.{name}_bias", (N, P))}

    return {"gate": proj("linear_y"), "x": proj("linear_x"),
            "conv": {"kernel": w(f"{p}.conv_1d.weight", (W, 1, K))[:, 0].T, "bias": w(f"{p}.conv_1d.bias", (W,))},
            "input_gate": gate("input_gate"), "a_gate": gate("recurrent_gate"),
            "a_param": w(f"{p}.rg_lru.recurrent_param", (W,)).reshape(N, P),
            "out": {"kernel": w(f"{p}.linear_out.weight", (D, W)).T.reshape(N, P, D),
                    "bias": w(f"{p}.linear_out.bias", (D,))}}


def layer(w: Weights, i: int, cfg: ModelConfig) -> dict:
    p = f"model.layers.{i}"
    t = f"{p}.temporal_block"
    mlp = f"{p}.mlp_block"
    out = {"ffn_norm": norm(w, f"{p}.channel_pre_norm", "rmsnorm"),
           "ffn": {"wi_gate": linear(w, f"{mlp}.gate_proj"), "wi_up": linear(w, f"{mlp}.up_proj"),
                   "wo": linear(w, f"{mlp}.down_proj")}}
    if cfg.layer_mixer(i) == "attention":
        qkvo = [linear_pair(w, f"{t}.{n}_proj", cfg.attention_bias) for n in ("q", "k", "v")]
        qkvo.append(linear_pair(w, f"{t}.o_proj", True))
        out.update(attn_norm=norm(w, f"{p}.temporal_pre_norm", "rmsnorm"),
                   self_attn=attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
    else:
        out.update(mixer_norm=norm(w, f"{p}.temporal_pre_norm", "rmsnorm"), mixer=mixer_params(w, t, cfg))
    return out


def params(w: Weights, cfg: ModelConfig) -> dict:
    decoder = Stack(lambda i: layer(w, i, cfg), cfg.num_layers, final_norm="model.final_norm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export); what HF cannot express fails the round trip."""
    pattern = cfg.mixer_pattern or ("attention",)
    if set(pattern) - set(KINDS.values()) or cfg.activation != "geglu" or cfg.position != "rope":
        raise ConversionError(f"RecurrentGemmaForCausalLM has rglru and attention layers (mixer_pattern={pattern}) "
                              f"with a geglu feed-forward (activation={cfg.activation!r}) and RoPE")
    blocks = [b for kind in pattern for b, k in KINDS.items() if k == kind]
    rotary = hf_rope(cfg)
    rotary["rope_parameters"]["partial_rotary_factor"] = cfg.rope.dim / cfg.head_dim
    return dict(model_type="recurrent_gemma", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                intermediate_size=2 * cfg.d_ff, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, lru_width=cfg.rglru.width or cfg.d_model,
                attention_window_size=cfg.sliding_window, conv1d_width=cfg.rglru.conv_kernel,
                logits_soft_cap=cfg.final_logit_softcap, rms_norm_eps=cfg.norm_eps,
                hidden_activation="gelu_pytorch_tanh", block_types=blocks, attention_bias=cfg.attention_bias,
                attention_dropout=cfg.attention_dropout, tie_word_embeddings=cfg.tie_embeddings,
                pad_token_id=cfg.pad_id, **rotary)


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("final_w_init_variance_scale", "w_init_variance_scale")
ARCHITECTURES = {"RecurrentGemmaForCausalLM": Converter(DecoderLM, config, params, ignore=("*rotary_emb.inv_freq",),
                                                        hf_config=hf_config, inert=INERT, export_rank=1)}
