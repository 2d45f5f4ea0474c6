"""Named configurations: the published sizes and tiny CPU variants of each family."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from tfm.config import LEGACY_ROPE_FIELDS, ModelConfig


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
          num_kv_heads: int = 8, d_ff: int = 14_336, **overrides) -> ModelConfig:
    """Llama-style: RMSNorm pre-norm, RoPE, SwiGLU, no biases, untied output, GQA."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      num_layers=num_layers, d_ff=d_ff, max_len=8192, norm="rmsnorm", norm_eps=1e-5,
                      norm_position="pre", final_norm=True, position="rope", rope=dict(theta=500_000.0),
                      activation="swiglu", attention_bias=False, ffn_bias=False, tie_embeddings=False)
    return cfg.replace(**overrides)


def tiny(family: str, **overrides) -> ModelConfig:
    """CPU-sized variants (D 32, 2 layers, V 64) for tests and local runs.

    family: "decoder" (GPT-2 style), "llama", "moe" (Mixtral style), "encoder" (BERT), "encdec".
    """
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
    else:
        raise ValueError(f"unknown family {family!r}; choose decoder, llama, moe, encoder or encdec")
    return cfg.replace(**overrides)


PRESETS = {f.__name__: f for f in (transformer_base, transformer_big, bert_base, bert_large, gpt2_small,
                                   gpt2_medium, llama)}
PRESETS.update({f"tiny_{family}": functools.partial(tiny, family)
                for family in ("decoder", "llama", "moe", "encoder", "encdec")})


def build(preset: str, vocab_size: int, overrides: Optional[dict] = None) -> ModelConfig:
    """The named preset with the tokenizer's vocabulary and ModelConfig fields overridden.

    This is how every experiment picks its model (config keys `model.preset`, `model.overrides`).
    """
    if preset not in PRESETS:
        raise ValueError(f"model.preset {preset!r} unknown; choose from {sorted(PRESETS)}")
    overrides = dict(overrides or {})
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        moved = [f"rope.{LEGACY_ROPE_FIELDS[k]}" for k in unknown if k in LEGACY_ROPE_FIELDS]
        hint = f" (RoPE's settings are nested now: {moved})" if moved else ""
        raise ValueError(f"model.overrides {unknown} are not ModelConfig fields{hint}; valid: {sorted(fields)}")
    if "vocab_size" in overrides:
        raise ValueError("model.overrides.vocab_size: the vocabulary size comes from the tokenizer "
                         "(set the experiment's vocab_size instead)")
    return PRESETS[preset](vocab_size=vocab_size, **overrides)
