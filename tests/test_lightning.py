"""Lightning attention (kind "lightning", MiniMax-01) against a float64 loop of its definition: values of the
recurrent, chunked and Pallas (interpreted) forms over a packed batch with padding (1e-5 of O(1) outputs),
gradients of the chunked form equal the recurrent form's (1e-5); the slopes follow MiniMax's rule per layer and
take no gradient; a hybrid decoder's prompt continued from the cache equals the whole prompt (1e-5)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_zoo_recurrent import decode_in_steps
from tfm.layers.inputs import BlockInputs
from tfm.layers.lightning import LightningAttention, slopes
from tfm.models import DecoderLM
from tfm.models.presets import tiny

B, T, D, N, H = 2, 12, 16, 2, 8
SEG = np.asarray([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3])


def _cfg(impl="chunked", **kw):
    chunk = 8 if impl == "pallas" else 4  # the interpreted kernel's smallest tile
    return tiny("llama", d_model=D, num_heads=N, num_kv_heads=N, num_layers=3, mixer_impl=impl, mixer_chunk_size=chunk,
                **kw)


def _params(layer=1):
    module = LightningAttention(_cfg(), layer_index=layer)
    x = jnp.zeros((1, 4, D))
    params = nn.meta.unbox(module.init(jax.random.PRNGKey(0), x, BlockInputs()))["params"]
    rng = np.random.default_rng(0)
    return {k: (v if k == "slope" else jax.tree.map(lambda a: a + 0.3 * rng.standard_normal(a.shape), v))
            for k, v in params.items()}


def _loop(params, x, seg):
    """The definition in float64, one token at a time, the state reset at each sequence."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = np.asarray(x, np.float64)
    silu = lambda a: a / (1 + np.exp(-a))
    q, k, v = (silu(np.einsum("btd,dnh->btnh", x, p[n]["kernel"])) for n in ("query", "key", "value"))
    out = np.zeros((B, T, N, H))
    for b in range(B):
        S = np.zeros((N, H, H))  # [N, key, value]
        for t in range(T):
            if t == 0 or seg[b, t] != seg[b, t - 1]:
                S[:] = 0
            S = np.exp(-p["slope"])[:, None, None] * S + np.einsum("nk,nv->nkv", k[b, t], v[b, t])
            out[b, t] = np.einsum("nk,nkv->nv", q[b, t], S)
    y = out.reshape(B, T, N * H)
    y = y / np.sqrt(np.mean(y * y, -1, keepdims=True) + 1e-6) * p["norm"]
    y = y / (1 + np.exp(-np.einsum("btd,de->bte", x, p["gate"]["kernel"])))
    return np.einsum("btnh,nhd->btd", y.reshape(B, T, N, H), p["out"]["kernel"])


def _apply(impl, params, x):
    module = LightningAttention(_cfg(impl), layer_index=1)
    return module.apply({"params": params}, x, BlockInputs(segment_ids=jnp.asarray(SEG)))


@pytest.mark.parametrize("impl", ["reference", "chunked", "pallas"])
def test_forms_equal_the_float64_loop(impl):
    params = _params()
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, D))
    want = _loop(params, x, SEG)
    got = np.asarray(_apply(impl, params, x))
    real = (SEG > 0)[..., None]
    np.testing.assert_allclose(got * real, want * real, atol=1e-5)
    assert np.abs(want).max() > 0.1


def test_chunked_gradients_equal_the_recurrent_forms():
    params = _params()
    x = jax.random.normal(jax.random.PRNGKey(2), (B, T, D))
    ct = jax.random.normal(jax.random.PRNGKey(3), (B, T, D)) * (SEG > 0)[..., None]
    grad = lambda impl: jax.grad(lambda p, x: jnp.sum(_apply(impl, p, x) * ct), argnums=(0, 1))(params, x)
    ref, chunked = grad("reference"), grad("chunked")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), chunked, ref)
    assert float(jnp.abs(chunked[0]["slope"]).max()) == 0.0  # the rates are fixed
    assert float(jnp.abs(chunked[0]["query"]["kernel"]).max()) > 1e-3


def test_slopes_follow_minimax_per_layer():
    """ALiBi's rates for 4 heads (1/4, 1/16, ...) on the first layer; the last layer's scaled to about 1e-5 of them."""
    alibi = np.asarray([0.25, 0.0625, 0.015625, 0.00390625])
    np.testing.assert_allclose(slopes(4, 0, 3), alibi * (1 + 1e-5), rtol=1e-6)
    np.testing.assert_allclose(slopes(4, 2, 3), alibi * (1 - 2 / (2 + 1e-5) + 1e-5), rtol=1e-4)
    np.testing.assert_allclose(_params(layer=2)["slope"], slopes(N, 2, 3))


def test_hybrid_prompt_continued_from_the_cache_equals_the_whole():
    cfg = _cfg("auto", mixer_pattern=("lightning", "lightning", "attention"))
    model = DecoderLM(cfg)
    ids = jax.random.randint(jax.random.PRNGKey(4), (B, T), 1, cfg.vocab_size)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), ids))["params"]
    full = model.apply({"params": params}, ids).logits
    np.testing.assert_allclose(decode_in_steps(model, params, ids, 6), full, atol=1e-5)
