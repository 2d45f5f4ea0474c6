"""Mixtral (MixtralForCausalLM) -> tfm DecoderLM with a dropless top-k MoE feed-forward.

The Llama mapping plus: router `gate` [E, D], experts w1 (gate), w3 (up), w2 (down), and a
sliding attention window. Accepts the Hub layout (`block_sparse_moe.experts.{e}.w1.weight`,
what save_pretrained writes) and the fused in-memory layout of transformers 5
(`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]).
"""
from __future__ import annotations

import numpy as np

from tfm.config import ModelConfig
from tfm.convert import llama
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    E = hf.require("num_local_experts")
    return llama.config(hf, default_theta=1e6, num_experts=E, experts_per_token=hf.get("num_experts_per_tok", 2),
                        router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
                        sliding_window=hf.get("sliding_window"), max_len=hf.get("max_position_embeddings", 4096 * 32))


def moe_ffn(w: Weights, p: str, cfg: ModelConfig, hub_block: str = "block_sparse_moe",
            hub_names: tuple = ("w1", "w3", "w2"), block: str = "mlp", router: str = "gate") -> dict:
    """Router and experts of layer `p`; the Hub layout names them `{p}.{hub_block}.experts.{e}.{name}`
    with hub_names = (gate, up, down) (Qwen2-MoE: "mlp", ("gate_proj", "up_proj", "down_proj")), the
    fused layout `{p}.{block}.experts.gate_up_proj`; the router is `{router}` in either block (Jamba:
    "feed_forward" and "router" for both)."""
    E, D, F = cfg.num_experts, cfg.d_model, cfg.d_ff
    if w.has(f"{p}.{block}.experts.gate_up_proj"):  # transformers 5 in-memory layout
        scores = w(f"{p}.{block}.{router}.weight", (E, D))
        gate_up = w(f"{p}.{block}.experts.gate_up_proj", (E, 2 * F, D))
        gate, up = gate_up[:, :F], gate_up[:, F:]  # [E, F, D] each
        down = w(f"{p}.{block}.experts.down_proj", (E, D, F))
    else:  # Hub / save_pretrained layout
        q = f"{p}.{hub_block}"
        scores = w(f"{q}.{router}.weight", (E, D))
        expert = lambda name, shape: np.stack([w(f"{q}.experts.{e}.{name}.weight", shape) for e in range(E)])
        names = dict(zip(("gate", "up", "down"), hub_names))
        gate, up, down = expert(names["gate"], (F, D)), expert(names["up"], (F, D)), expert(names["down"], (D, F))
    return {"router": {"kernel": scores.T},  # [D, E]
            "wi_gate": gate.transpose(0, 2, 1), "wi_up": up.transpose(0, 2, 1),  # [E, D, F]
            "wo": down.transpose(0, 2, 1)}  # [E, F, D]


def params(w: Weights, cfg: ModelConfig) -> dict:
    return llama.params(w, cfg, ffn=moe_ffn)


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export): Llama's fields less the biases Mixtral has no field for."""
    if cfg.num_experts < 1:
        raise ConversionError(f"num_experts={cfg.num_experts}: Mixtral's feed-forward is a mixture of experts")
    out = llama.hf_config(cfg, model_type="mixtral", bias_fields=False)
    return dict(out, num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                router_aux_loss_coef=cfg.router_aux_loss_coef, sliding_window=cfg.sliding_window)


ARCHITECTURES = {"MixtralForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config)}
