"""The efficient-attention config values of the one Attention layer: a low-rank value projection
(W_V = W_V_down W_V_up) and Linformer's length projection, checked by closed forms."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.models import DecoderLM, EncoderModel, presets

RNG = jax.random.PRNGKey(0)
D, N, H, L, V = 32, 4, 8, 2, 64  # presets.tiny("encoder"): K = N


def init(model, *args, **kwargs):
    return nn.meta.unbox(model.init(RNG, *args, **kwargs)["params"])


def count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def ids(shape, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 1, V)


def test_low_rank_value_counts_and_equals_the_full_projection_at_full_rank():
    """Each layer trades D*K*H value weights for r*(D + K*H); at r = D = K*H, factors W_V and the
    identity give the full model's output (1e-5)."""
    x = ids((2, 9))
    full_cfg = presets.tiny("encoder")
    full = init(EncoderModel(full_cfg), x)
    r = 8
    low = init(EncoderModel(full_cfg.replace(value_rank=r)), x)
    assert count(full) - count(low) == L * (D * N * H - r * (D + N * H))

    model = EncoderModel(full_cfg.replace(value_rank=D))
    factored = jax.tree.map(lambda a: a, full)  # a copy
    for name, layer in factored["encoder"].items():
        if not name.startswith("layer_"):
            continue
        value = layer["self_attn"].pop("value")
        layer["self_attn"]["value_down"] = {"kernel": value["kernel"].reshape(D, N * H)}
        layer["self_attn"]["value_up"] = {"kernel": jnp.eye(N * H).reshape(N * H, N, H), "bias": value["bias"]}
    jax.tree.map(lambda a, b: None, factored, init(model, x))  # the same tree as the model's own
    ref = EncoderModel(full_cfg).apply({"params": full}, x).hidden
    out = model.apply({"params": factored}, x).hidden
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_linformer_is_full_attention_under_the_identity_and_ignores_padding():
    """With P = S = max_len and the identity as the length projection, Linformer is full attention
    (1e-5); with a learned projection, what padding tokens hold never reaches the real positions."""
    cfg = presets.tiny("encoder")
    S = cfg.max_len
    x = ids((2, S))
    full = init(EncoderModel(cfg), x)
    lin_model = EncoderModel(cfg.replace(linformer_length=S))
    assert count(init(lin_model, x)) - count(full) == L * S * S
    lin = jax.tree.map(lambda a: a, full)  # a copy of the full model's params, plus the identity projections
    for name, layer in lin["encoder"].items():
        if name.startswith("layer_"):
            layer["self_attn"]["length_projection"] = jnp.eye(S)
    ref = EncoderModel(cfg).apply({"params": full}, x).hidden
    np.testing.assert_allclose(lin_model.apply({"params": lin}, x).hidden, ref, atol=1e-5)

    short = EncoderModel(cfg.replace(linformer_length=8))
    params = init(short, x)
    seg = jnp.array([[1] * S, [1] * 40 + [0] * (S - 40)])
    other = x.at[1, 40:].set(ids((S - 40,), seed=7))
    a = short.apply({"params": params}, x, segment_ids=seg).hidden
    b = short.apply({"params": params}, other, segment_ids=seg).hidden
    np.testing.assert_allclose(a[1, :40], b[1, :40], atol=1e-6)
    assert float(jnp.abs(a[0] - short.apply({"params": params}, x[:1]).hidden[0]).max()) < 1e-5


def test_linformer_is_refused_where_it_has_no_meaning():
    with pytest.raises(ValueError, match="no causal or cached form"):
        init(DecoderLM(presets.tiny("llama", linformer_length=8)), ids((1, 8)))
    with pytest.raises(ValueError, match="cannot apply to them"):
        presets.tiny("encoder", linformer_length=8, sliding_window=4)
    with pytest.raises(ValueError, match="value_rank must be >= 1"):
        presets.tiny("encoder", value_rank=0)


def test_linformer_compiled_memory_is_linear_in_length():
    """XLA's compiled temporaries of a forward + backward at S = 1024: full attention holds the
    [B, N, S, S] scores, Linformer [B, N, S, P] with P = 64 (deterministic compile-time figures)."""
    S = 1024

    def temp_bytes(cfg):
        model = EncoderModel(cfg)
        x = jnp.ones((1, S), jnp.int32)
        params = jax.eval_shape(lambda: init(model, x))
        loss = lambda p: jnp.sum(model.apply({"params": p}, x).hidden ** 2)
        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

    cfg = presets.tiny("encoder", max_len=S, num_layers=1)
    full, lin = temp_bytes(cfg), temp_bytes(cfg.replace(linformer_length=64))
    scores = N * S * S * 4
    assert full > scores and lin < full / 4, (full, lin)
