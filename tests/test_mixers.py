"""The linear-time mixers inside models: what real data needs (packed sequences, padding), both forms,
scanned and rematerialised stacks, beam search over the recurrent cache. Tiny Mamba-2 models and a
Mamba-2 + attention hybrid (tfm.models.presets.tiny); fp32 tolerances 1e-5 unless stated."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm import decode
from tfm.config import ModelConfig
from tfm.convert.common import stack_layers
from tfm.models import DecoderLM
from tfm.models.presets import tiny

V = 64
# a tiny model per mixer: the mixer, then an attention layer (mamba2 alone, and hybrid, are tiny() presets)
MIXER_MODELS = {
    "mamba": dict(mixer_pattern=("mamba", "attention"), mamba=dict(state_size=8)),
    "gated_deltanet": dict(mixer_pattern=("gated_deltanet", "attention"),
                           deltanet=dict(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8)),
    "rwkv": dict(mixer_pattern=("rwkv", "attention"), ffn_pattern=("rwkv", "dense")),
    "rglru": dict(mixer_pattern=("rglru", "attention")),
    "kda": dict(mixer_pattern=("kda", "attention"), kda=dict(heads=2, head_dim=8)),
    "mlstm": dict(mixer_pattern=("mlstm", "attention"), mlstm=dict(heads=2)),
}


def family_config(family):
    if family in MIXER_MODELS:
        return tiny("llama", mixer_chunk_size=4, **MIXER_MODELS[family])
    return tiny(family)


def init(cfg, T=12, seed=0):
    model = DecoderLM(cfg)
    params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, T), jnp.int32))["params"]
    return model, nn.meta.unbox(params)


def ids(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(1, V, shape), jnp.int32)


@pytest.mark.parametrize("family", ["mamba2", "hybrid"] + sorted(MIXER_MODELS))
def test_packed_row_equals_its_sequences_alone(family):
    """Two sequences (5 and 4 tokens) and 3 padding tokens in one row give each sequence's logits run
    alone: the state, the convolution window and the token shift reset at the boundary, padding adds to
    nothing (every mixer, chunks of 4)."""
    model, params = init(family_config(family))
    a, b, tail = ids(1, (1, 5)), ids(2, (1, 4)), ids(3, (1, 8))
    # row 0 packed; rows 1 and 2 each sequence alone, followed by tokens that causality keeps out of its logits
    rows = jnp.concatenate([jnp.concatenate([a, b, jnp.zeros((1, 3), jnp.int32)], 1),
                            jnp.concatenate([a, tail[:, :7]], 1), jnp.concatenate([b, tail], 1)])
    seg = jnp.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12, [1] * 12])
    pos = jnp.array([list(range(5)) + list(range(4)) + [0] * 3, list(range(12)), list(range(12))])
    logits = jax.jit(model.apply)({"params": params}, rows, segment_ids=seg, positions=pos).logits
    np.testing.assert_allclose(logits[0, :5], logits[1, :5], atol=1e-5)
    np.testing.assert_allclose(logits[0, 5:9], logits[2, :4], atol=1e-5)


@pytest.mark.parametrize("family", ["mamba2", "hybrid"])
def test_left_padding_equals_unpadded(family):
    model, params = init(tiny(family))
    x = ids(3, (1, 7))
    padded = jnp.concatenate([jnp.zeros((1, 4), jnp.int32), x], 1)
    seg = jnp.array([[0] * 4 + [1] * 7])
    pos = jnp.array([[0] * 4 + list(range(7))])
    apply = jax.jit(model.apply)
    got = apply({"params": params}, padded, segment_ids=seg, positions=pos).logits[:, 4:]
    np.testing.assert_allclose(got, apply({"params": params}, x).logits, atol=1e-5)


def test_chunked_form_equals_recurrent_form_values_and_gradients():
    """mixer_impl="chunked" (chunks of 4 over 11 tokens) and "reference" (a scan over time) give the same
    loss and parameter gradients on a hybrid (1e-5 relative to the largest gradient)."""
    cfg = tiny("hybrid")
    _, params = init(cfg)
    x = ids(4, (2, 11))

    def loss(params, impl):
        logits = DecoderLM(cfg.replace(mixer_impl=impl)).apply({"params": params}, x).logits
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3])

    (l_ref, g_ref), (l_chunk, g_chunk) = (jax.jit(jax.value_and_grad(functools.partial(loss, impl=impl)))(params)
                                          for impl in ("reference", "chunked"))
    np.testing.assert_allclose(l_chunk, l_ref, atol=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g_ref))
    for got, want in zip(jax.tree.leaves(g_chunk), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(got, want, atol=1e-5 * scale)


def test_scanned_and_rematerialised_hybrid_equals_the_loop():
    """A 4-layer hybrid with a period of 2 (mamba2, attention) scanned as 2 repeats of a 2-layer group,
    with full remat, computes the looped stack's logits and gradients from the same parameters."""
    cfg = tiny("hybrid", num_layers=4)
    model, params = init(cfg)
    x = ids(5, (2, 9))
    scanned_cfg = cfg.replace(scan_layers=True, remat_policy="full")
    layers = [params["decoder"][f"layer_{i}"] for i in range(4)]
    scanned = dict(params, decoder={**stack_layers(layers, True, scanned_cfg.pattern_period),
                                    "final_norm": params["decoder"]["final_norm"]})
    loss = lambda m: jax.jit(jax.value_and_grad(lambda p: jnp.mean(m.apply({"params": p}, x).logits ** 2)))
    (l_loop, g_loop), (l_scan, g_scan) = loss(model)(params), loss(DecoderLM(scanned_cfg))(scanned)
    np.testing.assert_allclose(l_scan, l_loop, rtol=1e-6)
    g_scan_layers = g_scan["decoder"]["layers"]
    for i in range(4):
        want = g_loop["decoder"][f"layer_{i}"]
        got = jax.tree.map(lambda a: a[i // 2], g_scan_layers[f"layer_{i % 2}"])
        for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            np.testing.assert_allclose(g, w, atol=1e-6)


def test_bfloat16_stays_close_to_float32():
    cfg = tiny("hybrid")
    model, params = init(cfg)
    x = ids(6, (2, 11))
    ref = model.apply({"params": params}, x).logits
    got = DecoderLM(cfg.replace(dtype="bfloat16")).apply({"params": params}, x).logits
    assert np.isfinite(np.asarray(got)).all()
    assert float(jnp.abs(got - ref).max()) < 0.1 * float(jnp.abs(ref).max())


def test_beam_search_reorders_the_recurrent_state():
    """Each returned hypothesis's score is its log-probability under a full forward pass divided by the
    length penalty: a beam continued from another beam's recurrent state would not score so."""
    cfg = tiny("hybrid")
    model, params = init(cfg, T=8)
    W, L, bos = 3, 6, ids(7, (2,))
    cache = decode.init_cache(model, params, 2 * W, L)
    search = lambda cache, bos: decode.beam_search(decode.step_fn(model, params), cache, bos, L, beam_size=W,
                                                   eos_id=V + 1, alpha=0.6)
    tokens, scores = jax.jit(search)(cache, bos)
    seqs = jnp.concatenate([jnp.repeat(bos[:, None, None], W, 1), tokens], -1).reshape(2 * W, L + 1)
    logp = jax.nn.log_softmax(model.apply({"params": params}, seqs[:, :-1]).logits)
    total = jnp.take_along_axis(logp, seqs[:, 1:, None], -1)[..., 0].sum(-1).reshape(2, W)
    np.testing.assert_allclose(scores, total / decode.length_penalty(L, 0.6), atol=1e-5)


def test_mixer_settings_are_validated_in_one_line():
    base = dict(vocab_size=V, d_model=32, num_heads=4, num_layers=2, d_ff=64)
    with pytest.raises(ValueError, match="mixer_pattern has unknown kinds"):
        ModelConfig(**base, mixer_pattern=("mamba3",))
    with pytest.raises(ValueError, match="does not divide num_layers"):
        ModelConfig(**base, mixer_pattern=("mamba2", "mamba2", "attention"))
    with pytest.raises(ValueError, match="mamba2 has no field"):
        ModelConfig(**base, mixer_pattern=("mamba2",), mamba2=dict(heads=3))
    with pytest.raises(ValueError, match="mixer_impl"):
        ModelConfig(**base, execution=dict(mixer_impl="triton"))
    with pytest.raises(ValueError, match="'moe' layers but num_experts=0"):
        ModelConfig(**base, ffn_pattern=("dense", "moe"))
