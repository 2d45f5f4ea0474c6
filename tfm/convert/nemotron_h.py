"""Nemotron-H (NemotronHForCausalLM) -> tfm DecoderLM whose layers each hold one sublayer.

Each HF block is RMSNorm (`norm`), one `mixer` and a residual; its kind is layers_block_type (older
configs: hybrid_override_pattern, one character a layer: M, *, -, E):
  linear_attention (M): a Mamba-2 mixer (`mamba2.mixer_params`) -> mixer "mamba2", ffn "none";
  full_attention (*): GQA attention without positions or biases -> mixer "attention", ffn "none";
  mlp (-): down(act(up x)), mlp_hidden_act relu2 = relu(x)^2 -> mixer "none", ffn "dense" (dense_d_ff);
  moe (E): DeepSeek-V3's sigmoid routing (e_score_correction_bias as score_bias, n_group / topk_group,
    norm_topk_prob, routed_scaling_factor) over n_routed_experts ungated experts of moe_intermediate_size
    (tfm d_ff) plus one ungated shared expert of moe_shared_expert_intermediate_size -> mixer "none",
    ffn "moe".
The Block names the norm after its one sublayer (mixer_norm, attn_norm or ffn_norm). The mixer is sized by
mamba_num_heads * mamba_head_dim (HF ignores `expand`), clamps its steps below at time_step_min (HF
ignores time_step_limit) and normalises its gated output in n_groups groups. Tensors are named model.*
in memory (experts fused) and backbone.* in saved checkpoints (one tensor per expert); both import.
"""
from __future__ import annotations

import numpy as np

from tfm.config import ModelConfig
from tfm.convert import mamba2
from tfm.convert.bamba import with_defaults
from tfm.convert.common import (HF_ACTIVATIONS, ConversionError, Converter, HFConfig, Stack, Weights, attention, period,
                                hf_activation, linear, linear_pair, model_params, norm)
from tfm.models import DecoderLM
from tfm.models.presets import HYBRID_LETTERS

MIXER_FIELDS = dict(state_size="ssm_state_size", conv_kernel="conv_kernel", expand=None, head_dim="mamba_head_dim",
                    num_heads="mamba_num_heads", groups="n_groups", conv_bias="use_conv_bias", proj_bias="use_bias",
                    dt_limit=None, activation="mamba_hidden_act")
# NemotronHConfig's defaults for the fields a checkpoint's config.json may leave out, and the legacy names
# it still reads.
DEFAULTS = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=21504,
                mlp_hidden_act="relu2", ssm_state_size=128, mamba_num_heads=128, mamba_head_dim=64,
                mamba_hidden_act="silu", n_groups=8, conv_kernel=4, time_step_min=0.001, use_conv_bias=True,
                use_bias=False, layer_norm_epsilon=1e-5, n_routed_experts=8, moe_intermediate_size=7688,
                moe_shared_expert_intermediate_size=7688, num_experts_per_tok=2, routed_scaling_factor=1.0,
                n_group=1, topk_group=1, norm_topk_prob=True)
RENAMED = dict(mamba_n_groups="n_groups", mamba_d_conv="conv_kernel", mamba_conv_bias="use_conv_bias",
               mamba_dt_min="time_step_min")
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}  # hybrid_override_pattern
KINDS = {kind: HYBRID_LETTERS[c] for c, kind in PATTERN.items()}  # layers_block_type -> (mixer, feed-forward)
ACTIVATIONS = {"relu2": "relu2", **HF_ACTIVATIONS}  # mlp_hidden_act -> tfm activation (ungated)


def layer_types(hf: HFConfig) -> list:
    """layers_block_type, else hybrid_override_pattern's characters, else NemotronHConfig's default."""
    types = hf.get("layers_block_type")
    if types is None and hf.get("hybrid_override_pattern") is not None:
        pattern = hf.get("hybrid_override_pattern")
        bad = sorted(set(pattern) - set(PATTERN))
        if bad:
            raise hf.unsupported("hybrid_override_pattern", pattern, f"characters {bad} are not among {list(PATTERN)}")
        types = [PATTERN[c] for c in pattern]
    types = list(types or ["linear_attention", "moe", "full_attention", "mlp"])
    bad = sorted(set(types) - set(KINDS))
    if bad:
        raise hf.unsupported("layers_block_type", types, f"kinds {bad} are not among {list(KINDS)}")
    return types


def config(hf: HFConfig) -> ModelConfig:
    hf = with_defaults(hf, DEFAULTS, RENAMED)
    types = layer_types(hf)
    D, N = hf.require("hidden_size"), hf.require("num_attention_heads")
    act = hf.get("mlp_hidden_act")
    if act not in ACTIVATIONS:
        raise hf.unsupported("mlp_hidden_act", act, f"tfm maps {sorted(ACTIVATIONS)}")
    moe, dense_ff = {}, hf.require("intermediate_size")
    if "moe" in types:
        if hf.get("moe_latent_size") is not None:
            raise hf.unsupported("moe_latent_size", hf.get("moe_latent_size"), "tfm's experts read the model width")
        F = hf.require("moe_intermediate_size")
        moe = dict(num_experts=hf.require("n_routed_experts"), experts_per_token=hf.require("num_experts_per_tok"),
                   d_ff=F, dense_d_ff=dense_ff if "mlp" in types and dense_ff != F else None,
                   router_score="sigmoid", router_groups=hf.require("n_group"),
                   router_group_top=hf.require("topk_group"),
                   router_bias=True, router_scale=float(hf.require("routed_scaling_factor")),
                   router_norm_topk=bool(hf.require("norm_topk_prob")),
                   shared_expert_d_ff=hf.require("moe_shared_expert_intermediate_size"), shared_expert_gate=False,
                   router_aux_loss_coef=0.0)
    vocab = hf.require("vocab_size")
    mixer = dict(mamba2.mixer_config(hf, MIXER_FIELDS), dt_limit=(float(hf.require("time_step_min")), float("inf")))
    kw = dict(vocab_size=vocab, d_model=D, num_heads=N, num_kv_heads=hf.get("num_key_value_heads", N),
              head_dim=hf.get("head_dim", D // N), num_layers=len(types), d_ff=dense_ff,
              max_len=hf.get("max_position_embeddings", 4096), norm="rmsnorm", norm_eps=hf.get("layer_norm_epsilon"),
              norm_position="pre", final_norm=True, position="none", activation=ACTIVATIONS[act],
              attention_bias=False, ffn_bias=bool(hf.get("mlp_bias", False)),
              tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_id=hf.pad_id(vocab),
              attention_dropout=hf.get("attention_dropout", 0.0),
              mixer_pattern=period([KINDS[t][0] for t in types]), ffn_pattern=period([KINDS[t][1] for t in types]),
              mamba2=mixer)
    return ModelConfig(**{**kw, **moe})


def moe_ffn(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """Router (with its balancing bias), the ungated experts (fused or one tensor each) and the shared expert."""
    E, D, F = cfg.num_experts, cfg.d_model, cfg.d_ff
    if w.has(f"{p}.experts.up_proj"):  # transformers 5 in-memory layout
        up, down = w(f"{p}.experts.up_proj", (E, F, D)), w(f"{p}.experts.down_proj", (E, D, F))
    else:  # Hub / save_pretrained layout
        expert = lambda name, shape: np.stack([w(f"{p}.experts.{e}.{name}.weight", shape) for e in range(E)])
        up, down = expert("up_proj", (F, D)), expert("down_proj", (D, F))
    return {"router": {"kernel": w(f"{p}.gate.weight", (E, D)).T},  # [D, E]
            "score_bias": w(f"{p}.gate.e_score_correction_bias", (E,)),
            "wi": up.transpose(0, 2, 1), "wo": down.transpose(0, 2, 1),  # [E, D, F], [E, F, D]
            "shared_expert": {"wi": linear(w, f"{p}.shared_experts.up_proj", cfg.ffn_bias),
                              "wo": linear(w, f"{p}.shared_experts.down_proj", cfg.ffn_bias)}}


def layer(w: Weights, p: str, cfg: ModelConfig, i: int) -> dict:
    mixer, ffn = cfg.layer_mixer(i), cfg.layer_ffn(i)
    n, m = norm(w, f"{p}.norm", "rmsnorm"), f"{p}.mixer"
    if mixer == "mamba2":
        return {"mixer_norm": n, "mixer": mamba2.mixer_params(w, m, cfg)}
    if mixer == "attention":
        qkvo = [linear_pair(w, f"{m}.{name}_proj", False) for name in ("q", "k", "v", "o")]
        return {"attn_norm": n, "self_attn": attention(*qkvo, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)}
    if ffn == "dense":
        return {"ffn_norm": n, "ffn": {"wi": linear(w, f"{m}.up_proj", cfg.ffn_bias),
                                       "wo": linear(w, f"{m}.down_proj", cfg.ffn_bias)}}
    return {"ffn_norm": n, "ffn": moe_ffn(w, m, cfg)}


def params(w: Weights, cfg: ModelConfig) -> dict:
    top = "backbone" if w.has("backbone.embeddings.weight") else "model"
    decoder = Stack(lambda i: layer(w, f"{top}.layers.{i}", cfg, i), cfg.num_layers, final_norm=f"{top}.norm_f")
    return model_params(w, cfg, embedding=f"{top}.embeddings.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    kinds = {v: k for k, v in KINDS.items()}
    pairs = [(cfg.layer_mixer(i), cfg.layer_ffn(i)) for i in range(cfg.num_layers)]
    if any(pair not in kinds for pair in pairs):
        raise ConversionError(f"NemotronHForCausalLM's layers each hold one of (mixer, ffn) {sorted(kinds)}; "
                              f"mixer_pattern={cfg.mixer_pattern} and ffn_pattern={cfg.ffn_pattern} make "
                              f"{sorted(set(pairs))}")
    m = cfg.mamba2
    if m.dt_limit[1] != float("inf"):
        raise ConversionError(f"Nemotron-H clamps its Mamba-2 steps below only; mamba2.dt_limit={m.dt_limit}")
    act = "relu2" if cfg.activation == "relu2" else hf_activation(cfg.activation)
    out = dict(model_type="nemotron_h", vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
               layers_block_type=[kinds[pair] for pair in pairs], num_attention_heads=cfg.num_heads,
               num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_position_embeddings=cfg.max_len,
               intermediate_size=cfg.dense_d_ff or cfg.d_ff, mlp_hidden_act=act, mlp_bias=cfg.ffn_bias,
               layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, pad_token_id=cfg.pad_id,
               attention_dropout=cfg.attention_dropout, time_step_min=m.dt_limit[0],
               **mamba2.mixer_hf_config(cfg, MIXER_FIELDS))
    if cfg.num_experts:
        out.update(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.d_ff, moe_shared_expert_intermediate_size=cfg.shared_expert_d_ff,
                   n_group=cfg.router_groups, topk_group=cfg.router_group_top,
                   routed_scaling_factor=cfg.router_scale, norm_topk_prob=cfg.router_norm_topk)
    return out


IGNORE = ("mtp.*", "*.mtp.*")  # the multi-token prediction layers, which HF's model leaves out too
# HF config fields that change nothing tfm computes (initialisation, dropout, kernels, caching, ...)
INERT = ("attention_bias", "chunk_size", "expand", "hidden_dropout", "mamba_proj_bias",
         "mamba_ssm_cache_dtype", "moe_shared_expert_overlap", "mtp_layers_block_type", "n_shared_experts",
         "num_logits_to_keep", "num_nextn_predict_layers", "rescale_prenorm_residual", "residual_in_fp32",
         "time_step_floor", "time_step_limit", "time_step_max", "use_mamba_kernels")
ARCHITECTURES = {"NemotronHForCausalLM": Converter(DecoderLM, config, params, ignore=IGNORE, hf_config=hf_config,
                                                   inert=INERT, export_rank=1)}
