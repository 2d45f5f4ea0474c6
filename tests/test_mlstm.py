"""The mLSTM's two forms (tfm.ops.mlstm) against a float64 NumPy loop of xLSTM's recurrence written here: values
and final states in fp32 (strong gates, so the running maximum moves), packed segments and padding, gradients of
the chunked form against the recurrent one and against float64 finite differences of the loop, continuation
through the final state, and input errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_delta_rule import central_differences  # noqa: E402
from tfm.ops.mlstm import mlstm  # noqa: E402

IMPLS = ("reference", "chunked")
CHUNK, EPS = 4, 1e-6
run = jax.jit(mlstm, static_argnames=("impl", "chunk_size"))


def loop(q, k, v, i, f, segment_ids=None, state=None):
    """The recurrence in float64, token by token; a start (a real token whose id differs from the previous
    token's, t > 0) drops the state to zeros, padding (id 0) leaves it. Returns (h, (C, n, m))."""
    q, k, v, i, f = (np.asarray(x, np.float64) for x in (q, k, v, i, f))
    B, T, H, K = q.shape
    C, n, m = ((np.zeros((B, H, K, v.shape[-1])), np.zeros((B, H, K)), np.zeros((B, H))) if state is None
               else (np.array(s, np.float64) for s in state))
    h = np.zeros(v.shape)
    for b in range(B):
        for t in range(T):
            if segment_ids is not None:
                if segment_ids[b, t] == 0:
                    continue
                if t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                    C[b], n[b], m[b] = 0.0, 0.0, 0.0
            for x in range(H):
                lf = -np.log1p(np.exp(-f[b, t, x]))
                new = max(lf + m[b, x], i[b, t, x])
                decay, write = np.exp(lf + m[b, x] - new), np.exp(i[b, t, x] - new)
                C[b, x] = decay * C[b, x] + write * np.outer(k[b, t, x], v[b, t, x])
                n[b, x] = decay * n[b, x] + write * k[b, t, x]
                qs = q[b, t, x] / np.sqrt(K)
                h[b, t, x] = qs @ C[b, x] / (max(abs(qs @ n[b, x]), np.exp(-new)) + EPS)
                m[b, x] = new
    return h, (C, n, m)


def inputs(B=2, T=13, H=2, K=4, V=3, seed=0):
    """q, k, v, gate preactivations spread wide (input gates up to about +-9), an initial state; float32."""
    r = np.random.default_rng(seed)
    arrays = (*r.normal(size=(2, B, T, H, K)), r.normal(size=(B, T, H, V)), 3 * r.normal(size=(B, T, H)),
              3 * r.normal(size=(B, T, H)) + 1)
    state = (r.normal(size=(B, H, K, V)), r.normal(size=(B, H, K)), r.normal(size=(B, H)))
    return tuple(np.asarray(x, np.float32) for x in arrays), tuple(np.asarray(s, np.float32) for s in state)


# Row 0: padding, a sequence, another, padding, one token; row 1: one sequence, then another.
SEGMENTS = np.array([[0, 0, 1, 1, 1, 1, 2, 2, 2, 0, 0, 3, 0], [1] * 9 + [2] * 4], np.int32)


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_loop_fp32(impl, segments):
    args, s0 = inputs()
    seg = SEGMENTS if segments else None
    h, state = run(*args, segment_ids=seg, initial_state=s0, impl=impl, chunk_size=CHUNK)
    want_h, want_state = loop(*args, seg, s0)
    real = np.ones(SEGMENTS.shape, bool) if seg is None else seg > 0
    np.testing.assert_allclose(np.asarray(h)[real], want_h[real], rtol=1e-5, atol=1e-5)
    for got, want in zip(state, want_state):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _loss(impl, seg, weights, *args):
    h, (C, n, m) = mlstm(*args[:5], segment_ids=seg, initial_state=args[5:], impl=impl, chunk_size=CHUNK)
    return jnp.sum(h * weights[0]) + jnp.sum(C * weights[1]) + jnp.sum(n) + jnp.sum(m)


def test_chunked_gradients_match_the_recurrent_form():
    args, s0 = inputs()
    r = np.random.default_rng(1)
    weights = (r.normal(size=args[2].shape), r.normal(size=s0[0].shape))
    grads = {impl: jax.jit(jax.grad(functools.partial(_loss, impl, SEGMENTS, weights), argnums=tuple(range(8))))(
        *args, *s0) for impl in IMPLS}
    for name, got, want in zip("q k v i f C n m".split(), grads["chunked"], grads["reference"]):
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_float64_finite_differences(impl):
    """Under x64: gradients of every input and of the initial state against central differences of the loop;
    the first sequence continues the state, the second crosses a chunk boundary."""
    args, s0 = inputs(B=1, T=7, H=1, K=3, V=2, seed=2)
    args, s0 = [np.asarray(x, np.float64) for x in args], [np.asarray(s, np.float64) for s in s0]
    seg = np.array([[1, 1, 2, 2, 2, 2, 2]], np.int32)
    weights = (np.random.default_rng(3).normal(size=args[2].shape), np.random.default_rng(4).normal(size=s0[0].shape))

    def loop_loss(*a):
        h, (C, n, m) = loop(*a[:5], seg, a[5:])
        return np.sum(h * weights[0]) + np.sum(C * weights[1]) + np.sum(n) + np.sum(m)

    with jax.enable_x64(True):
        grads = jax.jit(jax.grad(functools.partial(_loss, impl, jnp.asarray(seg), weights), argnums=tuple(range(8))))(
            *map(jnp.asarray, args + s0))
    for index, (name, got) in enumerate(zip("q k v i f C n m".split(), grads)):
        np.testing.assert_allclose(got, central_differences(loop_loss, args + s0, index), rtol=1e-6, atol=1e-7,
                                   err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_continuation_equals_one_call(impl):
    """Two calls chained by the final state equal one (split inside a chunk), and so do one-token calls."""
    args, s0 = inputs()
    h, state = run(*args, initial_state=s0, impl=impl, chunk_size=CHUNK)
    for splits in ([(0, 6), (6, 13)], [(t, t + 1) for t in range(13)]):
        carried, parts = s0, []
        for lo, hi in splits:
            part, carried = run(*(x[:, lo:hi] for x in args), initial_state=carried, impl=impl, chunk_size=CHUNK)
            parts.append(part)
        np.testing.assert_allclose(np.concatenate(parts, 1), h, rtol=1e-5, atol=1e-5)
        for got, want in zip(carried, state):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_errors_name_the_problem():
    args, _ = inputs(T=5)
    with pytest.raises(ValueError, match=r"^impl='pallas' is not one of"):
        mlstm(*args, impl="pallas")
    with pytest.raises(ValueError, match=r"^mlstm takes q, k \[B, T, H, K\]"):
        mlstm(*args[:3], args[3][:, :4], args[4])
