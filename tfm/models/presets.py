"""Named configurations: the published sizes and tiny CPU variants of each family."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

from tfm.config import LEGACY_ROPE_FIELDS, ExecutionConfig, ModelConfig, check_overrides


def transformer_base(vocab_size: int = 37_000, **overrides) -> ModelConfig:
    """Vaswani et al. 2017 base: 6+6 layers, D 512, F 2048, 8 heads, post-norm, sinusoidal
    positions, one shared source/target/output matrix scaled by sqrt(D), dropout 0.1."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=512, num_heads=8, num_layers=6, d_ff=2048,
                      max_len=256, norm="layernorm", norm_eps=1e-6, norm_position="post", final_norm=False,
                      position="sinusoidal", activation="relu", scale_embeddings=True, tie_embeddings=True,
                      share_source_target_embeddings=True, dropout_rate=0.1, attention_dropout=0.0)
    return cfg.replace(**overrides)


def transformer_big(vocab_size: int = 37_000, **overrides) -> ModelConfig:
    """Vaswani et al. 2017 big: D 1024, F 4096, 16 heads, dropout 0.3 (0.1 for En-Fr)."""
    return transformer_base(vocab_size, d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3).replace(**overrides)


def bert_base(vocab_size: int = 30_522, **overrides) -> ModelConfig:
    """Devlin et al. 2018 BERT-base: 12 layers, D 768, 12 heads, F 3072, post-norm, GELU."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=768, num_heads=12, num_layers=12, d_ff=3072, max_len=512,
                      norm="layernorm", norm_eps=1e-12, norm_position="post", final_norm=False,
                      embedding_norm=True, position="learned", activation="gelu", type_vocab_size=2,
                      tie_embeddings=True, output_bias=True, heads=("mlm", "nsp"), dropout_rate=0.1,
                      attention_dropout=0.1)
    return cfg.replace(**overrides)


def bert_large(vocab_size: int = 30_522, **overrides) -> ModelConfig:
    return bert_base(vocab_size, d_model=1024, num_heads=16, num_layers=24, d_ff=4096).replace(**overrides)


def gpt2_small(vocab_size: int = 50_257, **overrides) -> ModelConfig:
    """Radford et al. 2019 GPT-2 124M: 12 layers, D 768, pre-norm, learned positions (1024), tied."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=768, num_heads=12, num_layers=12, d_ff=3072, max_len=1024,
                      norm="layernorm", norm_eps=1e-5, norm_position="pre", final_norm=True, position="learned",
                      activation="gelu_tanh", tie_embeddings=True, dropout_rate=0.1)
    return cfg.replace(**overrides)


def gpt2_medium(vocab_size: int = 50_257, **overrides) -> ModelConfig:
    return gpt2_small(vocab_size, d_model=1024, num_heads=16, num_layers=24, d_ff=4096).replace(**overrides)


def llama(vocab_size: int = 32_000, d_model: int = 4096, num_layers: int = 32, num_heads: int = 32,
          num_kv_heads: int = 8, d_ff: int = 14_336, head_dim: Optional[int] = None, **overrides) -> ModelConfig:
    """Llama-style: RMSNorm pre-norm, RoPE, SwiGLU, no biases, untied output, GQA."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim,
                      num_layers=num_layers, d_ff=d_ff, max_len=8192, norm="rmsnorm", norm_eps=1e-5,
                      norm_position="pre", final_norm=True, position="rope", rope=dict(theta=500_000.0),
                      activation="swiglu", attention_bias=False, ffn_bias=False, tie_embeddings=False)
    return cfg.replace(**overrides)


def mixtral_8x7b(vocab_size: int = 32_000, **overrides) -> ModelConfig:
    """Mixtral 8x7B (Jiang et al. 2024): the Llama/Mistral shape with 8 SwiGLU experts, top-2, on
    every layer; 46.7B parameters, 12.9B active per token."""
    return llama(vocab_size, num_experts=8, experts_per_token=2, max_len=32_768, rope=dict(theta=1e6),
                 router_aux_loss_coef=0.02).replace(**overrides)


def deepseek_v3(vocab_size: int = 129_280, **overrides) -> ModelConfig:
    """DeepSeek-V3 (DeepSeek-AI 2024): 61 layers, D 7168, 128 heads of multi-head latent attention
    (query latent 1536, kv latent 512, heads 128 + 64 RoPE dims, values 128), YaRN x40 from 4k; the
    first 3 layers dense (F 18432), then DeepSeekMoE: 256 routed experts of F 2048, top-8 by sigmoid
    scores + balancing bias within the best 4 of 8 groups, gates x2.5, one shared expert.
    671B parameters, 37B active per token (the multi-token-prediction module is not included)."""
    factor, original = 40.0, 4096
    cfg = ModelConfig(vocab_size=vocab_size, d_model=7168, num_heads=128, num_layers=61, d_ff=2048,
                      head_dim=192, max_len=int(factor * original), norm="rmsnorm", norm_eps=1e-6,
                      norm_position="pre", final_norm=True, position="rope", activation="swiglu",
                      attention_bias=False, ffn_bias=False, tie_embeddings=False,
                      rope=dict(theta=10_000.0, scaling="yarn", factor=factor, original_max_len=original,
                                attention_factor=1.0, interleaved=True),
                      mla=dict(kv_rank=512, rope_dim=64, q_rank=1536, value_dim=128,
                               softmax_scale_factor=(0.1 * math.log(factor) + 1.0) ** 2),
                      num_experts=256, experts_per_token=8, dense_layers=3, dense_d_ff=18_432,
                      router_score="sigmoid", router_groups=8, router_group_top=4, router_bias=True,
                      router_scale=2.5, shared_expert_d_ff=2048, shared_expert_gate=False, router_aux_loss_coef=0.0)
    return cfg.replace(**overrides)


def deepseek_v3_2(vocab_size: int = 129_280, **overrides) -> ModelConfig:
    """DeepSeek-V3.2 (DeepSeek-AI 2025): DeepSeek-V3's shape with DeepSeek Sparse Attention in every layer: a
    lightning indexer of 64 heads of 128 (queries from the 1536-wide query latent) picks each query's 2048 keys.
    About 672B parameters, 0.85B of them the indexers'."""
    return deepseek_v3(vocab_size, indexer=dict(heads=64, head_dim=128, top_k=2048)).replace(**overrides)


def kimi_linear_48b_a3b(vocab_size: int = 163_840, **overrides) -> ModelConfig:
    """Kimi Linear 48B-A3B (Moonshot AI 2025) as transformers' KimiLinearConfig defaults give it: 27 layers of D 2304,
    Kimi Delta Attention (32 heads of 128, 4-tap convolutions) with MLA at layers 4, 8, ..., 24 (32 heads, kv latent
    512, heads 128 + 64 unrotated dims, values 128, no positions); the first layer dense (F 9216), then 256 experts
    of F 1024 top-8 by sigmoid scores and balancing bias, gates x2.446, one shared expert; 1M positions; untied.
    About 49.1B parameters. (A checkpoint's config.json lists its MLA layers in linear_attn_config.)"""
    kinds = tuple("attention" if i and i % 4 == 0 else "kda" for i in range(27))
    cfg = ModelConfig(vocab_size=vocab_size, d_model=2304, num_heads=32, num_kv_heads=32, head_dim=192, num_layers=27,
                      d_ff=1024, max_len=1_048_576, norm="rmsnorm", norm_eps=1e-5, norm_position="pre",
                      final_norm=True, position="none", activation="swiglu", attention_bias=False, ffn_bias=False,
                      tie_embeddings=False, mixer_pattern=kinds, kda=dict(heads=32, head_dim=128, conv_kernel=4),
                      mla=dict(kv_rank=512, rope_dim=64, q_rank=None, value_dim=128, latent_norm_eps=1e-6),
                      num_experts=256, experts_per_token=8, dense_layers=1, dense_d_ff=9216, router_score="sigmoid",
                      router_groups=1, router_group_top=1, router_bias=True, router_scale=2.446,
                      shared_expert_d_ff=1024, shared_expert_gate=False, router_aux_loss_coef=0.0)
    return cfg.replace(**overrides)


def xlstm_7b(vocab_size: int = 50_304, **overrides) -> ModelConfig:
    """xLSTM-7B (NX-AI 2025) as transformers' xLSTMConfig defaults give it: 32 mLSTM blocks of D 4096 (8 heads; q
    and k 2048 wide in all, v 4096; gates soft-capped at 15), each with a SwiGLU of F 10944; logits soft-capped at
    30; no positions; untied. About 6.87B parameters."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=4096, num_heads=8, head_dim=256, num_layers=32, d_ff=10_944,
                      norm="rmsnorm", norm_eps=1e-6, norm_position="pre", final_norm=True, position="none",
                      activation="swiglu", attention_bias=False, ffn_bias=False, tie_embeddings=False,
                      final_logit_softcap=30.0, mixer_pattern=("mlstm",),
                      mlstm=dict(heads=8, qk_dim=2048, v_dim=4096, gate_soft_cap=15.0, eps=1e-6))
    return cfg.replace(**overrides)


def kimi_k2(vocab_size: int = 163_840, **overrides) -> ModelConfig:
    """Kimi K2 (Moonshot AI 2025): DeepSeek-V3's architecture with 384 routed experts, 64 heads, one
    dense layer, no expert groups, gates x2.827, YaRN x32 from 4k (theta 50,000).
    About 1.03T parameters, 32B active per token."""
    factor = 32.0
    return deepseek_v3(vocab_size, num_heads=64, num_experts=384, dense_layers=1, router_groups=1,
                       router_group_top=1, router_scale=2.827, max_len=int(factor * 4096),
                       rope=dict(theta=50_000.0, factor=factor, beta_fast=1.0),
                       mla=dict(softmax_scale_factor=(0.1 * math.log(factor) + 1.0) ** 2)).replace(**overrides)


def mamba2_2_7b(vocab_size: int = 50_288, **overrides) -> ModelConfig:
    """Mamba-2 2.7B (Dao & Gu 2024; state-spaces/mamba2-2.7b): 64 Mamba-2 layers of D 2560 without
    feed-forward, E = 5120 channels in 80 heads of 64, state 128, one B/C group, tied embeddings
    (vocabulary padded to 50,288). About 2.7B parameters."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=2560, num_heads=80, head_dim=64, num_layers=64, d_ff=1,
                      max_len=2048, norm="rmsnorm", norm_eps=1e-5, norm_position="pre", final_norm=True,
                      position="none", mixer_pattern=("mamba2",), ffn_pattern=("none",),
                      mamba2=dict(state_size=128, head_dim=64, expand=2, groups=1), tie_embeddings=True,
                      attention_bias=False)
    return cfg.replace(**overrides)


def jamba_1_5_mini(vocab_size: int = 65_536, **overrides) -> ModelConfig:
    """Jamba-1.5-Mini (AI21 2024; the Jamba architecture of Lieber et al. 2024): 32 layers of D 4096 in
    blocks of 8, one attention layer (GQA 32/8, no positions) to seven Mamba layers (state 16, expand 2,
    RMSNorms on dt, B and C), and a 16-expert top-2 SwiGLU MoE (F 14336) on every other layer.
    About 52B parameters, 12B active per token."""
    cfg = llama(vocab_size, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8, d_ff=14_336, max_len=262_144,
                norm_eps=1e-6, position="none",
                mixer_pattern=("mamba",) * 4 + ("attention",) + ("mamba",) * 3, ffn_pattern=("dense", "moe"),
                mamba=dict(state_size=16, conv_kernel=4, expand=2, inner_norms=True), num_experts=16,
                experts_per_token=2, router_norm_topk=False, router_aux_loss_coef=0.001)
    return cfg.replace(**overrides)


def qwen3_next_80b_a3b(vocab_size: int = 151_936, **overrides) -> ModelConfig:
    """Qwen3-Next-80B-A3B (Qwen team 2025): 48 layers of D 2048, three gated DeltaNet layers (16 query/key
    heads and 32 value heads of 128) to one gated attention layer (16 heads of 256, GQA 2, q/k norms,
    RoPE on a quarter of each head), zero-centred RMSNorms, and on every layer a 512-expert top-10 MoE
    (F 512) with a gated shared expert (F 512). About 80B parameters, 3B active per token."""
    cfg = llama(vocab_size, d_model=2048, num_layers=48, num_heads=16, num_kv_heads=2, head_dim=256, d_ff=512,
                max_len=262_144, norm_eps=1e-6, norm_scale_offset=1.0, rope=dict(theta=1e7, dim=64), qk_norm=True,
                attention_output_gate=True, mixer_pattern=("gated_deltanet",) * 3 + ("attention",),
                deltanet=dict(key_heads=16, value_heads=32, key_head_dim=128, value_head_dim=128, conv_kernel=4),
                num_experts=512, experts_per_token=10, shared_expert_d_ff=512, router_aux_loss_coef=0.001)
    return cfg.replace(**overrides)


def recurrentgemma_2b(vocab_size: int = 256_000, **overrides) -> ModelConfig:
    """RecurrentGemma-2B (Botev et al. 2024; Griffin, De et al. 2024): 26 layers of D 2560 repeating
    (RG-LRU, RG-LRU, local attention over 2,048 tokens; MQA with 10 heads of 256, RoPE on half of each
    head), gated GeLU feed-forward (F 3840: HF's intermediate_size 7680 split into gate and up), zero-centred RMSNorms, embeddings scaled by sqrt(D), tied,
    logits soft-capped at 30. About 1.9B parameters (0.66B of them the embedding)."""
    pattern = ("rglru", "rglru", "attention")
    cfg = ModelConfig(vocab_size=vocab_size, d_model=2560, num_heads=10, num_kv_heads=1, head_dim=256,
                      num_layers=26, d_ff=3840, max_len=8192, norm="rmsnorm", norm_eps=1e-6,
                      norm_scale_offset=1.0, norm_position="pre", position="rope", rope=dict(dim=128),
                      attention_bias=False, attention_out_bias=True, sliding_window=2048,
                      mixer_pattern=(pattern * 9)[:26], rglru=dict(conv_kernel=4), activation="geglu",
                      ffn_bias=True, scale_embeddings=True, embedding_scale_rounding="bfloat16",
                      final_logit_softcap=30.0, tie_embeddings=True)
    return cfg.replace(**overrides)


def gpt_oss_120b(vocab_size: int = 201_088, **overrides) -> ModelConfig:
    """gpt-oss-120b (OpenAI 2025): 36 layers of D 2880 alternating a 128-token sliding window and full attention
    (64 query heads of 64, GQA 8, biased projections, a learned sink logit per head), YaRN x32 from 4k (theta
    150k, untruncated); on every layer 128 experts (F 2880, biased, clamped SwiGLU), top 4 by a biased router,
    softmax over the chosen. About 117B parameters, 5.1B active per token."""
    cfg = llama(vocab_size, d_model=2880, num_layers=36, num_heads=64, num_kv_heads=8, head_dim=64, d_ff=2880,
                max_len=131_072, attention_bias=True, attention_sinks=True, sliding_window=128,
                attention_pattern=("local", "global"), norm_eps=1e-5,
                rope=dict(theta=150_000.0, scaling="yarn", factor=32.0, original_max_len=4096, truncate=False),
                num_experts=128, experts_per_token=4, router_logit_bias=True, ffn_bias=True,
                activation="swiglu_clamped", swiglu_limit=7.0, router_aux_loss_coef=0.001)
    return cfg.replace(**overrides)


def gpt_oss_20b(vocab_size: int = 201_088, **overrides) -> ModelConfig:
    """gpt-oss-20b: gpt-oss-120b's layers, 24 of them with 32 experts each. About 21B parameters, 3.6B active."""
    return gpt_oss_120b(vocab_size, num_layers=24, num_experts=32).replace(**overrides)


def gemma3_27b(vocab_size: int = 262_208, **overrides) -> ModelConfig:
    """Gemma 3 27B's text model (Gemma Team 2025): 62 layers of D 5376, five sliding-window layers (1024, RoPE
    base 10k) to one global (base 1M, linear x8), 32 query heads of 128 (GQA 16) with per-head q/k RMSNorm,
    logits times 168**-0.5, each sublayer between two zero-centred RMSNorms, tanh-GeLU gates (F 21504),
    embeddings times sqrt(D), tied. About 27B parameters."""
    layers = 62
    cfg = llama(vocab_size, d_model=5376, num_layers=layers, num_heads=32, num_kv_heads=16, head_dim=128,
                d_ff=21_504, max_len=131_072, norm_eps=1e-6, norm_scale_offset=1.0, norm_position="sandwich",
                qk_norm=True, attention_scale=168 ** -0.5, activation="geglu", scale_embeddings=True,
                tie_embeddings=True, sliding_window=1024, attention_pattern=(("local",) * 5 + ("global",)) * 10
                + ("local", "local"), rope=dict(theta=1e6, scaling="linear", factor=8.0),
                local_rope=dict(theta=10_000.0, scaling=None, factor=1.0))
    return cfg.replace(**overrides)


def llama4_scout(vocab_size: int = 202_048, **overrides) -> ModelConfig:
    """Llama 4 Scout's text model (Meta 2025): 48 layers of D 5120, 40 query heads of 128 (GQA 8); three RoPE
    layers (adjacent pairs, Llama 3 scaling x16 from 8k, q/k RMS-normed after it) attending within 8192-token
    spans to one global layer without positions (with the attention temperature); on every layer 16 experts
    (F 8192), top 1 by sigmoid score scaling the expert's input, beside a shared expert. About 108B parameters,
    17B active per token."""
    cfg = llama(vocab_size, d_model=5120, num_layers=48, num_heads=40, num_kv_heads=8, head_dim=128, d_ff=8192,
                max_len=10_485_760, rope=dict(theta=500_000.0, scaling="llama3", factor=16.0, low_freq_factor=1.0,
                                              high_freq_factor=1.0, original_max_len=8192, interleaved=True),
                position_pattern=("rope", "rope", "rope", "none"), attention_pattern=("span", "span", "span", "global"),
                attention_span=8192, rope_qk_rms_norm=True, nope_temperature=0.1, nope_temperature_floor=8192,
                num_experts=16, experts_per_token=1, router_score="sigmoid", router_norm_topk=False,
                router_gate_input=True, shared_expert_d_ff=8192, shared_expert_gate=False, router_aux_loss_coef=0.001,
                dense_d_ff=16_384)  # intermediate_size_mlp, unused: every layer has experts
    return cfg.replace(**overrides)


def olmo2_13b(vocab_size: int = 100_352, **overrides) -> ModelConfig:
    """OLMo 2 13B (OLMo Team 2024): 40 layers of D 5120, 40 heads, each sublayer's RMSNorm on its output inside the
    residual, q/k RMSNorm over all heads together, SwiGLU (F 13824), RoPE base 500k. About 13.7B parameters."""
    cfg = llama(vocab_size, d_model=5120, num_layers=40, num_heads=40, num_kv_heads=40, d_ff=13_824, max_len=4096,
                norm_eps=1e-6, norm_position="post_sublayer", qk_norm=True, qk_norm_scope="heads", pad_id=1)
    return cfg.replace(**overrides)


def glm4_5_air(vocab_size: int = 151_552, **overrides) -> ModelConfig:
    """GLM-4.5-Air (Zhipu AI 2025): 46 layers of D 4096, 96 query heads of 128 (GQA 8, q/k/v biases), RoPE on half
    of each head; the first layer dense (F 10944), then 128 experts (F 1408), top 8 by sigmoid score plus a
    correction bias, renormalised, beside one shared expert. About 106B parameters, 12B active (the
    multi-token-prediction layer not included)."""
    cfg = llama(vocab_size, d_model=4096, num_layers=46, num_heads=96, num_kv_heads=8, head_dim=128, d_ff=1408,
                max_len=131_072, rope=dict(theta=1e6, dim=64), attention_bias=True, attention_out_bias=False,
                num_experts=128, experts_per_token=8, dense_layers=1, dense_d_ff=10_944, router_score="sigmoid",
                router_bias=True, shared_expert_d_ff=1408, shared_expert_gate=False, router_aux_loss_coef=0.0)
    return cfg.replace(**overrides)


def qwen3_5_35b_a3b(vocab_size: int = 248_320, **overrides) -> ModelConfig:
    """Qwen3.5-35B-A3B's text model as transformers' Qwen3_5MoeTextConfig defaults give it: 40 layers of D 2048 in
    Qwen3-Next's 3:1 layout (DeltaNet : gated attention), 256 experts (F 512) top 8 beside a gated shared expert
    (F 512), RoPE base 10k on a quarter of each head over 32k positions. About 34.7B parameters."""
    cfg = qwen3_next_80b_a3b(vocab_size, num_layers=40, num_experts=256, experts_per_token=8, max_len=32_768,
                             rope=dict(theta=10_000.0, dim=64))
    return cfg.replace(**overrides)


def lfm2_1_2b(vocab_size: int = 65_536, **overrides) -> ModelConfig:
    """LFM2-1.2B (Liquid AI 2025): 16 layers of D 2048, 10 gated short convolutions (3 taps) and 6 GQA attention
    layers (32/8 heads, RMSNorm per query and key head, RoPE base 1e6) at layers 2, 5, 8, 10, 12, 14, a SwiGLU of
    F 8192 in each (HF's block_ff_dim 12288 adjusted by 2/3); tied. About 1.17B parameters."""
    kinds = ["attention" if i in (2, 5, 8, 10, 12, 14) else "short_conv" for i in range(16)]
    cfg = llama(vocab_size, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8, d_ff=8192, max_len=128_000,
                norm_eps=1e-5, rope=dict(theta=1_000_000.0), qk_norm=True, tie_embeddings=True,
                mixer_pattern=tuple(kinds), short_conv=dict(kernel=3, bias=False))
    return cfg.replace(**overrides)


def falcon_mamba_7b(vocab_size: int = 65_024, **overrides) -> ModelConfig:
    """FalconMamba-7B (TII 2024): 64 Mamba layers of D 4096 without feed-forward, E 8192, state 16,
    weightless RMSNorms on dt, B and C (dt rank ceil(D / 16) = 256); untied. About 7.27B parameters."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=4096, num_heads=1, num_layers=64, d_ff=1, max_len=8192,
                      norm="rmsnorm", norm_eps=1e-5, norm_position="pre", final_norm=True, position="none",
                      mixer_pattern=("mamba",), ffn_pattern=("none",), attention_bias=False, tie_embeddings=False,
                      mamba=dict(state_size=16, conv_kernel=4, expand=2, dt_rank=None, inner_norms=True,
                                 inner_norm_weights=False, inner_norm_eps=1e-6))
    return cfg.replace(**overrides)


# Nemotron-H's pattern letters: one sublayer a layer, (token mixer, feed-forward)
HYBRID_LETTERS = {"M": ("mamba2", "none"), "*": ("attention", "none"), "-": ("none", "dense"), "E": ("none", "moe")}


def hybrid_layers(pattern: str) -> dict:
    """ModelConfig's mixer_pattern and ffn_pattern from a Nemotron-H pattern string ("M-M*-": M a Mamba-2
    layer, * attention, - a dense feed-forward, E a MoE feed-forward), one letter a layer."""
    bad = sorted(set(pattern) - set(HYBRID_LETTERS))
    if bad or not pattern:
        raise ValueError(f"hybrid pattern {pattern!r}: letters {bad} are not among {list(HYBRID_LETTERS)}")
    mixers, ffns = zip(*(HYBRID_LETTERS[c] for c in pattern))
    return dict(mixer_pattern=mixers, ffn_pattern=ffns)


def nemotron_h_8b(vocab_size: int = 131_072, **overrides) -> ModelConfig:
    """Nemotron-H-8B (NVIDIA 2025): 52 layers of D 4096, each one sublayer: 24 Mamba-2 (128 heads of 64,
    8 B/C groups, state 128), 4 attention (GQA 32/8, no positions) and 24 squared-ReLU feed-forwards
    (F 21504), in the published pattern M-M-M-M*-M-M-M-M-M*-...; untied. About 8.1B parameters."""
    cfg = llama(vocab_size, d_model=4096, num_layers=52, num_heads=32, num_kv_heads=8, d_ff=21_504, max_len=8192,
                position="none", activation="relu2",
                mamba2=dict(state_size=128, head_dim=64, expand=2, groups=8, dt_limit=(0.001, float("inf"))),
                **hybrid_layers("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"))
    return cfg.replace(**overrides)


def tiny(family: str, **overrides) -> ModelConfig:
    """CPU-sized variants (D 32, 2 layers, V 64) for tests and local runs.

    family: "decoder" (GPT-2 style), "llama", "moe" (Mixtral style), "encoder" (BERT), "encdec", "mamba2"
    (Mamba-2 layers only), "hybrid" (Llama-style, layers alternating Mamba-2 and attention); or the name of
    the model it follows (TINY_ALIASES: "gpt2", "bert", "mixtral", "transformer").
    """
    family = TINY_ALIASES.get(family, family)
    small = dict(d_model=32, num_heads=4, num_layers=2, d_ff=64, max_len=64, dropout_rate=0.0,
                 attention_dropout=0.0)
    if family == "decoder":
        cfg = gpt2_small(64, **small)
    elif family == "llama":
        cfg = llama(64, num_kv_heads=2, **{**small, "max_len": 64})
    elif family == "moe":
        cfg = llama(64, num_kv_heads=2, num_experts=4, experts_per_token=2, **small)
    elif family == "encoder":
        cfg = bert_base(64, **small)
    elif family == "encdec":
        cfg = transformer_base(64, **small)
    elif family == "mamba2":
        cfg = mamba2_2_7b(64, **{**small, "num_heads": 8, "head_dim": 8, "mamba2": _TINY_MAMBA2, "mixer_chunk_size": 4})
    elif family == "hybrid":
        cfg = llama(64, num_kv_heads=2, mixer_pattern=("mamba2", "attention"), mamba2=_TINY_MAMBA2,
                    mixer_chunk_size=4, **small)
    else:
        raise ValueError(f"unknown family {family!r}; choose {', '.join(TINY_FAMILIES)} (or "
                         f"{', '.join(f'{a} = {f}' for a, f in TINY_ALIASES.items())})")
    return cfg.replace(**overrides)


_TINY_MAMBA2 = dict(state_size=8, head_dim=8, expand=2, groups=2)
TINY_FAMILIES = ("decoder", "llama", "moe", "encoder", "encdec", "mamba2", "hybrid")
TINY_ALIASES = {"gpt2": "decoder", "gpt": "decoder", "bert": "encoder", "mixtral": "moe", "transformer": "encdec"}
PRESETS = {f.__name__: f for f in (transformer_base, transformer_big, bert_base, bert_large, gpt2_small,
                                   gpt2_medium, llama, mixtral_8x7b, deepseek_v3, kimi_k2, mamba2_2_7b,
                                   jamba_1_5_mini, qwen3_next_80b_a3b, recurrentgemma_2b, nemotron_h_8b,
                                   gpt_oss_120b, gpt_oss_20b, gemma3_27b, llama4_scout, olmo2_13b, glm4_5_air,
                                   qwen3_5_35b_a3b, lfm2_1_2b, falcon_mamba_7b, deepseek_v3_2,
                                   kimi_linear_48b_a3b, xlstm_7b)}
PRESETS.update({f"tiny_{family}": functools.partial(tiny, family) for family in TINY_FAMILIES})


def build(preset: str, vocab_size: int, overrides: Optional[dict] = None) -> ModelConfig:
    """The named preset with the tokenizer's vocabulary and ModelConfig fields overridden; an
    override that cannot apply to the model built (`tfm.config.check_overrides`) is refused.

    This is how every experiment picks its model (config keys `model.preset`, `model.overrides`).
    """
    if preset not in PRESETS:
        raise ValueError(f"model.preset {preset!r} unknown; choose from {sorted(PRESETS)}")
    overrides = dict(overrides or {})
    fields = {f.name for f in dataclasses.fields(ModelConfig)} | set(ExecutionConfig.names())  # flat: into execution
    unknown = sorted(set(overrides) - fields)
    if unknown:
        moved = [f"rope.{LEGACY_ROPE_FIELDS[k]}" for k in unknown if k in LEGACY_ROPE_FIELDS]
        hint = f" (RoPE's settings are nested now: {moved})" if moved else ""
        raise ValueError(f"model.overrides {unknown} are not ModelConfig fields{hint}; valid: {sorted(fields)}")
    if "vocab_size" in overrides:
        raise ValueError("model.overrides.vocab_size: the vocabulary size comes from the tokenizer "
                         "(set the experiment's vocab_size instead)")
    config = PRESETS[preset](vocab_size=vocab_size, **overrides)
    check_overrides(config, overrides)
    return config
