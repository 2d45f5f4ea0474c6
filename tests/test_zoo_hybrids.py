"""The 2025-26 hybrids and new token mixers against Hugging Face transformers (PyTorch, CPU, fp32): LFM2's gated
short convolutions, FalconMamba's weightless B/C/dt norms, Granite 4.0-H (Mamba-2, attention and MoE with
µP multipliers).

Each family: one tiny random HF model (every parameter perturbed) converted from the live model and from its
save_pretrained directory; logits match within max-abs 1e-4 on a right-padded batch; a packed row equals its
sequences alone (1e-5); a prompt continued from the cache equals the whole (1e-5); greedy decoding equals
transformers' `generate`, or where its cache path is in doubt its cache-free greedy loop (a full forward per
token, `REFERENCE_LOOP`); `to_hf` writes a directory transformers reloads bit-identically.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
tr = pytest.importorskip("transformers")

from test_zoo_decoders import max_abs, randomize  # noqa: E402
from test_zoo_recurrent import MASK, B, T, V, tokens  # noqa: E402
from tfm import decode  # noqa: E402
from tfm.convert import from_hf, to_hf  # noqa: E402

TOL = 1e-4

FAMILIES = {
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
}
REFERENCE_LOOP = ()  # families whose generate is compared with transformers' cache-free greedy loop


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """One family's HF model, its save_pretrained directory, and one conversion whose forward (ids,
    segment ids, positions) is compiled once for the family's tests."""
    torch.manual_seed(0)
    hf = randomize(FAMILIES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    cfg, params, model = from_hf(hf, mixer_chunk_size=4)
    forward = jax.jit(lambda ids, seg, pos=None: model.apply({"params": params}, ids, segment_ids=seg,
                                                             positions=pos).logits)
    return request.param, hf, str(path), (cfg, params, model, forward)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_logits_match_hf(family):
    """The live model's conversion matches transformers' logits (1e-4); the directory's conversion gives the same
    config and bit-identical parameters."""
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
def test_prompt_continued_from_the_cache_equals_the_whole(family):
    """6 tokens through the cache in one call, then one a step: every logit as the full forward's (1e-5)."""
    name, _, _, (_, params, model, forward) = family
    ids = jnp.asarray(tokens(2))
    full = forward(ids, jnp.ones_like(ids))
    step = jax.jit(decode.step_fn(model, params))
    cache = decode.init_cache(model, params, B, T)
    logits, cache = step(cache, ids[:, :6])
    steps = [logits]
    for t in range(6, T):
        logits, cache = step(cache, ids[:, t:t + 1])
        steps.append(logits)
    diff = max_abs(jnp.concatenate(steps, 1), full)
    assert diff < 1e-5, (name, diff)


def _reference_loop(hf, prompt, new):
    """transformers' greedy tokens by a full forward per token (no cache)."""
    ids = torch.tensor(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[:, prompt.shape[1]:].numpy()


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_greedy_decoding_equals_transformers(family):
    name, hf, _, (_, params, model, _) = family
    prompt = tokens(3, (B, 5))
    if name in REFERENCE_LOOP:
        ref = _reference_loop(hf, prompt, 8)
    else:
        with torch.no_grad():
            ref = hf.generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                              max_new_tokens=8, do_sample=False, pad_token_id=0)[:, 5:].numpy()
    ours = jax.jit(functools.partial(decode.sample_lm, model, params, max_new_tokens=8, greedy=True))(
        jnp.asarray(prompt), rng=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(ours), ref)


@pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True)
def test_export_reloads_in_transformers_bit_identical(family, tmp_path):
    name, hf, _, (cfg, params, _, _) = family
    directory = to_hf(cfg, params, tmp_path / name, architecture=type(hf).__name__)
    reloaded, info = type(hf).from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    state = reloaded.state_dict()
    for key, tensor in hf.state_dict().items():
        if tensor.is_floating_point():
            assert torch.equal(state[key], tensor), key


# Published sizes: the preset is what the converter makes of the published config, and counts what transformers builds
PUBLISHED = {
    "lfm2_1_2b": ("Lfm2ForCausalLM", lambda: tr.Lfm2Config(
        hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        full_attn_idxs=[2, 5, 8, 10, 12, 14], max_position_embeddings=128_000)),
    "falcon_mamba_7b": ("FalconMambaForCausalLM", lambda: tr.FalconMambaConfig(
        vocab_size=65_024, hidden_size=4096, num_hidden_layers=64, state_size=16, expand=2, conv_kernel=4,
        time_step_rank=256, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_size_is_the_converted_config_and_counts_what_transformers_builds(name):
    import dataclasses
    from tfm.convert import CONVERTERS
    from tfm.models import DecoderLM, presets
    arch, published = PUBLISHED[name]
    with torch.device("meta"):
        count = sum(p.numel() for p in getattr(tr, arch)(published()).parameters())
    cfg = presets.PRESETS[name]()
    converted = CONVERTERS[arch].read_config(published().to_dict(), arch)
    differ = {f.name: (getattr(cfg, f.name), getattr(converted, f.name)) for f in dataclasses.fields(cfg)
              if f.name not in ("pad_id", "execution", "max_len") and getattr(cfg, f.name) != getattr(converted, f.name)}
    assert not differ, differ
    shapes = jax.eval_shape(lambda: DecoderLM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
    assert sum(x.size for x in jax.tree.leaves(shapes["params"])) == count
    print(f"{name}: {count / 1e9:.3f}B parameters")
