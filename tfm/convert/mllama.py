"""Llama 3.2 Vision (HF Mllama) -> tfm.

MllamaForCausalLM -> DecoderLM: a Llama decoder (`llama`) whose layers at `cross_attention_layers`
attend to image features instead of to the text: q/k RMSNorm on the cross-attention, tanh gates
(HF tensors of shape [1]) on its attention and feed-forward outputs. The token table has 8 rows
past vocab_size (the image tokens), which the untied output projection does not predict.

MllamaVisionModel -> TiledVisionEncoder: pre-norm LayerNorm Blocks without attention biases,
GELU MLP; tile-layout embedding tables [R + 1, X * ...] reshaped per tile.

MllamaForConditionalGeneration -> VisionLanguageModel: both, and the multi_modal_projector.
"""
from __future__ import annotations

import dataclasses

from tfm.config import ModelConfig
from tfm.convert import llama
from tfm.convert.common import (ConversionError, Converter, HFConfig, Stack, Weights, attention, hf_activation, linear,
                                linear_pair, model_params, norm, stack_layers)
from tfm.models import DecoderLM, VisionLanguageModel
from tfm.models.vision import TiledVisionEncoder, num_patches

EXTRA_TOKENS = 8  # MllamaTextModel embeds vocab_size + 8 ids


def config(hf: HFConfig) -> ModelConfig:
    D, N = hf.require("hidden_size"), hf.require("num_attention_heads")
    layers = tuple(hf.get("cross_attention_layers", ()))
    return llama.config(hf, head_dim=D // N,
                        multimodal=dict(cross_attention_layers=layers, extra_tokens=EXTRA_TOKENS))


def cross_layer(w: Weights, p: str, cfg: ModelConfig) -> dict:
    qkvo = [linear_pair(w, f"{p}.cross_attn.{n}_proj", False) for n in ("q", "k", "v", "o")]
    cross = attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    cross.update(query_norm=norm(w, f"{p}.cross_attn.q_norm", "rmsnorm"),
                 key_norm=norm(w, f"{p}.cross_attn.k_norm", "rmsnorm"))
    return {"cross_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"), "cross_attn": cross,
            "cross_gate": w(f"{p}.cross_attn_attn_gate", (1,)).reshape(()),
            "ffn_norm": norm(w, f"{p}.post_attention_layernorm", "rmsnorm"), "ffn": llama.dense_ffn(w, p, cfg),
            "ffn_gate": w(f"{p}.cross_attn_mlp_gate", (1,)).reshape(())}


def params(w: Weights, cfg: ModelConfig, p: str = "model.", head: str = "lm_head.weight") -> dict:
    """MllamaTextModel's tensors (under prefix p) and the output projection `head` -> DecoderLM params."""
    def layer(i):
        if i in cfg.multimodal.cross_attention_layers:
            return cross_layer(w, f"{p}layers.{i}", cfg)
        return llama.layer(w, f"{p}layers.{i}", cfg, llama.dense_ffn)

    decoder = Stack(layer, cfg.num_layers, final_norm=f"{p}norm")
    return model_params(w, cfg, embedding=f"{p}embed_tokens.weight", stacks={"decoder": decoder}, head=head)


def hf_config(cfg: ModelConfig) -> dict:
    out = llama.hf_config(cfg, "mllama_text_model", bias_fields=False)
    del out["head_dim"], out["attention_dropout"]
    return {**out, "cross_attention_layers": list(cfg.multimodal.cross_attention_layers)}


def aspect_ratios(max_num_tiles: int) -> list:
    """Every tile layout [rows, cols] of at most max_num_tiles tiles, in the order Mllama's processor
    numbers them (aspect_ratio_id = place + 1)."""
    return [[h, w] for h in range(1, max_num_tiles + 1) for w in range(1, max_num_tiles + 1) if h * w <= max_num_tiles]


def vision_config(hf: HFConfig) -> ModelConfig:
    D, layers = hf.require("hidden_size"), tuple(hf.get("intermediate_layers_indices", ()))
    hf.expect("norm_eps", [1e-5], 1e-5)  # HF's layernorm_pre/post use torch's default eps, its layers norm_eps
    hf.expect("vision_output_dim", [D * (1 + len(layers))])
    tiles = hf.require("max_num_tiles")
    return ModelConfig(
        vocab_size=1, d_model=D, num_heads=hf.require("attention_heads"), num_layers=hf.require("num_hidden_layers"),
        d_ff=hf.require("intermediate_size"), norm="layernorm", norm_eps=1e-5, final_norm=False, position="none",
        activation=hf.activation("hidden_act", "gelu"), attention_bias=False, image_size=hf.require("image_size"),
        patch_size=hf.require("patch_size"), num_channels=hf.get("num_channels", 3),
        multimodal=dict(max_num_tiles=tiles, max_aspect_ratio_id=len(hf.get("supported_aspect_ratios",
                                                                            aspect_ratios(tiles))),
                        num_global_layers=hf.require("num_global_layers"), intermediate_layers=layers))


def vision_layer(w: Weights, p: str, cfg: ModelConfig, gated: bool) -> dict:
    qkvo = [linear_pair(w, f"{p}.self_attn.{n}_proj", False) for n in ("q", "k", "v", "o")]
    out = {"attn_norm": norm(w, f"{p}.input_layernorm", "layernorm"),
           "self_attn": attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
           "ffn_norm": norm(w, f"{p}.post_attention_layernorm", "layernorm"),
           "ffn": {"wi": linear(w, f"{p}.mlp.fc1"), "wo": linear(w, f"{p}.mlp.fc2")}}
    if gated:
        out.update(attn_gate=w(f"{p}.gate_attn", (1,)).reshape(()), ffn_gate=w(f"{p}.gate_ffn", (1,)).reshape(()))
    return out


def vision_params(w: Weights, cfg: ModelConfig, p: str = "") -> dict:
    """MllamaVisionModel's tensors (under prefix p) -> TiledVisionEncoder params."""
    mm, D, C, ps = cfg.multimodal, cfg.d_model, cfg.num_channels, cfg.patch_size
    X, R, L = mm.max_num_tiles, mm.max_aspect_ratio_id + 1, 1 + num_patches(cfg)
    gate = lambda key: w(f"{p}{key}", (1,)).reshape(())
    tile = lambda key, shape: w(f"{p}{key}", (R, X * L * D if len(shape) == 3 else X * D)).reshape((R,) + shape)
    local = {f"layer_{i}": vision_layer(w, f"{p}transformer.layers.{i}", cfg, False) for i in range(cfg.num_layers)}
    glob = [vision_layer(w, f"{p}global_transformer.layers.{i}", cfg, True) for i in range(mm.num_global_layers)]
    return {"patch_embed": {"kernel": w(f"{p}patch_embedding.weight", (D, C, ps, ps)).transpose(2, 3, 1, 0)},
            "pre_tile": tile("pre_tile_positional_embedding.embedding.weight", (X, D)),
            "pre_tile_gate": gate("pre_tile_positional_embedding.gate"),
            "cls": w(f"{p}class_embedding", (D,)),
            "position": w(f"{p}gated_positional_embedding.embedding", (L, D)),
            "position_gate": gate("gated_positional_embedding.gate"),
            "tile_position": tile("gated_positional_embedding.tile_embedding.weight", (X, L, D)),
            "pre_norm": norm(w, f"{p}layernorm_pre", "layernorm"), **local,
            "post_norm": norm(w, f"{p}layernorm_post", "layernorm"),
            "post_tile": tile("post_tile_positional_embedding.embedding.weight", (X, D)),
            "post_tile_gate": gate("post_tile_positional_embedding.gate"),
            "global": stack_layers(glob, cfg.execution.scan_layers)}


def vision_hf_config(cfg: ModelConfig) -> dict:
    mm = cfg.multimodal
    return dict(model_type="mllama_vision_model", hidden_size=cfg.d_model, hidden_act=hf_activation(cfg.activation),
                num_hidden_layers=cfg.num_layers, num_global_layers=mm.num_global_layers,
                attention_heads=cfg.num_heads, num_channels=cfg.num_channels, intermediate_size=cfg.d_ff,
                vision_output_dim=cfg.d_model * (1 + len(mm.intermediate_layers)), image_size=cfg.image_size,
                patch_size=cfg.patch_size, norm_eps=cfg.norm_eps, max_num_tiles=mm.max_num_tiles,
                intermediate_layers_indices=list(mm.intermediate_layers),
                supported_aspect_ratios=aspect_ratios(mm.max_num_tiles))


def vl_config(hf: HFConfig) -> ModelConfig:
    """MllamaConfig -> the text decoder's ModelConfig with the image encoder's as multimodal.vision."""
    text = config(HFConfig(hf.require("text_config"), hf.architecture))
    vision = vision_config(HFConfig(hf.require("vision_config"), hf.architecture))
    return text.replace(multimodal=dataclasses.replace(text.multimodal, vision=vision))


def vl_params(w: Weights, cfg: ModelConfig) -> dict:
    """The live model's names (model.vision_model., model.language_model., lm_head) or those
    save_pretrained writes and the Hub holds (vision_model., language_model.model., language_model.lm_head)."""
    saved = w.has("language_model.lm_head.weight")
    p, text, head = ("", "language_model.model.", "language_model.lm_head.weight") if saved else (
        "model.", "model.language_model.", "lm_head.weight")
    return {"vision": vision_params(w, cfg.multimodal.vision, f"{p}vision_model."),
            "projector": linear(w, f"{p}multi_modal_projector"), "text": params(w, cfg, text, head)}


def vl_hf_config(cfg: ModelConfig) -> dict:
    """image_token_index: the first id past the vocabulary, as Llama 3.2 Vision numbers its <|image|>."""
    if cfg.multimodal.vision is None:
        raise ConversionError("MllamaForConditionalGeneration needs a vision encoder (multimodal.vision)")
    return dict(model_type="mllama", text_config=hf_config(cfg), vision_config=vision_hf_config(cfg.multimodal.vision),
                image_token_index=cfg.vocab_size)


ARCHITECTURES = {
    "MllamaForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE, hf_config=hf_config,
                                   inert=("dropout",), export_rank=1),
    "MllamaVisionModel": Converter(TiledVisionEncoder, vision_config, vision_params, hf_config=vision_hf_config,
                                   export_rank=1),
    "MllamaForConditionalGeneration": Converter(VisionLanguageModel, vl_config, vl_params, ignore=llama.IGNORE,
                                                hf_config=vl_hf_config, inert=("image_token_index",), export_rank=1),
}
