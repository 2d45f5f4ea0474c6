"""The linear-time mixers' families and their hybrids against Hugging Face transformers (PyTorch, CPU, fp32).

Each family: one tiny random HF model (every parameter perturbed) converted from the live model and
from its save_pretrained directory; logits match within max-abs 1e-4 (right padding on one row: the
padded positions are not compared). From the same conversion: a prompt continued from the recurrent
cache equals the whole prompt (1e-5), greedy decoding equals transformers' `generate`, and `to_hf`
writes a directory transformers reloads with no missing or unexpected keys and every tensor equal; for the
2025-26 hybrids (LFM2, FalconMamba, Granite 4.0-H, Falcon-H1, MiniMax, Kimi Linear, xLSTM, Zamba2) a packed row also equals
its sequences alone (1e-5).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")

from test_zoo_decoders import max_abs, randomize  # noqa: E402
from tfm import decode  # noqa: E402
from tfm.convert import from_hf, to_hf  # noqa: E402

TOL = 1e-4
V, B, T = 100, 2, 11

FAMILIES = {
    # 4 heads of 16 in 2 B/C groups, state 8, chunks of 4 over 11 tokens (chunked form, not a multiple)
    "mamba2": lambda: tr.Mamba2ForCausalLM(tr.Mamba2Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=2,
        expand=2, conv_kernel=4, chunk_size=4, use_conv_bias=True)),
    # E = 64 channels, state 8, dt rank 4 (not the default 2), projection biases, tied output
    "mamba": lambda: tr.MambaForCausalLM(tr.MambaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=4,
        use_bias=True, use_conv_bias=True)),
    # layers attention/moe, mamba/dense, mamba/moe, attention/dense (attention every 3 from 0, experts every 2
    # from 0: each mixer with each feed-forward); 4 heads, 2 kv heads, no positions; 4 experts top-2 of 48
    "jamba": lambda: tr.JambaForCausalLM(tr.JambaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=3, attn_layer_offset=0, expert_layer_period=2, expert_layer_offset=0,
        num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        use_mamba_kernels=False)),
    # full_attention_interval 2: DeltaNet (2 key heads, 4 value heads of 8) and gated attention (4 heads, 2 kv,
    # a rotary half of each head of 8) alternate; 4 experts top-2 of 16 plus a shared expert of 24
    "qwen3_next": lambda: tr.Qwen3NextForCausalLM(tr.Qwen3NextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, full_attention_interval=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)),
    # Qwen3.5: Qwen3-Next's layers with separate DeltaNet projections; dense, and with experts on every layer
    "qwen3_5": lambda: tr.Qwen3_5ForCausalLM(tr.Qwen3_5TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
    "qwen3_5_moe": lambda: tr.Qwen3_5MoeForCausalLM(tr.Qwen3_5MoeTextConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
    # RWKV-4: attention width 32, channel mix 64; 2 layers, so rescale_every (6) never rescales
    "rwkv": lambda: tr.RwkvForCausalLM(tr.RwkvConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64)),
    # Griffin: rglru, rglru, local attention (a window of 4 over 11 tokens; 4 heads, 1 kv head, RoPE on half of
    # each head), RG-LRU width 32 in 4 blocks, GeGLU of 48, logits soft-capped at 30, tied output
    "recurrent_gemma": lambda: tr.RecurrentGemmaForCausalLM(tr.RecurrentGemmaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, lru_width=32, attention_window_size=4, conv1d_width=4)),
    # Bamba: mamba2 (4 heads of 16, 2 groups, state 8) and attention (4 heads, 2 kv, RoPE on half of each head of
    # 8) alternate (mixer_pattern of period 2), a SwiGLU of 48 after each
    "bamba": lambda: tr.BambaForCausalLM(tr.BambaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4)),
    # Nemotron-H "M*-E" (no period): one sublayer a layer, mamba2 (as Bamba's), attention without positions, a
    # squared-ReLU MLP of 48, MoE: 4 ungated experts of 16, top-2 from the better of 2 groups by sigmoid scores
    # with a non-zero balancing bias, a shared expert of 24
    "nemotron_h": lambda: _router_bias(tr.NemotronHForCausalLM(tr.NemotronHConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, hybrid_override_pattern="M*-E", num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2,
        conv_kernel=4, chunk_size=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1))),
    # conv, attention, conv, conv (layer_types of no period but 4): 4 heads, 2 kv heads of 8 with RMSNorm per
    # head, convolutions of 3 taps with biases; a SwiGLU whose width HF adjusts (2/3 of 96, times 1.5, up to a
    # multiple of 16: 96), untied output
    "lfm2": lambda: tr.Lfm2ForCausalLM(tr.Lfm2Config(
        vocab_size=V, hidden_size=32, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "conv"], conv_L_cache=3,
        conv_bias=True, block_multiple_of=16, block_ffn_dim_multiplier=1.5, tie_word_embeddings=False)),
    # Mamba (E = 64, state 8, dt rank 4, projection biases) with weightless norms on dt, B and C (eps 1e-3, not
    # the blocks' 1e-5, so a mix-up shows)
    "falcon_mamba": lambda: tr.FalconMambaForCausalLM(tr.FalconMambaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=4,
        use_bias=True, mixer_rms_eps=1e-3)),
    # Granite 4.0-H: mamba2 (4 heads of 16, 2 groups, state 8), attention with RoPE (4 heads, 2 kv), mamba2,
    # mamba2; 4 experts top-2 of 16 beside an ungated shared MLP of 24; µP multipliers away from 1
    "granite_moe_hybrid": lambda: tr.GraniteMoeHybridForCausalLM(tr.GraniteMoeHybridConfig(
        vocab_size=V, hidden_size=32, intermediate_size=16, shared_intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["linear_attention", "full_attention",
                                                                   "linear_attention", "linear_attention"],
        num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_chunk_size=4, position_embedding_type="rope", embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=4.0)),
    # the dense variant (no experts: the shared MLP alone) without positions, attention first
    "granite_hybrid_dense": lambda: tr.GraniteMoeHybridForCausalLM(tr.GraniteMoeHybridConfig(
        vocab_size=V, hidden_size=32, shared_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, layer_types=["full_attention", "linear_attention"], num_local_experts=0,
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, position_embedding_type="nope",
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=6.0)),
    # Falcon-H1: attention (4 heads, 2 kv of 8, RoPE) and mamba2 (3 heads of 16: 48 channels, not a multiple of
    # the width 32; state 8) from one norm in every layer, summed; silu(z) gating without a norm (HF's default);
    # every µP multiplier away from 1 and from each other
    "falcon_h1": lambda: falcon_h1(),
    # MiniMax-01: lightning, attention (4 heads, 2 kv of 8, RoPE), lightning, lightning; 4 experts top-2 of 16;
    # every alpha (skip) and beta (branch) factor away from 1 and from each other
    "minimax": lambda: tr.MiniMaxForCausalLM(tr.MiniMaxConfig(
        vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        full_attn_alpha_factor=1.5, full_attn_beta_factor=0.7, linear_attn_alpha_factor=0.8,
        linear_attn_beta_factor=1.3, mlp_alpha_factor=0.9, mlp_beta_factor=1.1, eos_token_id=None)),
    # Kimi Linear: KDA (2 heads of 8, a decay per channel), MLA without positions (2 heads, latent 8, shared key
    # part 4), KDA, KDA; the first layer dense, then 4 experts top-2 chosen in the best of 2 groups, a shared expert
    "kimi_linear": lambda: _router_bias(tr.KimiLinearForCausalLM(tr.KimiLinearConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, linear_head_dim=8,
        linear_num_heads=2, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        eos_token_id=None, pad_token_id=0, bos_token_id=1))),
    # xLSTM: two mLSTM blocks of D 128 (4 heads: q, k 16 wide, v 32), the gates soft-capped, logits capped at 30;
    # transformers' kernels in fp32 (its default rounds q, k and v to bf16); its cache sizes need widths of 64s
    "xlstm": lambda: tr.xLSTMForCausalLM(tr.xLSTMConfig(
        vocab_size=V, hidden_size=128, num_hidden_layers=2, num_heads=4, autocast_kernel_dtype="float32",
        chunk_size=4, eos_token_id=None, pad_token_id=0, bos_token_id=1)),
    # Zamba2: mamba2, hybrid, hybrid, mamba2, hybrid (mamba2: 4 heads of 16, 2 groups, state 8, biases); the hybrids
    # fed by 2 shared blocks in turn (block 0 at two uses), each use with its own rank-4 adapters on q, k, v and
    # the fused gate/up and its own linear; the blocks' attention 4 heads of 16 over [x, embeddings] with RoPE
    "zamba2": lambda: tr.Zamba2ForCausalLM(tr.Zamba2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
        layers_block_type=["mamba", "hybrid", "hybrid", "mamba", "hybrid"], mamba_d_state=8, n_mamba_heads=4,
        mamba_ngroups=2, add_bias_linear=True, num_mem_blocks=2, use_shared_attention_adapter=True,
        use_shared_mlp_adapter=True, adapter_rank=4, use_mem_rope=True, chunk_size=4, eos_token_id=None)),
}


def falcon_h1(**fields):
    return tr.FalconH1ForCausalLM(tr.FalconH1Config(**{**dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_d_ssm=48, mamba_n_heads=3, mamba_d_head=16, mamba_d_state=8,
        mamba_d_conv=4, mamba_chunk_size=4, lm_head_multiplier=0.5, embedding_multiplier=3.0, mlp_multipliers=[0.7, 1.3],
        key_multiplier=0.6, attention_in_multiplier=1.5, attention_out_multiplier=0.8,
        ssm_multipliers=[0.5, 1.2, 0.9, 1.1, 0.4], ssm_in_multiplier=0.75, ssm_out_multiplier=1.25,
        eos_token_id=None), **fields}))  # no end token: generate runs all its steps


def _router_bias(model):
    """The MoE routers' balancing biases (buffers, which `randomize` leaves at zero) set to random values."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return model


# transformers 5.24's RwkvForCausalLM given one token and a state mixes its [B, D] token shift into [B, B, D]
# for B > 1, so its batched generate is wrong from the second new token: compared one prompt at a time.
ONE_ROW_GENERATE = ("rwkv",)
SAME_CONFIG = ("qwen3_5", "qwen3_5_moe")  # families whose tfm config an earlier class also writes
# packed = alone through the HF conversion: the 2025-26 hybrids (the older mixers' packing: tests/test_context_mixers.py)
PACKED = ("lfm2", "falcon_mamba", "granite_moe_hybrid", "granite_hybrid_dense", "falcon_h1",
          "minimax", "kimi_linear", "xlstm", "zamba2")


def tokens(seed, shape=(B, T)):
    return np.random.default_rng(seed).integers(1, V - 1, shape)


MASK = (np.arange(T)[None] < np.array([[T], [7]])).astype(np.int64)  # right padding on row 1


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """One family's HF model, its save_pretrained directory, and one conversion (chunks of 4) whose forward
    is compiled once for every test of the family."""
    torch.manual_seed(0)
    hf = randomize(FAMILIES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    cfg, params, model = from_hf(hf, mixer_chunk_size=4)
    forward = jax.jit(lambda ids, segment_ids, positions=None: model.apply(
        {"params": params}, ids, segment_ids=segment_ids, positions=positions).logits)
    return request.param, hf, str(path), (cfg, params, model, forward)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_logits_match_hf(family):
    """Logits from the live model's conversion match transformers' (1e-4); the saved directory's
    conversion gives the same config and bit-identical parameters."""
    name, hf, path, (cfg, params, _, forward) = family
    ids = tokens(1)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(MASK)).logits.numpy()
    diff = max_abs(forward(jnp.asarray(ids), jnp.asarray(MASK)), ref, MASK)
    print(f"{name} max-abs {diff:.2e}")
    assert diff < TOL, (name, diff)
    cfg_dir, params_dir, _ = from_hf(path, mixer_chunk_size=4)
    assert cfg_dir == cfg
    jax.tree.map(np.testing.assert_array_equal, params_dir, params)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_prompt_continued_from_the_cache_equals_the_whole(family):
    """The first 6 tokens through the cache in one call (chunked), then one token a step (the recurrent
    form): every logit equals the full forward's (1e-5)."""
    name, _, _, (cfg, params, model, forward) = family
    ids = jnp.asarray(tokens(2))
    diff = max_abs(decode_in_steps(model, params, ids, 6), forward(ids, jnp.ones_like(ids)))
    assert diff < 1e-5, (name, diff)


def decode_in_steps(model, params, ids, first):
    """The logits [B, T, V] of `ids` [B, T] run through the decode cache: the first `first` tokens in one call,
    then one token a step."""
    step = jax.jit(decode.step_fn(model, params))
    cache = decode.init_cache(model, params, *ids.shape)
    logits, cache = step(cache, ids[:, :first])
    steps = [logits]
    for t in range(first, ids.shape[1]):
        logits, cache = step(cache, ids[:, t:t + 1])
        steps.append(logits)
    return jnp.concatenate(steps, 1)


@pytest.mark.parametrize("family", sorted(PACKED), indirect=True)
def test_packed_row_equals_its_sequences_alone(family):
    """Two sequences (5 and 4 tokens) packed in one row, positions restarting, then padding: each sequence's
    logits as run alone (1e-5)."""
    name, _, _, (_, _, _, forward) = family
    ids = tokens(4, (1, T))
    seg = jnp.asarray([[1] * 5 + [2] * 4 + [0] * (T - 9)])
    pos = jnp.asarray([list(range(5)) + list(range(4)) + [0] * (T - 9)])
    packed = forward(jnp.asarray(ids), seg, pos)
    pad = lambda x: jnp.pad(jnp.asarray(x), ((0, 0), (0, T - x.shape[1])))
    for lo, hi in ((0, 5), (5, 9)):
        n = hi - lo
        alone = forward(pad(ids[:, lo:hi]), pad(np.ones((1, n), np.int32)), pad(np.arange(n)[None]))
        diff = max_abs(packed[:, lo:hi], alone[:, :n])
        assert diff < 1e-5, (name, lo, diff)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_greedy_decoding_equals_transformers_generate(family):
    name, hf, _, (cfg, params, model, _) = family
    prompt = tokens(3, (B, 5))
    rows = [prompt[i:i + 1] for i in range(B)] if name in ONE_ROW_GENERATE else [prompt]
    with torch.no_grad():
        ref = np.concatenate([hf.generate(torch.tensor(p), attention_mask=torch.ones(p.shape, dtype=torch.long),
                                          max_new_tokens=8, do_sample=False, pad_token_id=0)[:, 5:].numpy()
                              for p in rows])
    ours = jax.jit(functools.partial(decode.sample_lm, model, params, max_new_tokens=8, greedy=True))(
        jnp.asarray(prompt), rng=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(ours), ref)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_export_reloads_in_transformers_bit_identical(family, tmp_path):
    """to_hf's directory loads in the family's class bit-identically. A Qwen3.5 config is also Qwen3-Next's (their
    layers differ only in how the checkpoint fuses projections): to_hf writes Qwen3-Next unless told."""
    name, hf, _, (cfg, params, _, _) = family
    directory = to_hf(cfg, params, tmp_path / name, architecture=type(hf).__name__ if name in SAME_CONFIG else None)
    reloaded, info = type(hf).from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = reloaded.state_dict()
    for key, tensor in hf.state_dict().items():
        if tensor.is_floating_point():
            assert torch.equal(state[key], tensor), key


@pytest.mark.parametrize("before_gate, gate_norm", [(True, "norm_first"), (False, "gate_first")])
def test_falcon_h1_gated_norms_match_hf(before_gate, gate_norm):
    """Falcon-H1 with mamba_rms_norm: the gated RMSNorm before or after the gate (mamba2.gate_norm), logits
    within 1e-4 of transformers' on the padded batch."""
    torch.manual_seed(0)
    hf = randomize(falcon_h1(num_hidden_layers=1, mamba_rms_norm=True, mamba_norm_before_gate=before_gate))
    cfg, params, model = from_hf(hf, mixer_chunk_size=4)
    assert cfg.mamba2.gate_norm == gate_norm
    ids = tokens(1)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(MASK)).logits.numpy()
    ours = model.apply({"params": params}, jnp.asarray(ids), segment_ids=jnp.asarray(MASK)).logits
    assert max_abs(ours, ref, MASK) < TOL


def test_zamba2_scanned_shared_blocks_match_hf_and_count_once():
    """Zamba2 with mamba2, hybrid, hybrid repeated twice and 2 shared blocks: scanned (two repeats, each starting at
    block 0) under remat, its logits match transformers' (1e-4); the blocks' parameters are stored once (the
    Stack's `shared_block_{b}`, not per repeat), so tfm's parameters number transformers' (tied counted once)."""
    torch.manual_seed(0)
    hf = randomize(tr.Zamba2ForCausalLM(tr.Zamba2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
        layers_block_type=["mamba", "hybrid", "hybrid"] * 2, mamba_d_state=8, n_mamba_heads=4, num_mem_blocks=2,
        use_shared_attention_adapter=True, use_shared_mlp_adapter=True, adapter_rank=4, chunk_size=4,
        eos_token_id=None)))
    cfg, params, model = from_hf(hf, mixer_chunk_size=4, scan_layers=True, remat_policy="full")
    assert cfg.mixer_pattern == ("mamba2", "shared>mamba2", "shared>mamba2")
    assert sorted(params["decoder"]) == ["final_norm", "layers", "shared_block_0", "shared_block_1"]
    assert sum(x.size for x in jax.tree.leaves(params)) == sum(p.numel() for p in hf.parameters())
    ids = tokens(1)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(MASK)).logits.numpy()
    logits = jax.jit(lambda ids, seg: model.apply({"params": params}, ids, segment_ids=seg).logits)(ids, MASK)
    assert max_abs(logits, ref, MASK) < TOL


# Published sizes: tfm's preset against the same model built by transformers on the meta device.
PUBLISHED = {
    "mamba2_2_7b": lambda: tr.Mamba2ForCausalLM(tr.Mamba2Config(
        hidden_size=2560, num_hidden_layers=64, vocab_size=50288, state_size=128, head_dim=64, num_heads=80,
        n_groups=1, expand=2, tie_word_embeddings=True)),
    "jamba_1_5_mini": lambda: tr.JambaForCausalLM(tr.JambaConfig()),
    "qwen3_next_80b_a3b": lambda: tr.Qwen3NextForCausalLM(tr.Qwen3NextConfig()),
    "recurrentgemma_2b": lambda: tr.RecurrentGemmaForCausalLM(tr.RecurrentGemmaConfig(num_key_value_heads=1)),
    "nemotron_h_8b": lambda: tr.NemotronHForCausalLM(tr.NemotronHConfig(
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_size_counts_the_parameters_transformers_does(name):
    """The preset's parameters (jax.eval_shape, nothing allocated) number exactly what transformers
    builds for the published config (on torch's meta device)."""
    from tfm.models import DecoderLM, presets
    with torch.device("meta"):
        hf = sum(p.numel() for p in PUBLISHED[name]().parameters())
    cfg = presets.PRESETS[name]()
    shapes = jax.eval_shape(lambda: DecoderLM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
    assert sum(x.size for x in jax.tree.leaves(shapes["params"])) == hf
