"""The gated delta rule, with a decay per head or per key channel (KDA): both impls against a float64 NumPy loop
written here (fp32 and bf16 inputs), chunked gradients against the reference impl's (fp32) and float64 finite differences of
the loop, packed segments and padding against sequences alone, continuation through final_state,
and input errors."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.ops.delta_rule import gated_delta_rule

IMPLS = ("reference", "chunked")
CHUNK = 4
FORMS = [("reference", False), ("chunked", False), ("chunked", True)]  # (impl, per-channel decay)
run = jax.jit(gated_delta_rule, static_argnames=("impl", "chunk_size"))


def loop(q, k, v, g, beta, segment_ids=None, initial_state=None):
    """The recurrence in float64 NumPy, one token at a time; returns (o, final_state)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    s = np.zeros((B, H, K, v.shape[-1]))
    if initial_state is not None:
        s[:] = initial_state
    o = np.zeros(v.shape)
    for b in range(B):
        for t in range(T):
            g_t, beta_t = g[b, t], beta[b, t]
            if segment_ids is not None:
                if t > 0 and segment_ids[b, t] not in (0, segment_ids[b, t - 1]):
                    s[b] = 0.0
                if segment_ids[b, t] == 0:
                    g_t, beta_t = np.zeros_like(g_t), np.zeros(H)
            for h in range(H):
                s[b, h] *= np.exp(g_t[h])[..., None]  # a scalar, or one per key channel
                s[b, h] += beta_t[h] * np.outer(k[b, t, h], v[b, t, h] - s[b, h].T @ k[b, t, h])
                o[b, t, h] = s[b, h].T @ q[b, t, h]
    return o, s


def inputs(B=2, T=13, H=2, K=4, V=3, seed=0, strong=False, per_channel=False):
    """q, k L2-normalised (q scaled by K**-0.5), v, g <= 0 ([B, T, H], or [B, T, H, K] per_channel), beta in
    (0, 1), a state, as float32. strong: some decays of -100, whose reversed spans would overflow exp in float32."""
    r = np.random.default_rng(seed)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in r.normal(size=(2, B, T, H, K)))
    g = -np.exp(r.normal(-1.0, 1.0, (B, T, H) + ((K,) if per_channel else ())))
    if strong:
        g[r.random(g.shape) < 0.3] = -100.0
    beta = 1 / (1 + np.exp(-r.normal(size=(B, T, H))))
    arrays = (q * K**-0.5, k, r.normal(size=(B, T, H, V)), g, beta, r.normal(size=(B, H, K, V)))
    return tuple(np.asarray(x, np.float32) for x in arrays)


def ids(*rows):
    """segment_ids [B, T] from rows given as (id, length) runs."""
    return np.array([np.concatenate([np.full(n, i) for i, n in row]) for row in rows], np.int32)


# Row 0: left padding, two sequences, mid and right padding; row 1: one sequence, then another.
SEGMENTS = ids([(0, 2), (1, 4), (2, 3), (0, 2), (3, 1), (0, 1)], [(1, 9), (2, 4)])


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_loop_fp32(impl, segments, per_channel):
    q, k, v, g, beta, s0 = inputs(per_channel=per_channel, strong=per_channel)
    seg = SEGMENTS if segments else None
    o, s = run(q, k, v, g, beta, segment_ids=seg, initial_state=s0, impl=impl, chunk_size=CHUNK)
    want_o, want_s = loop(q, k, v, g, beta, seg, s0)
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_loop_bf16(impl):
    """bf16 in, bf16 out, float32 state: the output within bf16 rounding of the loop run on the
    same (rounded) inputs, the state within float32 tolerance."""
    q, k, v, g, beta, s0 = (jnp.asarray(x, jnp.bfloat16) for x in inputs())
    o, s = run(q, k, v, g, beta, initial_state=s0, impl=impl, chunk_size=CHUNK)
    want_o, want_s = loop(q, k, v, g, beta, None, s0)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(o, np.float32), want_o, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5)


def _loss(impl, seg, weights, *args):
    o, s = gated_delta_rule(*args[:5], segment_ids=seg, initial_state=args[5], impl=impl,
                            chunk_size=CHUNK)
    return jnp.sum(o * weights[0]) + jnp.sum(s * weights[1])


@pytest.mark.parametrize("per_channel", [False, True])
def test_gradients_match_reference(per_channel):
    """fp32, with resets, padding and decays of -100 (exp of a reversed span, >= 100, overflows
    float32): finite, and equal."""
    args = inputs(strong=True, per_channel=per_channel)
    r = np.random.default_rng(1)
    weights = (r.normal(size=args[2].shape), r.normal(size=args[5].shape))
    grads = {impl: jax.jit(jax.grad(functools.partial(_loss, impl, SEGMENTS, weights),
                                    argnums=tuple(range(6))))(*args) for impl in IMPLS}
    names = "q k v g beta initial_state".split()
    for name, got, want in zip(names, grads["chunked"], grads["reference"]):
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("impl,per_channel", FORMS)
def test_gradients_float64_finite_differences(impl, per_channel):
    """Under x64, float64 gradients against central differences of the NumPy loop; the first
    sequence continues initial_state, the second crosses a chunk boundary and ends the row."""
    args = [np.asarray(x, np.float64) for x in inputs(B=1, T=7, H=1, K=3, V=2, seed=2, per_channel=per_channel)]
    seg = ids([(1, 2), (2, 5)])
    weights = (np.random.default_rng(3).normal(size=args[2].shape),
               np.random.default_rng(4).normal(size=args[5].shape))

    def loop_loss(*a):
        o, s = loop(*a[:5], seg, a[5])
        return np.sum(o * weights[0]) + np.sum(s * weights[1])

    with jax.enable_x64(True):
        grads = jax.jit(jax.grad(functools.partial(_loss, impl, jnp.asarray(seg), weights),
                                 argnums=tuple(range(6))))(*map(jnp.asarray, args))
        assert all(x.dtype == jnp.float64 for x in grads)
    for i, (name, got) in enumerate(zip("q k v g beta initial_state".split(), grads)):
        np.testing.assert_allclose(got, central_differences(loop_loss, args, i), rtol=1e-7, atol=1e-8, err_msg=name)


def central_differences(fn, args, i, eps=1e-6):
    """d fn(*args) / d args[i], each element by a central difference of step eps (float64 NumPy arrays)."""
    want = np.zeros(args[i].shape)
    for idx in np.ndindex(args[i].shape):
        hi, lo = [a.copy() for a in args], [a.copy() for a in args]
        hi[i][idx] += eps
        lo[i][idx] -= eps
        want[idx] = (fn(*hi) - fn(*lo)) / (2 * eps)
    return want


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_row_equals_sequences_alone(impl):
    """Row 0 packs A (continuing initial_state), B and right padding; row 1 packs A, padding and B.
    Each sequence's outputs equal it run alone, and each row ends with B's state alone (padding adds
    nothing and drops nothing)."""
    *tokens, s0 = inputs(B=1)
    a, b, pad = slice(0, 5), slice(5, 11), slice(11, 13)
    rows = [np.concatenate([np.concatenate([x[:, a], x[:, b], x[:, pad]], 1),
                            np.concatenate([x[:, a], x[:, pad], x[:, b]], 1)]) for x in tokens]
    seg = ids([(1, 5), (2, 6), (0, 2)], [(1, 5), (0, 2), (2, 6)])
    o, s = run(*rows, segment_ids=seg, initial_state=s0.repeat(2, 0), impl=impl, chunk_size=CHUNK)
    o_a, _ = run(*(x[:, a] for x in tokens), initial_state=s0, impl=impl, chunk_size=CHUNK)
    o_b, s_b = run(*(x[:, b] for x in tokens), impl=impl, chunk_size=CHUNK)
    np.testing.assert_allclose(o[:, a], o_a.repeat(2, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o[0, b], o_b[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o[1, 7:], o_b[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, s_b.repeat(2, 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,per_channel", FORMS)
def test_left_padding_equals_unpadded(impl, per_channel):
    """Padding tokens carry large positive g and beta near 1, which must count for nothing."""
    q, k, v, g, beta, _ = inputs(T=10, per_channel=per_channel)
    pad = 3
    g[:, :pad], beta[:, :pad] = 5.0, 0.99
    seg = ids(*[[(0, pad), (1, 10 - pad)]] * 2)
    o, s = run(q, k, v, g, beta, segment_ids=seg, impl=impl, chunk_size=CHUNK)
    want_o, want_s = run(*(x[:, pad:] for x in (q, k, v, g, beta)), impl=impl, chunk_size=CHUNK)
    np.testing.assert_allclose(o[:, pad:], want_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl,per_channel", FORMS)
def test_continuation_equals_one_call(impl, per_channel):
    """Two calls chained by final_state equal one (the split inside a chunk, a reset after it),
    and so do thirteen one-token calls (decoding)."""
    q, k, v, g, beta, s0 = inputs(per_channel=per_channel)
    rows = (q, k, v, g, beta)
    seg = SEGMENTS[1:].repeat(2, 0)
    for seg, splits in ((seg, [(0, 6), (6, 13)]), (None, [(t, t + 1) for t in range(13)])):
        o, s = run(*rows, segment_ids=seg, initial_state=s0, impl=impl, chunk_size=CHUNK)
        state, outs = s0, []
        for lo, hi in splits:
            part = None if seg is None else seg[:, lo:hi]
            o_part, state = run(*(x[:, lo:hi] for x in rows), segment_ids=part, initial_state=state,
                                impl=impl, chunk_size=CHUNK)
            outs.append(o_part)
        np.testing.assert_allclose(np.concatenate(outs, 1), o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state, s, rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument():
    q, k, v, g, beta, s0 = inputs(T=5)
    cases = {
        "impl": dict(impl="triton"),
        "chunk_size": dict(chunk_size=0),
        "k": dict(k=k[:, :, :1]),
        "v": dict(v=v[:, :4]),
        "g": dict(g=g[..., None]),
        "beta": dict(beta=beta[:1]),
        "segment_ids": dict(segment_ids=np.ones((2, 4), np.int32)),
        "initial_state": dict(initial_state=s0[:, :, :2]),
    }
    for name, change in cases.items():
        kw = dict(q=q, k=k, v=v, g=g, beta=beta) | change
        with pytest.raises(ValueError, match=f"^{re.escape(name)}"):
            gated_delta_rule(**kw)
