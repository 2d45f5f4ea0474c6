"""Zamba2 (Zamba2ForCausalLM) -> tfm DecoderLM of Mamba-2 layers, some of them fed by Zamba's shared transformer:
mixer_pattern "mamba2" (HF "linear_attention"/"mamba") or "shared>mamba2" (HF "hybrid"), no feed-forward.

A hybrid layer i computes x + mamba(norm(x + linear_i(shared(concat[x, embeddings])))): the shared transformer
(ModelConfig.shared_block, tfm.layers.shared) is attention over the 2D-wide input (head_dim 2D / N, logits scaled
by (head_dim / 2)^-1/2, RoPE with use_mem_rope) out to D, then a GeGLU MLP, no residuals; num_mem_blocks of them
used in turn by the hybrid layers, each use with its own LoRA adapters (q, k, v with use_shared_attention_adapter;
the fused gate/up with use_shared_mlp_adapter) and its own linear. The checkpoint stores a block at the first
layer that uses it (`model.layers.{i}.shared_transformer`, adapters of all its uses there); transformers' in-memory
model repeats it, tied, at every use (checked equal). Mamba-2's gated RMSNorm has eps 1e-5 in HF whatever
rms_norm_eps says, and its step size is clamped below at time_step_min.
"""
from __future__ import annotations

import numpy as np

from tfm.config import ModelConfig
from tfm.convert import bamba, mamba2
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, dense, hf_activation, hf_rope,
                                linear, model_params, norm, period, rope, self_attention)
from tfm.models import DecoderLM

KINDS = {"linear_attention": "mamba2", "mamba": "mamba2", "hybrid": "shared>mamba2"}  # HF layers_block_type
MIXER_FIELDS = dict(mamba2.MIXER_FIELDS, state_size="mamba_d_state", conv_kernel="mamba_d_conv", expand="mamba_expand",
                    head_dim="mamba_headdim", num_heads="n_mamba_heads", groups="mamba_ngroups",
                    conv_bias="use_conv_bias", proj_bias="add_bias_linear", dt_limit=None, activation=None)
MAMBA_NORM_EPS = 1e-5  # Zamba2MambaMixer's gated norm, fixed
# Zamba2Config's defaults for the fields a checkpoint's config.json may leave out
DEFAULTS = dict(max_position_embeddings=4096, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
                n_mamba_heads=8, use_conv_bias=True, add_bias_linear=False, hidden_act="gelu", num_mem_blocks=1,
                use_shared_mlp_adapter=False, use_shared_attention_adapter=False, adapter_rank=128, use_mem_rope=False,
                rms_norm_eps=1e-5, time_step_min=0.001, use_long_context=False, tie_word_embeddings=True)


def _pattern(kinds: list, blocks: int) -> tuple:
    """The per-layer kinds' shortest repeating prefix (`period`), repeated until the blocks divide its shared uses
    (a scan repeats it, so each repeat must start at block 0) and it still tiles the layers."""
    prefix = period(kinds)
    for reps in range(1, len(kinds) // len(prefix) + 1):
        pattern = prefix * reps
        if len(kinds) % len(pattern) == 0 and sum(k.startswith("shared") for k in pattern) % blocks == 0:
            return pattern
    return tuple(kinds)


def config(hf: HFConfig) -> ModelConfig:
    hf = bamba.with_defaults(hf, DEFAULTS)
    D, N, L = hf.require("hidden_size"), hf.require("num_attention_heads"), hf.require("num_hidden_layers")
    types = hf.require("layers_block_type")
    if len(types) != L or set(types) - set(KINDS):
        raise hf.unsupported("layers_block_type", types, f"tfm maps {sorted(KINDS)}, one per layer")
    if hf.get("rms_norm_eps") != MAMBA_NORM_EPS:
        raise hf.unsupported("rms_norm_eps", hf.get("rms_norm_eps"), f"Zamba2's Mamba-2 norms use {MAMBA_NORM_EPS} "
                                                                     f"whatever it says; tfm's use rms_norm_eps")
    head_dim = 2 * D // N  # HF derives it (attention_head_dim) whatever config.json says
    adapters = [n for n, on in ((("query", "key", "value"), hf.get("use_shared_attention_adapter")),
                                (("ffn",), hf.get("use_shared_mlp_adapter"))) if on for n in n]
    blocks = hf.get("num_mem_blocks")
    shared = dict(blocks=blocks, lora_rank=hf.get("adapter_rank") if adapters else 0, lora=tuple(adapters) or
                  ("query", "key", "value", "ffn"))
    if not adapters:
        hf.has("adapter_rank")  # sizes no adapter
    use_rope = bool(hf.get("use_mem_rope"))
    long_context = bool(hf.get("use_long_context"))  # HF's only change: 16384 positions
    vocab = hf.require("vocab_size")
    m = dict(mamba2.mixer_config(hf, MIXER_FIELDS), dt_limit=(float(hf.get("time_step_min")), float("inf")))
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads") or N, head_dim=head_dim,
        num_layers=L, d_ff=hf.get("intermediate_size") or 4 * D,
        max_len=16384 if long_context else hf.get("max_position_embeddings"), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps"), norm_position="pre", final_norm=True,
        position="rope" if use_rope else "none", rope=rope(hf, 10_000.0), attention_scale=(head_dim / 2) ** -0.5,
        activation=hf.activation("hidden_act", "gelu", gated=True), attention_bias=False,
        ffn_bias=bool(hf.get("add_bias_linear")), tie_embeddings=bool(hf.get("tie_word_embeddings")),
        pad_id=hf.pad_id(vocab), attention_dropout=hf.get("attention_dropout", 0.0),
        mixer_pattern=_pattern([KINDS[t] for t in types], blocks), ffn_pattern=("none",), mamba2=m,
        shared_block=shared)


def _uses(cfg: ModelConfig) -> list:
    """The layers that use a shared block, in order (use u runs block u % blocks)."""
    return [i for i in range(cfg.num_layers) if cfg.layer_feed(i) == "shared"]


def _block_prefix(cfg: ModelConfig, use: int) -> str:
    """Where the checkpoint stores use `use`'s block: at the first layer that uses it."""
    return f"model.layers.{_uses(cfg)[use % cfg.shared_block.blocks]}.shared_transformer"


def shared_block(w: Weights, s: str, cfg: ModelConfig) -> dict:
    """The shared transformer at prefix `s` -> a tfm SharedBlock's params."""
    bias = cfg.ffn_bias
    gate, up = np.split(w(f"{s}.feed_forward.gate_up_proj.weight", (2 * cfg.d_ff, cfg.d_model)), 2)
    gate_bias, up_bias = np.split(w(f"{s}.feed_forward.gate_up_proj.bias"), 2) if bias else (None, None)
    return {"attn_norm": norm(w, f"{s}.input_layernorm", "rmsnorm"), "self_attn": self_attention(w, f"{s}.self_attn", cfg),
            "ffn_norm": norm(w, f"{s}.pre_ff_layernorm", "rmsnorm"),
            "ffn": {"wi_gate": dense(gate, gate_bias), "wi_up": dense(up, up_bias),
                    "wo": linear(w, f"{s}.feed_forward.down_proj", bias)}}


def _use(w: Weights, p: str, cfg: ModelConfig, use: int) -> dict:
    """Use `use`'s own params (its linear, its adapters) of the hybrid layer at prefix `p`; the block repeated at
    that layer (transformers' in-memory layout) must equal the stored one."""
    s = _block_prefix(cfg, use)
    here = f"{p}.shared_transformer"
    if here != s:
        for key in [k for k in w.tensors if k.startswith(here + ".")]:
            w.tied(key, w(s + key[len(here):]), "num_mem_blocks (the shared blocks' tying)")
    out = {"out": {"kernel": w(f"{p}.linear.weight", (cfg.d_model, cfg.d_model)).T}}
    sb, N, H = cfg.shared_block, cfg.num_heads, cfg.head_dim
    adapters = {"query": (f"{s}.self_attn.linear_q_adapter_list.{use}", ("query",)),
                "key": (f"{s}.self_attn.linear_k_adapter_list.{use}", ("key",)),
                "value": (f"{s}.self_attn.linear_v_adapter_list.{use}", ("value",)),
                "ffn": (f"{s}.feed_forward.gate_up_proj_adapter_list.{use}", ("wi_gate", "wi_up"))}
    for name in sb.lora if sb.lora_rank else ():
        q, outs = adapters[name]
        out[f"lora_{name}_a"] = w(f"{q}.0.weight").T  # [in, r]
        b = w(f"{q}.1.weight").T  # [r, out]
        for proj, part in zip(outs, np.split(b, len(outs), axis=1)):
            out[f"lora_{proj}_b"] = part.reshape(sb.lora_rank, N, H) if name != "ffn" else part
    return out


def params(w: Weights, cfg: ModelConfig) -> dict:
    uses = _uses(cfg)

    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        if i not in uses:
            return {"mixer_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"),
                    "mixer": mamba2.mixer_params(w, f"{p}.mamba", cfg)}
        return {"mixer_norm": norm(w, f"{p}.mamba_decoder.input_layernorm", "rmsnorm"),
                "mixer": mamba2.mixer_params(w, f"{p}.mamba_decoder.mamba", cfg), "shared": _use(w, p, cfg, uses.index(i))}

    blocks = {f"shared_block_{b}": shared_block(w, _block_prefix(cfg, b), cfg) for b in range(cfg.shared_block.blocks)}
    decoder = Stack(layer, cfg.num_layers, final_norm="model.final_layernorm", extra=blocks)
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    names = {"mamba2": "linear_attention", "shared>mamba2": "hybrid"}
    kinds = [cfg.layer_mixer(i) for i in range(cfg.num_layers)]
    sb = cfg.shared_block
    if set(kinds) - set(names) or cfg.ffn_pattern != ("none",) or not sb.embeddings or sb.d_ff:
        raise ConversionError(f"Zamba2ForCausalLM's layers are {sorted(names)} without a feed-forward, the shared "
                              f"block reading the embeddings at ModelConfig.d_ff; mixer_pattern={cfg.mixer_pattern}")
    out = dict(model_type="zamba2", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
               num_hidden_layers=cfg.num_layers, layers_block_type=[names[k] for k in kinds],
               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, intermediate_size=cfg.d_ff,
               hidden_act=hf_activation(cfg.activation, gated=True), max_position_embeddings=cfg.max_len,
               rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
               pad_token_id=cfg.pad_id, attention_dropout=cfg.attention_dropout, num_mem_blocks=sb.blocks,
               use_shared_attention_adapter=bool(sb.lora_rank) and "query" in sb.lora,
               use_shared_mlp_adapter=bool(sb.lora_rank) and "ffn" in sb.lora, adapter_rank=sb.lora_rank or 128,
               use_mem_rope=cfg.position == "rope", time_step_min=cfg.mamba2.dt_limit[0],
               **mamba2.mixer_hf_config(cfg, MIXER_FIELDS))
    out.update(hf_rope(cfg))
    return out


# HF config fields that change nothing tfm computes (initialisation, kernels, caching) and those HF derives
# from the others whatever config.json says
INERT = ("chunk_size", "num_logits_to_keep", "time_step_max", "time_step_floor", "time_step_limit",
         "use_mamba_kernels", "use_mem_eff_path", "attention_hidden_size", "attention_head_dim", "kv_channels",
         "num_query_groups", "hybrid_layer_ids", "head_dim")
ARCHITECTURES = {"Zamba2ForCausalLM": Converter(DecoderLM, config, params, ignore=("*rotary_emb.inv_freq",),
                                                hf_config=hf_config, inert=INERT, export_rank=1)}
