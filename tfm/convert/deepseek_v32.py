"""DeepSeek-V3.2 (DeepseekV32ForCausalLM) -> tfm DecoderLM: DeepSeek-V3 (`deepseek_v3`: multi-head latent
attention, DeepSeekMoE) with DeepSeek Sparse Attention in every layer (ModelConfig.indexer): the lightning
indexer's queries from the query latent (`indexer.wq_b`), its one key per token (`indexer.wk`, a LayerNorm
`k_norm`), its per-head weights (`indexer.weights_proj`); each query attends to its index_topk keys of highest
score. HF's indexer head holds its RoPE part first, as tfm's does; the attention's heads are permuted as
DeepSeek-V3's. The main attention always rotates adjacent pairs, the indexer halves.
"""
from __future__ import annotations

from tfm.config import IndexerConfig, ModelConfig
from tfm.convert import deepseek_v3, llama
from tfm.convert.common import ConversionError, Converter, HFConfig, Stack, Weights, dense, model_params, norm
from tfm.models import DecoderLM


def config(hf: HFConfig) -> ModelConfig:
    L = hf.require("num_hidden_layers")
    hf.expect("mlp_bias", [False], False)
    types = hf.get("layer_types") or ["indexed_attention"] * L
    if types != ["indexed_attention"] * L:
        raise hf.unsupported("layer_types", types, "every DeepSeek-V3.2 layer is 'indexed_attention'")
    dense = min(hf.get("first_k_dense_replace", 3), L)
    if (hf.get("mlp_layer_types") or ["dense"] * dense + ["sparse"] * (L - dense)) != \
            ["dense"] * dense + ["sparse"] * (L - dense):
        raise hf.unsupported("mlp_layer_types", hf.get("mlp_layer_types"),
                             f"tfm takes first_k_dense_replace={dense} dense layers, then the experts'")
    base = deepseek_v3.config(hf.with_fields(rope_interleave=True))
    if base.mla.q_rank is None:
        raise hf.unsupported("q_lora_rank", None, "DeepSeek-V3.2's indexer reads the query latent")
    indexer = IndexerConfig(heads=hf.require("index_n_heads"), head_dim=hf.require("index_head_dim"),
                            top_k=hf.require("index_topk"))
    return base.replace(indexer=indexer)


def attention(w: Weights, p: str, cfg: ModelConfig) -> dict:
    """DeepSeek-V3's attention params and the indexer's."""
    ind, D, Q = cfg.indexer, cfg.d_model, cfg.mla.q_rank
    a = f"{p}.self_attn.indexer"
    return dict(deepseek_v3.attention(w, p, cfg),
                indexer_query={"kernel": w(f"{a}.wq_b.weight", (ind.heads * ind.head_dim, Q)).T.reshape(
                    Q, ind.heads, ind.head_dim)},
                indexer_key=dense(w(f"{a}.wk.weight", (ind.head_dim, D))),
                indexer_key_norm=norm(w, f"{a}.k_norm", "layernorm"),
                indexer_weights=dense(w(f"{a}.weights_proj.weight", (ind.heads, D))))


def params(w: Weights, cfg: ModelConfig) -> dict:
    def layer(i: int) -> dict:
        p = f"model.layers.{i}"
        return {"attn_norm": norm(w, f"{p}.input_layernorm", "rmsnorm"), "self_attn": attention(w, p, cfg),
                "ffn_norm": norm(w, f"{p}.post_attention_layernorm", "rmsnorm"),
                "ffn": deepseek_v3.ffn(w, p, cfg, dense=not cfg.num_experts or i < cfg.dense_layers)}
    decoder = Stack(layer, cfg.num_layers, final_norm="model.norm")
    return model_params(w, cfg, embedding="model.embed_tokens.weight", stacks={"decoder": decoder})


def hf_config(cfg: ModelConfig) -> dict:
    """The inverse of `config` (export)."""
    if cfg.indexer is None or not cfg.rope.interleaved:
        raise ConversionError("DeepSeek-V3.2's attention is sparse (ModelConfig.indexer) and rotates adjacent pairs "
                              "(rope.interleaved)")
    out = deepseek_v3.hf_config(cfg)
    del out["rope_interleave"]
    ind = cfg.indexer
    return dict(out, model_type="deepseek_v32", index_n_heads=ind.heads, index_head_dim=ind.head_dim,
                index_topk=ind.top_k, mlp_bias=False)


INERT = deepseek_v3.INERT + ("head_dim",)  # DeepseekV32Config derives head_dim (= qk_rope_head_dim)
ARCHITECTURES = {"DeepseekV32ForCausalLM": Converter(DecoderLM, config, params, ignore=llama.IGNORE,
                                                     hf_config=hf_config, inert=INERT, export_rank=1)}
