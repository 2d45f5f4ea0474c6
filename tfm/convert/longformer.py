"""Longformer (LongformerModel) -> tfm EncoderModel.

RoBERTa's embeddings and BERT's post-norm blocks with Longformer's self-attention (Beltagy et al. 2020): a
sliding window of attention_window // 2 keys on each side (|i - j| <= w / 2, tfm's Longformer(window=w // 2 + 1))
plus global tokens, which every row attends to and whose own rows attend to every key through separate
query_global / key_global / value_global projections (ModelConfig.global_projections).

HF marks global tokens per call (global_attention_mask); tfm's are the first `globals` tokens of every sequence,
static so that the kernels can skip tiles. The import reproduces the class's own default forward,
`LongformerModel(input_ids)`: no global token (globals=0; the global projections are loaded and unused).
`cfg.replace(attention_sparsity=Longformer(window, globals=g))` makes the first g tokens global: g=1 (the <s>
token) is what HF's classification heads set. HF pads the sequence to a multiple of attention_window with masked
pad tokens; tfm needs no padding (the real rows are equal).
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert import bert
from tfm.convert.common import ConversionError, Converter, HFConfig, Weights, linear, linear_pair
from tfm.models import EncoderModel
from tfm.kernels.sparsity import Longformer

GLOBAL_PROJECTIONS = ("query_global", "key_global", "value_global")


def config(hf: HFConfig) -> ModelConfig:
    cfg = bert.config(hf, heads=("pooler",))
    windows = hf.require("attention_window")
    windows = set(windows) if isinstance(windows, (list, tuple)) else {windows}
    if len(windows) != 1:
        raise ConversionError(f"{hf.architecture}: attention_window {sorted(windows)} differs between layers; tfm's "
                              "attention_sparsity is one pattern for every layer")
    (window,) = windows
    return cfg.replace(position_offset=cfg.pad_id + 1, padding_positions=True, global_projections=True,
                       attention_sparsity=Longformer(window=window // 2 + 1, globals=0))


def layer(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """BERT's layer and the global projections, torch Linear [N*H, D] -> Einsum kernel [D, N, H], bias [N, H]."""
    out = bert.layer(w, p, cfg)
    N, H = cfg.num_heads, cfg.head_dim
    for name in GLOBAL_PROJECTIONS:
        weight, bias = linear_pair(w, f"{p}.attention.self.{name}", True)
        out["self_attn"][name] = {"kernel": weight.T.reshape(cfg.d_model, N, H), "bias": bias.reshape(N, H)}
    return out


def params(w: Weights, cfg: ModelConfig) -> dict:
    w.strip_prefix("longformer.")  # weights saved with or without the wrapper's prefix
    out = bert.encoder_params(w, cfg, "", layer_params=layer)
    if "pooler" in cfg.heads:
        out["pooler"] = linear(w, "pooler.dense")
    return out


# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("onnx_export",)
ARCHITECTURES = {
    "LongformerModel": Converter(EncoderModel, config, params, ignore=("*position_ids", "*token_type_ids"),
                                 refine=bert.pooler_if_saved, inert=INERT, export_rank=1),
}
