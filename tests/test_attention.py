"""The attention entry point: xla against a brute-force loop, chunked against xla (values and
gradients), masks, ALiBi slopes and input errors."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.ops.attention import alibi_slopes, dot_product_attention

B, N, H = 2, 4, 8
CASES = {
    "bidirectional": dict(),
    "causal": dict(causal=True),
    "padding": dict(segments=True, packed=False),
    "segments": dict(causal=True, segments=True),
    "window": dict(causal=True, window=5),
    "window_bidirectional": dict(window=4),
    "gqa": dict(causal=True, K=2),
    "mqa": dict(causal=True, K=1),
    "alibi": dict(causal=True, alibi=True),
    "softcap": dict(causal=True, softcap=1.5),
    "cross": dict(T=13, S=29),
    "cross_segments": dict(T=13, S=29, segments=True),
}


def make_inputs(T=29, S=None, K=N, segments=False, packed=True, seed=0, **_):
    S = T if S is None else S
    r = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(r[0], (B, T, N, H))
    k = jax.random.normal(r[1], (B, S, K, H))
    v = jax.random.normal(r[2], (B, S, K, H))
    kw = {}
    if segments:
        def ids(L, cuts):
            row = np.zeros(L, np.int32)
            for seg, (a, b) in enumerate(cuts, start=1):
                row[a:b] = seg if packed else 1
            return row
        kw["q_segment_ids"] = jnp.asarray([ids(T, [(0, T // 2), (T // 2, T - 3)]), ids(T, [(0, T)])])
        kw["kv_segment_ids"] = jnp.asarray([ids(S, [(0, S // 2), (S // 2, S - 2)]), ids(S, [(0, S - 5)])])
    return q, k, v, kw


def attention_kwargs(case):
    kw = {key: case[key] for key in ("causal", "window", "softcap") if key in case}
    if case.get("alibi"):
        kw["alibi_slopes"] = alibi_slopes(N)
    return kw


def brute_force(q, k, v, causal=False, window=None, softcap=None, alibi_slopes=None,
                q_segment_ids=None, kv_segment_ids=None):
    """Loop over every (b, n, t): the definition in tfm/ops/attention.py, written out."""
    q, k, v = map(np.asarray, (q, k, v))
    Bq, T, Nq, Hq = q.shape
    S, K = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    for b, n, t in itertools.product(range(Bq), range(Nq), range(T)):
        kv = n // (Nq // K)
        logits, visible = [], []
        for s in range(S):
            x = q[b, t, n] @ k[b, s, kv] / np.sqrt(Hq)
            if softcap is not None:
                x = softcap * np.tanh(x / softcap)
            if alibi_slopes is not None:
                x -= float(alibi_slopes[n]) * abs(t - s)
            ok = (not causal or s <= t) and (window is None or (t - s if causal else abs(t - s)) < window)
            if kv_segment_ids is not None:
                ok &= kv_segment_ids[b, s] != 0 and q_segment_ids[b, t] == kv_segment_ids[b, s]
            logits.append(x)
            visible.append(ok)
        logits, visible = np.array(logits), np.array(visible)
        if visible.any():
            p = np.exp(logits - logits[visible].max()) * visible
            out[b, t, n] = (p / p.sum()) @ v[b, :, kv]
    return out


@pytest.mark.parametrize("name", ["causal", "segments", "window", "window_bidirectional", "gqa", "alibi",
                                  "softcap", "cross_segments"])
def test_xla_matches_brute_force(name):
    case = CASES[name]
    q, k, v, seg = make_inputs(**case)
    kw = attention_kwargs(case)
    got = dot_product_attention(q, k, v, impl="xla", **kw, **seg)
    want = brute_force(q, k, v, **kw, **{key: np.asarray(x) for key, x in seg.items()})
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_matches_xla_values_and_gradients(name):
    case = CASES[name]
    q, k, v, seg = make_inputs(**case)
    kw = attention_kwargs(case)

    def loss(impl):
        def f(q, k, v):
            o = dot_product_attention(q, k, v, impl=impl, chunk_size=8, **kw, **seg)  # 8 does not divide 29
            return jnp.sum(o * jnp.cos(o)), o
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    (_, o_ref), g_ref = loss("xla")(q, k, v)
    (_, o), g = loss("chunked")(q, k, v)
    assert float(jnp.max(jnp.abs(o - o_ref))) <= 1e-5
    for got, want in zip(g, g_ref):
        assert float(jnp.max(jnp.abs(got - want))) <= 1e-5


@pytest.mark.parametrize("impl", ["xla", "chunked"])
def test_fully_masked_rows_are_zero_not_nan(impl):
    q, k, v, seg = make_inputs(segments=True)
    o = dot_product_attention(q, k, v, impl=impl, chunk_size=8, **seg)
    g = jax.grad(lambda q: dot_product_attention(q, k, v, impl=impl, chunk_size=8, **seg).sum())(q)
    padding_rows = np.asarray(seg["q_segment_ids"]) == 0
    assert padding_rows.sum() == 3
    assert np.all(np.asarray(o)[padding_rows] == 0.0)
    assert np.isfinite(np.asarray(g)).all()


def test_alibi_slopes_closed_form():
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -i for i in range(1, 9)], rtol=1e-6)
    # 6 heads: the 4-head geometric series, then every other slope of the 8-head series
    np.testing.assert_allclose(alibi_slopes(6), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3], rtol=1e-6)


def test_attention_dropout_changes_output_and_keeps_scale():
    q, k, v, _ = make_inputs()
    o = dot_product_attention(q, k, v, impl="xla")
    dropped = [dot_product_attention(q, k, v, impl="xla", dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(i))
               for i in range(200)]
    assert float(jnp.max(jnp.abs(dropped[0] - o))) > 0.1
    # inverted dropout is unbiased: the mean over many masks approaches the deterministic output
    assert float(jnp.mean(jnp.abs(jnp.mean(jnp.stack(dropped), 0) - o))) < 0.06


@pytest.mark.parametrize("bad, match", [
    (dict(k=jnp.zeros((B, 5, 3, H)), v=jnp.zeros((B, 5, 3, H))), "multiple of key/value heads"),
    (dict(v=jnp.zeros((B, 7, N, H))), "same shape"),
    (dict(q=jnp.zeros((B, 5, N))), r"\[batch, length, heads, head_dim\]"),
    (dict(impl="flash"), "unknown attention impl"),
    (dict(window=0), "window must be >= 1"),
    (dict(dropout_rate=0.1), "needs a dropout_rng"),
    (dict(q_segment_ids=jnp.ones((B, 5), jnp.int32)), "without kv_segment_ids"),
    (dict(q_segment_ids=jnp.ones((B, 4), jnp.int32), kv_segment_ids=jnp.ones((B, 5), jnp.int32)),
     r"q_segment_ids must be \[batch, 5\]"),
])
def test_attention_input_errors(bad, match):
    args = dict(q=jnp.zeros((B, 5, N, H)), k=jnp.zeros((B, 5, N, H)), v=jnp.zeros((B, 5, N, H)))
    args.update(bad)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=match):
        dot_product_attention(q, k, v, **args)
