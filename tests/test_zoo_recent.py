"""The decoder families of 2025-26 against Hugging Face transformers (PyTorch, CPU, fp32).

Each family: one tiny random HF model (d_model 32, 2-4 layers, vocab 100, every parameter perturbed) whose
config turns on what the family adds (sandwich or output norms, NoPE layers, a local RoPE base, q/k norm over
all heads, µP multipliers, fused projections, a parallel block, sliding layers with a window shorter than the
sequence), converted from the live model and from its save_pretrained directory, compiled once:
logits = transformers' on a right-padded batch (1e-4), greedy decoding = `generate`, a packed row = its
sequences run alone (1e-5), and `to_hf` writes a directory transformers reloads bit-identically.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")

from test_zoo_decoders import MASK, B, T, V, max_abs, randomize, tokens  # noqa: E402  (the same tiny shapes)
from tfm import decode  # noqa: E402
from tfm.config import IndexerConfig  # noqa: E402
from tfm.convert import from_hf, to_hf  # noqa: E402

TOL = 1e-4
EAGER = dict(attn_implementation="eager")
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, **EAGER)
ROPE = {"rope_type": "default", "rope_theta": 500.0}  # copied into each config: HF configs add to it in place

FAMILIES = {
    # NoPE on layer 1 of 2 (interval 2)
    "smollm3": lambda: tr.SmolLM3ForCausalLM(tr.SmolLM3Config(**BASE, no_rope_layer_interval=2,
                                                              rope_parameters=dict(ROPE))),
    # µP multipliers, none of them 1
    "granite": lambda: tr.GraniteForCausalLM(tr.GraniteConfig(
        **BASE, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5,
        rope_parameters=dict(ROPE))),
    # output norms inside the residual, q/k norm over all heads
    "olmo2": lambda: tr.Olmo2ForCausalLM(tr.Olmo2Config(**BASE, rope_parameters=dict(ROPE))),
    # + sliding layers (window 3) beside a full one
    "olmo3": lambda: tr.Olmo3ForCausalLM(tr.Olmo3Config(
        **{**BASE, "num_hidden_layers": 4}, sliding_window=3, rope_parameters=dict(ROPE),
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])),
    # sandwich norms, soft caps, query_pre_attn_scalar, (local, global)
    "gemma2": lambda: tr.Gemma2ForCausalLM(tr.Gemma2Config(
        **BASE, sliding_window=3, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, rope_parameters=dict(ROPE))),
    # + per-head q/k norm, the local layers' own RoPE base, linear scaling on the global ones
    "gemma3": lambda: tr.Gemma3ForCausalLM(tr.Gemma3TextConfig(
        **BASE, sliding_window=3, query_pre_attn_scalar=12, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}})),
    # fused qkv and gate_up, half of each head rotated, a window on every layer
    "phi3": lambda: tr.Phi3ForCausalLM(tr.Phi3Config(
        **{k: v for k, v in BASE.items() if k != "head_dim"}, sliding_window=4,
        rope_parameters={**ROPE, "partial_rotary_factor": 0.5})),
    # parallel block, bias-free LayerNorm, interleaved RoPE, logit_scale
    "cohere": lambda: tr.CohereForCausalLM(tr.CohereConfig(**BASE, logit_scale=0.5, rope_parameters=dict(ROPE))),
    # + sliding layers that rotate beside a full layer without positions
    "cohere2": lambda: tr.Cohere2ForCausalLM(tr.Cohere2Config(
        **BASE, logit_scale=0.5, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(ROPE))),
    # q/k/v biases, fused gate_up, interleaved RoPE on half of each head
    "glm": lambda: tr.GlmForCausalLM(tr.GlmConfig(**BASE, rope_parameters={**ROPE, "partial_rotary_factor": 0.5})),
    # attention sinks, (local, global) with window 3, YaRN, 4 biased experts (top 2) with clamped SwiGLU
    "gpt_oss": lambda: tr.GptOssForCausalLM(tr.GptOssConfig(
        **BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=3, swiglu_limit=1.5,
        layer_types=["sliding_attention", "full_attention"])),
    # RoPE on adjacent pairs, biases everywhere
    "ernie4_5": lambda: tr.Ernie4_5ForCausalLM(tr.Ernie4_5Config(**BASE, use_bias=True, rope_parameters=dict(ROPE))),
    # + 1 dense layer, then 4 experts (top 2) chosen with a correction bias, 2 shared experts
    "ernie4_5_moe": lambda: tr.Ernie4_5_MoeForCausalLM(tr.Ernie4_5_MoeConfig(
        **BASE, moe_intermediate_size=16, moe_num_experts=4, moe_k=2, moe_layer_start_index=1, moe_layer_end_index=1,
        moe_num_shared_experts=2, rope_parameters=dict(ROPE))),
    # q/k norm after RoPE
    "hunyuan": lambda: tr.HunYuanDenseV1ForCausalLM(tr.HunYuanDenseV1Config(**BASE, rope_parameters=dict(ROPE))),
    # + 4 experts (top 2) beside a shared Mlp
    "hunyuan_moe": lambda: tr.HunYuanMoEV1ForCausalLM(tr.HunYuanMoEV1Config(
        **BASE, num_experts=4, moe_topk=2, rope_parameters=dict(ROPE))),
    # 1 dense layer, then 8 experts in 4 groups (top 2 groups, top 2 experts) by sigmoid + correction bias,
    # a shared expert, q/k norm, RoPE on half of each head
    "glm4_moe": lambda: tr.Glm4MoeForCausalLM(tr.Glm4MoeConfig(
        **BASE, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5, use_qk_norm=True,
        rope_parameters={**ROPE, "partial_rotary_factor": 0.5})),
    # NoPE on layer 3 with the attention temperature, spans of 4 on the RoPE layers with RMS-normed q/k after RoPE,
    # experts (top 1, gating their input) on layers 1 and 3 beside a shared expert, dense layers 0 and 2
    "llama4": lambda: tr.Llama4ForCausalLM(tr.Llama4TextConfig(
        **{**BASE, "num_hidden_layers": 4, "intermediate_size": 16}, intermediate_size_mlp=48, num_local_experts=4,
        moe_layers=[1, 3], attention_chunk_size=4, attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5,
        use_qk_norm=True, rope_parameters=dict(ROPE))),
    # a feed-forward that is not gated, under ReLU² (the family added in DESIGN's "adding a model family")
    "arcee": lambda: tr.ArceeForCausalLM(tr.ArceeConfig(**BASE, rope_parameters=dict(ROPE))),
    # + sandwich norms
    "glm4": lambda: tr.Glm4ForCausalLM(tr.Glm4Config(**BASE, rope_parameters={**ROPE, "partial_rotary_factor": 0.5})),
    # DeepSeek Sparse Attention: each query's 4 keys of highest index score (8 index heads of 8, their first 4 dims
    # rotated) over MLA (query latent 12, kv latent 8); a dense layer, then 4 experts top-2 in the best of 2 groups
    "deepseek_v32": lambda: tr.DeepseekV32ForCausalLM(tr.DeepseekV32Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, index_topk=4, index_head_dim=8, index_n_heads=8, max_position_embeddings=64,
        rope_parameters=dict(ROPE), pad_token_id=0, eos_token_id=None, **EAGER)),
}

EXPECTED = {  # what each family's conversion must turn on
    "deepseek_v32": dict(indexer=IndexerConfig(heads=8, head_dim=8, top_k=4)),
    "smollm3": dict(position_pattern=("rope", "none")),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_scale=0.2, logits_multiplier=0.4),
    "olmo2": dict(norm_position="post_sublayer", qk_norm_scope="heads"),
    "olmo3": dict(norm_position="post_sublayer", attention_pattern=("local", "local", "local", "global")),
    "gemma2": dict(norm_position="sandwich", attention_pattern=("local", "global"), attn_logit_softcap=5.0),
    "gemma3": dict(norm_position="sandwich", qk_norm=True, attn_logit_softcap=None),
    "phi3": dict(sliding_window=4, attention_pattern=None),
    "cohere": dict(parallel_block=True, norm="layernorm", norm_bias=False, logits_multiplier=0.5),
    "cohere2": dict(parallel_block=True, position_pattern=("rope", "none"), attention_pattern=("local", "global")),
    "glm": dict(attention_out_bias=False, norm_position="pre"),
    "glm4": dict(norm_position="sandwich"),
    "arcee": dict(activation="relu2"),
    "llama4": dict(position_pattern=("rope", "rope", "rope", "none"), attention_span=4, rope_qk_rms_norm=True,
                   nope_temperature=0.5, ffn_pattern=("dense", "moe"), router_gate_input=True),
    "glm4_moe": dict(router_score="sigmoid", router_groups=4, dense_layers=1, qk_norm=True, router_scale=1.5),
    "ernie4_5": dict(attention_bias=True, ffn_bias=True),
    "ernie4_5_moe": dict(dense_layers=1, num_experts=4, router_bias=True, shared_expert_d_ff=32),
    "hunyuan": dict(qk_norm=True, qk_norm_position="after_rope"),
    "hunyuan_moe": dict(qk_norm_position="after_rope", num_experts=4, shared_expert_d_ff=48),
    "gpt_oss": dict(attention_sinks=True, activation="swiglu_clamped", swiglu_limit=1.5, num_experts=4,
                    attention_pattern=("local", "global")),
}
ROPES = {"gemma3": dict(rope=(1e4, "linear"), local_rope=(50.0, None)), "phi3": dict(rope=(500.0, None)),
         "cohere": dict(rope=(500.0, None)), "glm": dict(rope=(500.0, None))}




@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """One family's HF model, its directory, and one conversion whose forward is compiled once."""
    torch.manual_seed(0)
    hf = randomize(FAMILIES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    cfg, params, model = from_hf(hf)
    forward = jax.jit(lambda ids, seg, pos: model.apply({"params": params}, ids, segment_ids=seg, positions=pos).logits)
    return request.param, hf, str(path), (cfg, params, model, forward)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_logits_match_hf(family):
    """Logits of the live model's conversion = transformers' on a padded batch (1e-4); the directory's conversion
    gives the same config and bit-identical params; the family's features are on."""
    name, hf, path, (cfg, params, _, forward) = family
    ids = tokens(1)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(MASK)).logits.numpy()
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    diff = max_abs(forward(jnp.asarray(ids), jnp.asarray(MASK), pos), ref, MASK)
    print(f"{name} max-abs {diff:.2e}")
    assert diff < TOL, (name, diff)
    cfg_dir, params_dir, _ = from_hf(path)
    assert cfg_dir == cfg
    jax.tree.map(np.testing.assert_array_equal, params_dir, params)
    assert {k: getattr(cfg, k) for k in EXPECTED[name]} == EXPECTED[name]
    for field, (theta, scaling) in ROPES.get(name, {}).items():
        assert (getattr(cfg, field).theta, getattr(cfg, field).scaling) == (theta, scaling), field


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_packed_row_equals_its_sequences_alone(family):
    """Two sequences (5 and 4 tokens) packed in one row, positions restarting, give each sequence's logits run
    alone (1e-5): every layer's mask, window and positions follow the segments."""
    name, _, _, (cfg, params, _, forward) = family
    ids = tokens(4, (1, T))
    seg = jnp.asarray([[1] * 5 + [2] * 4])
    pos = jnp.asarray([list(range(5)) + list(range(4))])
    packed = forward(jnp.asarray(ids), seg, pos)
    pad = lambda x: jnp.pad(jnp.asarray(x), ((0, 0), (0, T - x.shape[1])))
    for lo, hi in ((0, 5), (5, 9)):
        n = hi - lo
        alone = forward(pad(ids[:, lo:hi]), pad(np.ones((1, n), np.int32)), pad(np.arange(n)[None]))
        diff = max_abs(packed[:, lo:hi], alone[:, :n])
        assert diff < 1e-5, (name, lo, diff)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_greedy_decoding_equals_transformers_generate(family):
    """8 greedy tokens after a 5-token prompt through tfm's KV cache = transformers' generate."""
    name, hf, _, (cfg, params, model, _) = family
    prompt = tokens(3, (B, 5))
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                          max_new_tokens=8, do_sample=False, pad_token_id=0)[:, 5:].numpy()
    ours = jax.jit(functools.partial(decode.sample_lm, model, params, max_new_tokens=8, greedy=True))(
        jnp.asarray(prompt), rng=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(ours), ref)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_export_reloads_in_transformers_bit_identical(family, tmp_path):
    """to_hf picks the family's own class, and transformers loads every tensor back bit-identically."""
    import json
    name, hf, _, (cfg, params, _, _) = family
    directory = to_hf(cfg, params, tmp_path / name)
    with open(directory + "/config.json") as f:
        assert json.load(f)["architectures"] == [type(hf).__name__]
    reloaded, info = type(hf).from_pretrained(directory, output_loading_info=True, **EAGER)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = reloaded.state_dict()
    for key, tensor in hf.state_dict().items():
        if tensor.is_floating_point() and "inv_freq" not in key:
            assert torch.equal(state[key], tensor), key


# Each feature a family turns on, turned off again: the logits move (the features are not inert, and the parity
# above depends on them).
FEATURES_OFF = [("llama4", dict(rope_qk_rms_norm=False)), ("llama4", dict(nope_temperature=0.0)),
                ("llama4", dict(attention_span=None, attention_pattern=None)), ("llama4", dict(router_gate_input=False)),
                ("gpt_oss", dict(attention_sinks=False)), ("gpt_oss", dict(swiglu_limit=100.0)),
                ("granite", dict(residual_multiplier=1.0)), ("granite", dict(attention_scale=None)),
                ("olmo2", dict(norm_position="pre")), ("gemma3", dict(local_rope=None)),
                ("hunyuan", dict(qk_norm_position="before_rope")), ("cohere2", dict(position_pattern=None)),
                ("smollm3", dict(position_pattern=None)), ("glm4", dict(norm_position="pre")),
                ("deepseek_v32", dict(indexer=None))]


@pytest.mark.parametrize("family,change", FEATURES_OFF, ids=[f"{f}-{next(iter(c))}" for f, c in FEATURES_OFF],
                         indirect=["family"])
def test_each_feature_changes_the_logits(family, change):
    from tfm.models import DecoderLM
    name, _, _, (cfg, params, model, forward) = family
    ids, seg = jnp.asarray(tokens(1)), jnp.asarray(MASK)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    off = DecoderLM(cfg.replace(**change)).apply({"params": params}, ids, segment_ids=seg, positions=pos).logits
    assert max_abs(off, forward(ids, seg, pos), MASK) > 1e-3, (name, change)


# ---- published sizes -----------------------------------------------------------------------------------------

PUBLISHED = {  # preset: (HF class, its published config)
    "gpt_oss_120b": ("GptOssForCausalLM", lambda: tr.GptOssConfig()),
    "gpt_oss_20b": ("GptOssForCausalLM", lambda: tr.GptOssConfig(num_hidden_layers=24, num_local_experts=32)),
    "gemma3_27b": ("Gemma3ForCausalLM", lambda: tr.Gemma3TextConfig(
        hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
        head_dim=128, query_pre_attn_scalar=168, sliding_window=1024, vocab_size=262208, max_position_embeddings=131072,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "llama4_scout": ("Llama4ForCausalLM", lambda: tr.Llama4TextConfig(
        max_position_embeddings=10485760, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 1.0, "original_max_position_embeddings": 8192})),
    "olmo2_13b": ("Olmo2ForCausalLM", lambda: tr.Olmo2Config(
        hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
        vocab_size=100352, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "glm4_5_air": ("Glm4MoeForCausalLM", lambda: tr.Glm4MoeConfig(
        head_dim=128, n_shared_experts=1, attention_bias=True, max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})),
    "qwen3_5_35b_a3b": ("Qwen3_5MoeForCausalLM", lambda: tr.Qwen3_5MoeTextConfig()),
    # DeepSeek-V3's YaRN (its config.json's rope_scaling), which DeepseekV32Config's defaults leave out
    "deepseek_v3_2": ("DeepseekV32ForCausalLM", lambda: tr.DeepseekV32Config(rope_parameters=dict(
        rope_type="yarn", rope_theta=10_000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))),
    "kimi_linear_48b_a3b": ("KimiLinearForCausalLM", lambda: tr.KimiLinearConfig()),
    "xlstm_7b": ("xLSTMForCausalLM", lambda: tr.xLSTMConfig()),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_size_is_the_converted_config_and_counts_what_transformers_builds(name):
    """The preset is what the converter makes of the published config (every field but pad_id and the execution
    settings), and its parameters (jax.eval_shape) number what transformers builds for it on the meta device,
    counting persistent buffers (the routers' correction biases, which tfm keeps as parameters)."""
    import dataclasses
    from tfm.convert import CONVERTERS
    from tfm.models import DecoderLM, presets
    arch, published = PUBLISHED[name]
    with torch.device("meta"):
        hf = getattr(tr, arch)(published())
    state = hf.state_dict()
    count = sum(p.numel() for p in hf.parameters()) + sum(b.numel() for n, b in hf.named_buffers() if n in state)
    cfg = presets.PRESETS[name]()
    converted = CONVERTERS[arch].read_config(published().to_dict(), arch)
    differ = {f.name: (getattr(cfg, f.name), getattr(converted, f.name)) for f in dataclasses.fields(cfg)
              if f.name not in ("pad_id", "execution") and getattr(cfg, f.name) != getattr(converted, f.name)}
    assert not differ, differ
    shapes = jax.eval_shape(lambda: DecoderLM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
    assert sum(x.size for x in jax.tree.leaves(shapes["params"])) == count


# ---- other backends, sharding ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["cohere2", "gemma2", "llama4", "olmo3"], indirect=True)
def test_pallas_equals_xla(family):
    """attention_impl="pallas" (the flash kernels, interpreted) gives xla's logits (1e-5): NoPE and local-RoPE
    layers, spans (as segment ids), windows and soft caps reach the kernels."""
    name, hf, _, (cfg, params, _, forward) = family
    _, _, pallas = from_hf(hf, attention_impl="pallas")
    ids, seg = jnp.asarray(tokens(3)), jnp.asarray(MASK)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    got = jax.jit(pallas.apply)({"params": params}, ids, segment_ids=seg, positions=pos).logits
    assert max_abs(got, forward(ids, seg, pos), MASK) < 1e-5, name


@pytest.mark.parametrize("family", ["gpt_oss"], indirect=True)
def test_sinks_run_where_declared_and_are_refused_elsewhere(family):
    """Only the backends declaring `sinks` (tfm.capabilities) compute them: "auto" picks one (the logits equal
    xla's), "pallas" is refused in one line naming the field."""
    from tfm import capabilities
    name, hf, _, (cfg, params, _, forward) = family
    assert capabilities.supporting(sinks=True) == ["xla"]
    with pytest.raises(ValueError, match="attention_sinks"):
        from_hf(hf, attention_impl="pallas")
    _, _, auto = from_hf(hf, attention_impl="auto")
    ids, seg = jnp.asarray(tokens(3)), jnp.asarray(MASK)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    got = jax.jit(auto.apply)({"params": params}, ids, segment_ids=seg, positions=pos).logits
    np.testing.assert_array_equal(got, forward(ids, seg, pos))


# One family for each new parameter layout the sharding rules must split: sinks [N], biased experts and router
# (gpt-oss), q/k norms over all heads [N * H] (OLMo 2), a sublayer's second norm (Gemma 3).
@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "olmo2"], indirect=True)
def test_sharded_training_equals_single_device(family):
    """3 Adam steps on data 4 x tensor 2 give the single-device losses (1e-5), and they fall."""
    from test_zoo_decoders import _losses
    name, _, _, (cfg, _, _, _) = family
    ref, got = _losses(name, cfg, "single"), _losses(name, cfg, "data4_tensor2")
    assert ref[0] - ref[-1] > 0.01, (name, ref)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gemma3", "llama4"], indirect=True)
def test_context_parallel_training_equals_single_device(family):
    """The sequence split over context 4 (ring attention) beside data 2: the same losses as one device (1e-5)
    with per-layer RoPE bases and windows (Gemma 3), NoPE layers with their temperature and spans (Llama 4)."""
    from test_zoo_decoders import _losses
    name, _, _, (cfg, _, _, _) = family
    ref, got = _losses(name, cfg, "single"), _losses(name, cfg, "data2_context4")
    assert ref[0] - ref[-1] > 0.01, (name, ref)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
