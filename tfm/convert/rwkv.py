"""RWKV-4 (RwkvForCausalLM) -> tfm DecoderLM with every layer an "rwkv" time mix and an "rwkv" channel mix.

A LayerNorm on the embeddings (`blocks.0.pre_ln`: tfm's embedding_norm), pre-norm LayerNorm blocks (ln1
before the time mix, ln2 before the channel mix), the final `ln_out`, no positions, an untied `head`
(tied under tie_word_embeddings). HF's time-mix ramps are [1, 1, D]; tfm's are [D].

rescale_every: in eval mode HF divides each block's `attention.output` and `feed_forward.value` weights
by 2^(layer // rescale_every) and halves the hidden state every rescale_every layers (an fp16 overflow
guard). The weights on disk are the undivided ones, which tfm uses; the only change to the function is
the LayerNorms' eps meeting a smaller variance, so any value imports and export writes 0 (no rescaling,
HF's eval forward then computes tfm's function exactly). A live model that has run an eval forward holds
divided weights: convert it from its saved directory, or from a model that has not run one.
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert.common import ConversionError, Converter, HFConfig, Stack, Weights, model_params, norm
from tfm.models import DecoderLM

OUT_EPS = 1e-5  # HF's ln_out is a LayerNorm with its default eps, whatever layer_norm_epsilon says


def config(hf: HFConfig) -> ModelConfig:
    D, vocab = hf.require("hidden_size"), hf.require("vocab_size")
    width = hf.get("attention_hidden_size", D)
    eps = hf.get("layer_norm_epsilon", OUT_EPS)
    if eps != OUT_EPS:
        raise hf.unsupported("layer_norm_epsilon", eps, f"RWKV's ln_out always uses {OUT_EPS} and tfm has one "
                                                        f"norm_eps; only {OUT_EPS} converts")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=1, num_layers=hf.require("num_hidden_layers"),
        d_ff=hf.get("intermediate_size", 4 * D), max_len=hf.get("context_length", 1024), norm="layernorm",
        norm_eps=eps, norm_position="pre", final_norm=True, embedding_norm=True, position="none",
        mixer_pattern=("rwkv",), ffn_pattern=("rwkv",), rwkv=dict(attention_width=None if width == D else width),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_id=hf.pad_id(vocab))


def params(w: Weights, cfg: ModelConfig) -> dict:
    D, F = cfg.d_model, cfg.d_ff
    C = cfg.rwkv.attention_width or D
    linear = lambda key, out, inp: {"kernel": w(f"{key}.weight", (out, inp)).T}
    ramp = lambda key: w(key, (1, 1, D)).reshape(D)

    def layer(i: int) -> dict:
        a, f = f"rwkv.blocks.{i}.attention", f"rwkv.blocks.{i}.feed_forward"
        mixer = {name: linear(f"{a}.{name}", C, D) for name in ("key", "value", "receptance")}
        mixer.update({name: ramp(f"{a}.{name}") for name in ("time_mix_key", "time_mix_value", "time_mix_receptance")},
                     time_decay=w(f"{a}.time_decay", (C,)), time_first=w(f"{a}.time_first", (C,)),
                     output=linear(f"{a}.output", D, C))
        ffn = {"key": linear(f"{f}.key", F, D), "value": linear(f"{f}.value", D, F),
               "receptance": linear(f"{f}.receptance", D, D),
               "time_mix_key": ramp(f"{f}.time_mix_key"), "time_mix_receptance": ramp(f"{f}.time_mix_receptance")}
        return {"mixer_norm": norm(w, f"rwkv.blocks.{i}.ln1", "layernorm"), "mixer": mixer,
                "ffn_norm": norm(w, f"rwkv.blocks.{i}.ln2", "layernorm"), "ffn": ffn}

    decoder = Stack(layer, cfg.num_layers, final_norm="rwkv.ln_out")
    return model_params(w, cfg, embedding="rwkv.embeddings.weight", stacks={"decoder": decoder}, head="head.weight",
                        input={"norm": norm(w, "rwkv.blocks.0.pre_ln", "layernorm")})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export), with rescale_every=0 (see the module docstring)."""
    if cfg.mixer_pattern != ("rwkv",) or cfg.ffn_pattern != ("rwkv",):
        raise ConversionError("RwkvForCausalLM has an rwkv time mix and an rwkv channel mix in every layer")
    return dict(model_type="rwkv", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
                num_hidden_layers=cfg.num_layers, attention_hidden_size=cfg.rwkv.attention_width or cfg.d_model,
                intermediate_size=cfg.d_ff, context_length=cfg.max_len, layer_norm_epsilon=cfg.norm_eps,
                rescale_every=0, tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id)


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("rescale_every",)
ARCHITECTURES = {"RwkvForCausalLM": Converter(DecoderLM, config, params, hf_config=hf_config, inert=INERT,
                                              export_rank=1)}
