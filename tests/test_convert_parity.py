"""Numerical parity of tfm.convert against Hugging Face transformers (PyTorch, CPU, fp32).

Each architecture: one tiny random model whose every parameter is perturbed (so zero biases,
unit norm scales and zero logit biases cannot hide a mapping mistake), converted once from the
live model and once from its `save_pretrained` directory. Tolerance: max-abs 1e-4.
"""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")

from tfm.convert import from_hf  # noqa: E402

TOL = 1e-4
V, B, T = 100, 2, 9
EAGER = dict(attn_implementation="eager")


def randomize(model, skip=()):
    """Perturb every float parameter and saved buffer (e.g. Marian's final_logits_bias), tied ones
    once; not RoPE's non-persistent inv_freq caches."""
    gen = torch.Generator().manual_seed(0)
    saved = set(model.state_dict())
    with torch.no_grad():
        tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in saved]
        for name, p in tensors:
            if p.is_floating_point() and not any(s in name for s in skip):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def tokens(seed, shape=(B, T)):
    return np.random.default_rng(seed).integers(1, V - 1, shape)


def max_abs(a, b, mask=None):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = np.abs(a - b)
    if mask is not None:
        diff = diff[np.asarray(mask, bool)]
    return float(diff.max())


def padding_mask(lengths, length=T):
    return (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.int64)


def seq2seq_max_abs(hf, model, params, src, tgt, src_mask, tgt_mask) -> float:
    """Max-abs difference of the HF seq2seq model's logits and ours on padded source and target
    batches (HF attention masks = our segment ids), over the real target positions."""
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(src), attention_mask=torch.tensor(src_mask),
                 decoder_input_ids=torch.tensor(tgt), decoder_attention_mask=torch.tensor(tgt_mask)).logits
    out = model.apply({"params": params}, jnp.asarray(src), jnp.asarray(tgt), inputs_segment_ids=jnp.asarray(src_mask),
                      targets_segment_ids=jnp.asarray(tgt_mask)).logits
    return max_abs(out, ref, tgt_mask)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """save_pretrained into a fresh directory; returns the path."""
    def save(model, **kw):
        path = tmp_path_factory.mktemp(type(model).__name__)
        model.save_pretrained(path, **kw)
        return str(path)
    return save


def convert(model, path, source):
    return from_hf(model if source == "model" else path)


# ---- BERT -----------------------------------------------------------------------------------

BERT = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=40, type_vocab_size=2, **EAGER)


@pytest.fixture(scope="module")
def bert_pretraining(saved):
    torch.manual_seed(0)
    model = randomize(tr.BertForPreTraining(tr.BertConfig(**BERT)))
    return model, saved(model)


@pytest.mark.parametrize("source", ["model", "dir"])
def test_bert_pretraining(bert_pretraining, source):
    hf, path = bert_pretraining
    cfg, params, model = convert(hf, path, source)
    assert cfg.heads == ("mlm", "nsp") and cfg.norm_position == "post"
    ids, types, mask = tokens(1), tokens(2) % 2, padding_mask([T, 6])
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types),
                 output_hidden_states=True)
    out = model.apply({"params": params}, jnp.asarray(ids), token_type_ids=jnp.asarray(types),
                      segment_ids=jnp.asarray(mask))
    diffs = {"hidden": max_abs(out.hidden, ref.hidden_states[-1], mask),
             "mlm": max_abs(out.mlm_logits, ref.prediction_logits, mask),
             "nsp": max_abs(out.nsp_logits, ref.seq_relationship_logits)}
    print(f"BertForPreTraining[{source}] max-abs {diffs}")
    assert max(diffs.values()) < TOL, diffs


@pytest.mark.parametrize("source", ["model", "dir"])
def test_bert_model(saved, source):
    torch.manual_seed(1)
    hf = randomize(tr.BertModel(tr.BertConfig(**{**BERT, "hidden_act": "gelu_new"})))
    cfg, params, model = convert(hf, saved(hf) if source == "dir" else None, source)
    assert cfg.heads == ("pooler",) and cfg.activation == "gelu_tanh"
    ids = tokens(3)
    with torch.no_grad():
        ref = hf(torch.tensor(ids))
    out = model.apply({"params": params}, jnp.asarray(ids))
    diffs = {"hidden": max_abs(out.hidden, ref.last_hidden_state), "pooled": max_abs(out.pooled, ref.pooler_output)}
    print(f"BertModel[{source}] max-abs {diffs}")
    assert max(diffs.values()) < TOL, diffs


# ---- decoder-only -------------------------------------------------------------------------

DECODERS = {
    "gpt2": lambda: tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                                    **EAGER)),
    # head_dim != D / N, GQA, linear RoPE scaling, a non-default theta, untied output, biases on.
    "llama": lambda: tr.LlamaForCausalLM(tr.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, attention_bias=True,
        mlp_bias=True, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}, **EAGER)),
    # GQA, 4 experts top-2, a sliding window (4) shorter than the sequence (9).
    "mixtral": lambda: tr.MixtralForCausalLM(tr.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, **EAGER)),
    # Per-head q/k RMSNorm before RoPE, head_dim != D / N, GQA.
    "qwen3": lambda: tr.Qwen3ForCausalLM(tr.Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=64, **EAGER)),
    # The same attention with 6 experts top-2, gates renormalised (norm_topk_prob).
    "qwen3_moe": lambda: tr.Qwen3MoeForCausalLM(tr.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=64, **EAGER)),
    # Multi-head latent attention: query and kv latents, value head 6 != query/key head 8 + 4,
    # interleaved RoPE on the 4-dim part, YaRN with mscale_all_dim (the softmax factor), biases on.
    # Layer 0 dense, layer 1 DeepSeekMoE: 8 sigmoid-scored experts with the (perturbed) balancing
    # bias in 4 groups of which a token uses the best 2, top-3, gates scaled by 2.5, 2 shared experts.
    "deepseek_v3": lambda: tr.DeepseekV3ForCausalLM(tr.DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        first_k_dense_replace=1, moe_intermediate_size=8, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=3, n_shared_experts=2, routed_scaling_factor=2.5, attention_bias=True,
        max_position_embeddings=64, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 100.0}, **EAGER)),
    # 4 experts top-2 with un-normalised gates, a shared expert wider than the experts, q/k/v biases.
    "qwen2_moe": lambda: tr.Qwen2MoeForCausalLM(tr.Qwen2MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=64, **EAGER)),
}


@pytest.fixture(scope="module", params=sorted(DECODERS))
def decoder(request, saved):
    torch.manual_seed(2)
    model = randomize(DECODERS[request.param]())
    return request.param, model, saved(model)


@pytest.mark.parametrize("source", ["model", "dir"])
def test_decoder_logits(decoder, source):
    name, hf, path = decoder
    cfg, params, model = convert(hf, path, source)
    ids, mask = tokens(4), padding_mask([T, 5])  # right padding: segment id 0 <-> attention_mask 0
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    out = model.apply({"params": params}, jnp.asarray(ids), segment_ids=jnp.asarray(mask)).logits
    diff = max_abs(out, ref, mask)
    print(f"{type(hf).__name__}[{source}] max-abs {diff:.2e}")
    assert diff < TOL
    if name == "mixtral":
        assert cfg.num_experts == 4 and cfg.sliding_window == 4 and cfg.num_kv_heads == 2 and cfg.execution.moe_impl == "ragged"
    if name == "deepseek_v3":
        assert cfg.mla.softmax_scale_factor > 1 and (cfg.head_dim, cfg.rope.dim, cfg.mla.value_dim) == (12, 4, 6)
        moe = (cfg.dense_layers, cfg.dense_d_ff, cfg.d_ff, cfg.shared_expert_d_ff, cfg.router_groups)
        assert moe == (1, 48, 8, 16, 4)
    if name in ("qwen3", "qwen3_moe"):
        assert cfg.qk_norm and cfg.num_experts == (6 if name == "qwen3_moe" else 0)
    if name == "qwen2_moe":
        assert (cfg.num_experts, cfg.d_ff, cfg.shared_expert_d_ff, cfg.router_norm_topk) == (4, 24, 40, False)
    if name == "llama":
        assert (cfg.rope.scaling, cfg.rope.factor, cfg.rope.theta, cfg.head_dim) == ("linear", 2.0, 500.0, 16)


def test_runtime_overrides(decoder):
    """Runtime overrides keep the math: scanned layers give the same logits; dtype is the compute dtype."""
    _, hf, _ = decoder
    ids = tokens(5)
    _, params, model = from_hf(hf)
    cfg, scanned, scanned_model = from_hf(hf, scan_layers=True)
    assert "layers" in scanned["decoder"] and cfg.execution.scan_layers
    a = model.apply({"params": params}, jnp.asarray(ids)).logits
    b = scanned_model.apply({"params": scanned}, jnp.asarray(ids)).logits
    assert max_abs(a, b) < 1e-5
    assert from_hf(hf, dtype="bfloat16")[0].execution.dtype == "bfloat16"


@pytest.mark.parametrize("decoder", ["gpt2"], indirect=True)
def test_pytorch_bin_and_sharded_safetensors(decoder, tmp_path):
    """pytorch_model.bin and sharded safetensors (with an index) load like model.safetensors."""
    _, hf, path = decoder
    ref_cfg, ref_params, _ = from_hf(path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(os.path.join(path, "config.json"), bin_dir)
    torch.save({k: v.clone() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
               bin_dir / "pytorch_model.bin")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    for directory in (bin_dir, sharded):
        cfg, params, _ = from_hf(directory)
        assert cfg == ref_cfg
        jax.tree.map(np.testing.assert_array_equal, params, ref_params)


def test_gpt2_reorder_and_upcast_attn_is_accepted():
    """reorder_and_upcast_attn only changes logit precision, which tfm keeps in fp32 anyway."""
    torch.manual_seed(5)
    hf = randomize(tr.GPT2LMHeadModel(tr.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                                                   reorder_and_upcast_attn=True, **EAGER)))
    _, params, model = from_hf(hf)
    ids = tokens(10)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits
    assert max_abs(model.apply({"params": params}, jnp.asarray(ids)).logits, ref) < TOL


# ---- Marian ---------------------------------------------------------------------------------

MARIAN = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
              pad_token_id=V - 1, decoder_start_token_id=V - 1, eos_token_id=0, forced_eos_token_id=0,
              scale_embedding=True, activation_function="swish", **EAGER)


@pytest.fixture(scope="module")
def marian(saved):
    torch.manual_seed(3)
    model = randomize(tr.MarianMTModel(tr.MarianConfig(**MARIAN)), skip=("embed_positions",))
    assert float(model.final_logits_bias.abs().max()) > 0
    return model, saved(model)


@pytest.mark.parametrize("source", ["model", "dir"])
def test_marian_logits(marian, source):
    hf, path = marian
    cfg, params, model = convert(hf, path, source)
    assert (cfg.activation, cfg.scale_embeddings, cfg.norm_position, cfg.position) == \
        ("silu", True, "post", "sinusoidal")
    S, Tt = 9, 7
    src, tgt = tokens(6, (B, S)), tokens(7, (B, Tt))
    src_mask, tgt_mask = padding_mask([S, 5], S), padding_mask([Tt, 4], Tt)
    diff = seq2seq_max_abs(hf, model, params, src, tgt, src_mask, tgt_mask)
    print(f"MarianMTModel[{source}] max-abs {diff:.2e}")
    assert diff < TOL


def test_marian_unshared_untied(saved):
    """Separate source/target embeddings and an untied output layer map too."""
    torch.manual_seed(4)
    hf = randomize(tr.MarianMTModel(tr.MarianConfig(**{**MARIAN, "share_encoder_decoder_embeddings": False,
                                                       "tie_word_embeddings": False, "scale_embedding": False,
                                                       "activation_function": "relu"})),
                   skip=("embed_positions",))
    for source in (hf, saved(hf)):
        cfg, params, model = from_hf(source)
        assert not cfg.share_source_target_embeddings and not cfg.tie_embeddings
        src, tgt = tokens(8), tokens(9, (B, 5))
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor(src), decoder_input_ids=torch.tensor(tgt)).logits
        assert max_abs(model.apply({"params": params}, jnp.asarray(src), jnp.asarray(tgt)).logits, ref) < TOL
