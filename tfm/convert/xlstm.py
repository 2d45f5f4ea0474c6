"""xLSTM (xLSTMForCausalLM, xLSTM-7B's architecture) -> tfm DecoderLM: every layer an mLSTM ("mlstm") from an
RMSNorm, then a SwiGLU feed-forward from another (width ffn_proj_factor * D rounded up to a multiple of
ffn_round_up_to_multiple_of); no positions; the output RMSNorm when add_out_norm; logits soft-capped
(output_logit_soft_cap: final_logit_softcap).

HF holds each projection apart (weight_mode "single": q, k, v, ogate_preact, igate_preact, fgate_preact;
proj_up_gate, proj_up) or fused (qkv_opreact rows q, k, v, o; ifgate_preact rows i, f; proj_up_gate_z rows
gate, up); tfm keeps each apart. Its kernels' settings (chunkwise_kernel, sequence_kernel, step_kernel, mode,
chunk_size, autocast_kernel_dtype, inference_state_dtype, max_inference_chunksize) choose how, not what, it
computes: fp32 parity holds with autocast_kernel_dtype="float32" (bfloat16 rounds q, k, v in its kernels).
"""
from __future__ import annotations

from tfm.config import ModelConfig
from tfm.convert.common import ConversionError, Converter, HFConfig, Stack, Weights, dense, model_params, norm
from tfm.models import DecoderLM

DEFAULTS = dict(num_heads=8, use_bias=False, tie_word_embeddings=False, add_out_norm=True, norm_eps=1e-6,
                qk_dim_factor=0.5, v_dim_factor=1.0, eps=1e-6, ffn_proj_factor=2.667, ffn_round_up_to_multiple_of=64,
                gate_soft_cap=15.0, output_logit_soft_cap=30.0, weight_mode="single")


def _field(hf: HFConfig, name: str):
    return hf.get(name, DEFAULTS[name])


def config(hf: HFConfig) -> ModelConfig:
    D = hf.get("hidden_size") or hf.require("embedding_dim")
    if hf.get("embedding_dim", D) != D:
        raise hf.unsupported("embedding_dim", hf.get("embedding_dim"), f"tfm's embeddings are hidden_size={D} wide")
    L = hf.get("num_hidden_layers") or hf.require("num_blocks")
    if hf.get("num_blocks", L) != L:
        raise hf.unsupported("num_blocks", hf.get("num_blocks"), f"it must equal num_hidden_layers={L}")
    hf.expect("use_bias", [False], False)  # tfm's RMSNorm and the mLSTM's projections have no biases
    hf.expect("weight_mode", ["single", "fused"], "single")
    N = _field(hf, "num_heads")
    qk, vd = int(D * _field(hf, "qk_dim_factor")), int(D * _field(hf, "v_dim_factor"))
    multiple = _field(hf, "ffn_round_up_to_multiple_of")
    F = int(-(-(D * _field(hf, "ffn_proj_factor")) // multiple) * multiple)
    vocab = hf.require("vocab_size")
    return ModelConfig(
        vocab_size=vocab, d_model=D, num_heads=N, head_dim=qk // N, num_layers=L, d_ff=F,
        norm="rmsnorm", norm_eps=_field(hf, "norm_eps"), norm_position="pre", final_norm=bool(_field(hf, "add_out_norm")),
        position="none", activation="swiglu", attention_bias=False, ffn_bias=False,
        tie_embeddings=bool(_field(hf, "tie_word_embeddings")), pad_id=hf.pad_id(vocab),
        final_logit_softcap=_field(hf, "output_logit_soft_cap"), mixer_pattern=("mlstm",),
        mlstm=dict(heads=N, qk_dim=qk, v_dim=vd, gate_soft_cap=_field(hf, "gate_soft_cap"), eps=_field(hf, "eps")))


def mlstm_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """HF's xLSTMLayer at `p` -> tfm MLstm params."""
    D, m = cfg.d_model, cfg.mlstm
    (QK, VD), N = m.widths(D), m.heads
    heads = lambda rows, width: {"kernel": rows.T.reshape(D, N, width // N)}
    if w.has(f"{p}.qkv_opreact.weight"):
        qkvo = w(f"{p}.qkv_opreact.weight", (2 * QK + 2 * VD, D))
        q, k, v, o = qkvo[:QK], qkvo[QK:2 * QK], qkvo[2 * QK:2 * QK + VD], qkvo[2 * QK + VD:]
        gates, gate_bias = w(f"{p}.ifgate_preact.weight", (2 * N, D)), w(f"{p}.ifgate_preact.bias", (2 * N,))
        i, f = dense(gates[:N], gate_bias[:N]), dense(gates[N:], gate_bias[N:])
    else:
        q, k, v = w(f"{p}.q.weight", (QK, D)), w(f"{p}.k.weight", (QK, D)), w(f"{p}.v.weight", (VD, D))
        o = w(f"{p}.ogate_preact.weight", (VD, D))
        i, f = (dense(w(f"{p}.{n}gate_preact.weight", (N, D)), w(f"{p}.{n}gate_preact.bias", (N,))) for n in "if")
    return {"query": heads(q, QK), "key": heads(k, QK), "value": heads(v, VD), "output_gate": dense(o),
            "input_gate": i, "forget_gate": f, "norm": w(f"{p}.multihead_norm.weight", (VD,)),
            "out": dense(w(f"{p}.out_proj.weight", (D, VD)))}


def ffn_params(w: Weights, p: str, cfg: ModelConfig) -> dict:
    D, F = cfg.d_model, cfg.d_ff
    if w.has(f"{p}.proj_up_gate_z.weight"):
        both = w(f"{p}.proj_up_gate_z.weight", (2 * F, D))
        gate, up = both[:F], both[F:]
    else:
        gate, up = w(f"{p}.proj_up_gate.weight", (F, D)), w(f"{p}.proj_up.weight", (F, D))
    return {"wi_gate": dense(gate), "wi_up": dense(up), "wo": dense(w(f"{p}.proj_down.weight", (D, F)))}


def params(w: Weights, cfg: ModelConfig) -> dict:
    def layer(i: int) -> dict:
        p = f"backbone.blocks.{i}"
        return {"mixer_norm": norm(w, f"{p}.norm_mlstm", "rmsnorm"), "mixer": mlstm_params(w, f"{p}.mlstm_layer", cfg),
                "ffn_norm": norm(w, f"{p}.norm_ffn", "rmsnorm"), "ffn": ffn_params(w, f"{p}.ffn", cfg)}
    decoder = Stack(layer, cfg.num_layers, final_norm="backbone.out_norm" if cfg.final_norm else None)
    return model_params(w, cfg, embedding="backbone.embeddings.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if cfg.mixer_pattern != ("mlstm",) or cfg.ffn_pattern not in (None, ("dense",)):
        raise ConversionError("xLSTMForCausalLM's layers are each an mLSTM and a SwiGLU feed-forward")
    m, D = cfg.mlstm, cfg.d_model
    qk, vd = m.widths(D)
    return dict(model_type="xlstm", vocab_size=cfg.vocab_size, hidden_size=D, embedding_dim=D,
                num_hidden_layers=cfg.num_layers, num_blocks=cfg.num_layers, num_heads=m.heads, use_bias=False,
                tie_word_embeddings=cfg.tie_embeddings, add_out_norm=cfg.final_norm, norm_eps=cfg.norm_eps,
                qk_dim_factor=qk / D, v_dim_factor=vd / D, eps=m.eps, ffn_proj_factor=cfg.d_ff / D,
                ffn_round_up_to_multiple_of=1, gate_soft_cap=m.gate_soft_cap,
                output_logit_soft_cap=cfg.final_logit_softcap, weight_mode="single", pad_token_id=cfg.pad_id,
                autocast_kernel_dtype="float32")


# how transformers' kernels run, not what they compute (the module docstring)
INERT = ("chunkwise_kernel", "sequence_kernel", "step_kernel", "mode", "chunk_size", "return_last_states",
         "autocast_kernel_dtype", "inference_state_dtype", "max_inference_chunksize", "norm_reduction_force_float32")
ARCHITECTURES = {"xLSTMForCausalLM": Converter(DecoderLM, config, params, hf_config=hf_config, inert=INERT,
                                               export_rank=1)}
