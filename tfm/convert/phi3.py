"""Phi-3 (Phi3ForCausalLM) -> tfm DecoderLM: the Llama mapping with fused projections (`qkv_proj`: q, k, v rows;
`gate_up_proj`: gate, up rows), no biases, partial rotary (partial_rotary_factor), and a sliding window on every
layer when sliding_window is set. LongRoPE (the 128k checkpoints) is refused by `common.rope`."""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import llama
from tfm.convert.common import Converter, HFConfig, rope
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    return llama.config(hf, rope=rope(hf, 10_000.0, partial=True), sliding_window=hf.get("sliding_window"))


def params(w, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, ffn=llama.fused_ffn, projections=llama.fused_qkv)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    out = llama.hf_config(cfg, model_type="phi3", bias_fields=False)
    out["rope_parameters"]["partial_rotary_factor"] = cfg.rope.dim / cfg.head_dim
    return dict(out, sliding_window=cfg.sliding_window)


# original_max_position_embeddings is read by LongRoPE alone; dropout changes no evaluation.
INERT = ("original_max_position_embeddings", "resid_pdrop", "embd_pdrop")
ARCHITECTURES = {"Phi3ForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config,
                                                 inert=INERT)}
