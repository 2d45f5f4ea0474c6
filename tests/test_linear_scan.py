"""linear_scan: every impl (the Pallas kernel interpreted) against a float64 NumPy loop (fp32 and bf16), the parallel
forms' ("chunked", "pallas") gradients against the reference scan's, segment semantics (packed, padded, continued)
and input errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.ops.linear_scan import IMPLS, linear_scan

B, T, N, H = 2, 13, 2, 3
SEGMENTS = np.array([[1] * 5 + [2] * 5 + [0] * 3,                 # packed, right padding
                     [0, 0, 1, 1, 1, 0, 1, 1, 2, 2, 2, 2, 2]])    # left and inner padding
scan = jax.jit(linear_scan, static_argnames="impl")


def inputs(seed=0, shape=(B, T, N, H)):
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.5, 1.0, shape).astype(np.float32)
    b = rng.normal(size=shape).astype(np.float32)
    h0 = rng.normal(size=(shape[0],) + shape[2:]).astype(np.float32)
    return a, b, h0


def loop(a, b, segment_ids=None, h0=None):
    """The recurrence in float64, token by token, with the documented resets and padding."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    h = np.zeros((a.shape[0],) + a.shape[2:]) if h0 is None else np.array(h0, np.float64)
    out = np.zeros_like(b)
    for r in range(a.shape[0]):
        for t in range(a.shape[1]):
            if segment_ids is not None:
                if t >= 1 and segment_ids[r, t] not in (0, segment_ids[r, t - 1]):
                    h[r] = 0.0
                if segment_ids[r, t] == 0:
                    out[r, t] = h[r]
                    continue
            h[r] = a[r, t] * h[r] + b[r, t]
            out[r, t] = h[r]
    return out, h


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("segments", [False, True])
def test_matches_float64_loop(impl, segments):
    a, b, h0 = inputs()
    seg = SEGMENTS if segments else None
    h, final = scan(a, b, segment_ids=seg, initial_state=h0, impl=impl)
    want, want_final = loop(a, b, seg, h0)
    assert h.dtype == jnp.float32 and final.dtype == jnp.float32
    np.testing.assert_allclose(h, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final, want_final, rtol=1e-5, atol=1e-6)
    h, final = scan(a, b, impl=impl)  # initial_state None: zeros
    want, want_final = loop(a, b)
    np.testing.assert_allclose(h, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(final, want_final, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16(impl):
    """bf16 in, bf16 out, float32 state: within 1e-2 (bf16's rounding of h) of the float64 loop
    over the same bf16 inputs; the float32 final state within 1e-5."""
    a, b, h0 = (jnp.asarray(x, jnp.bfloat16) for x in inputs())
    h, final = scan(a, b, segment_ids=SEGMENTS, initial_state=h0, impl=impl)
    want, want_final = loop(np.float32(a), np.float32(b), SEGMENTS, np.float32(h0))
    assert h.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    np.testing.assert_allclose(np.float32(h), want, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(final, want_final, rtol=1e-5, atol=1e-5)


def test_gradients():
    """Associative gradients (of a, b and the initial state) equal the reference scan's, finite,
    across resets and padding."""
    a, b, h0 = inputs()
    w = np.random.default_rng(1).normal(size=(B, T, N, H)).astype(np.float32)
    w0 = np.random.default_rng(2).normal(size=(B, N, H)).astype(np.float32)

    def loss(impl, a, b, h0):
        h, final = linear_scan(a, b, segment_ids=SEGMENTS, initial_state=h0, impl=impl)
        return jnp.sum(h * w) + jnp.sum(final * w0)

    grads = {impl: jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2)))(a, b, h0)
             for impl in IMPLS}
    for impl in ("chunked", "pallas"):
        for got, want in zip(grads[impl], grads["reference"]):
            assert np.isfinite(got).all()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_segments(impl):
    """A packed row equals its sequences run alone, left padding equals none, and a call continued
    from another's final state equals one call over both."""
    a, b, h0 = inputs(shape=(1, T, N, H))
    run = functools.partial(scan, impl=impl)
    seg = np.array([[1] * 6 + [2] * 7])
    h, final = run(a, b, segment_ids=seg, initial_state=h0)
    first, _ = run(a[:, :6], b[:, :6], initial_state=h0)
    second, second_final = run(a[:, 6:], b[:, 6:])
    np.testing.assert_allclose(h, np.concatenate([first, second], axis=1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(final, second_final, rtol=1e-6, atol=1e-6)

    seg = np.array([[0] * 4 + [1] * 9])
    h, final = run(a, b, segment_ids=seg)
    alone, alone_final = run(a[:, 4:], b[:, 4:])
    np.testing.assert_allclose(h[:, :4], 0.0)
    np.testing.assert_allclose(h[:, 4:], alone, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(final, alone_final, rtol=1e-6, atol=1e-6)

    seg = np.array([[1] * 4 + [2] * 7 + [0] * 2])
    whole, whole_final = run(a, b, segment_ids=seg, initial_state=h0)
    head, state = run(a[:, :7], b[:, :7], segment_ids=seg[:, :7], initial_state=h0)
    tail, tail_final = run(a[:, 7:], b[:, 7:], segment_ids=seg[:, 7:], initial_state=state)
    np.testing.assert_allclose(whole, np.concatenate([head, tail], axis=1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(whole_final, tail_final, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(impl="triton"), "impl='triton'"),
    (dict(a=np.zeros((B, T, N))), "a has shape"),
    (dict(b=np.zeros((B,))), "b has shape"),
    (dict(segment_ids=np.zeros((B, T + 1), np.int32)), "segment_ids has shape"),
    (dict(initial_state=np.zeros((B, N))), "initial_state has shape"),
])
def test_errors(kwargs, match):
    a, b, _ = inputs()
    kwargs = {"a": a, "b": b, **kwargs}
    with pytest.raises(ValueError, match=match) as err:
        linear_scan(kwargs.pop("a"), kwargs.pop("b"), **kwargs)
    assert "\n" not in str(err.value)
