"""tfm.ops.ssd: both impls of both scans against float64 NumPy loops written here from the recurrences
(values, and central differences of the loop for gradients), and the segment rules: packed rows,
padding on either side, continuation from a final state, log decays that a naive form overflows.

Tolerances: fp32 inputs within 1e-5 (relative and absolute) of float64 (errors seen: 3e-7); bf16
inputs (the loop reading the same rounded values) within 1e-2 for y, which is rounded to bf16
(relative step 2^-8; errors seen: 3e-3), while the float32 final state stays within 1e-5; fp32
gradients: chunked within 1e-4 of reference (relative to the gradient's largest entry), and each
one's derivative along a random direction within 1e-4 of the float64 loop's (relative to the
sum of the absolute terms of that derivative)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.ops import ssd as ssd_lib

CHUNK = 4  # T = 13 is no multiple of it: the chunked forms pad the last chunk
T = 13
PACKED = np.array([[1] * 5 + [2] * 6 + [0] * 2,  # two sequences, then right padding
                   [0] * 3 + [7] * 10])  # left padding, one sequence
IMPLS = ("reference", "chunked")

ssd = jax.jit(ssd_lib.ssd, static_argnames=("impl", "chunk_size"))
selective_scan = jax.jit(ssd_lib.selective_scan, static_argnames=("impl", "chunk_size"))
SCANS = {"ssd": ssd, "selective": selective_scan}


def _keep(seg, i, b):
    """[B, 1] floats: 1 where token i's dt counts (no padding); 1 where the state before it survives."""
    if seg is None:
        return np.ones((b, 1)), np.ones((b, 1))
    real = seg[:, i] != 0
    start = real & (seg[:, i] != seg[:, i - 1]) if i else np.zeros_like(real)
    return real[:, None].astype(np.float64), ~start[:, None] + 0.0


def ssd_loop(x, dt, A, B, C, seg=None, h0=None):
    """The SSD recurrence token by token, in float64 NumPy."""
    b, t, n, p = x.shape
    r = n // B.shape[2]
    B, C = np.repeat(B, r, axis=2), np.repeat(C, r, axis=2)  # head n reads group n // r
    h = np.zeros((b, n, p, B.shape[3])) if h0 is None else h0
    ys = []
    for i in range(t):
        real, survives = _keep(seg, i, b)
        d = dt[:, i] * real  # [B, N]
        decay = np.exp(d * A) * survives
        h = decay[:, :, None, None] * h + (d[:, :, None] * x[:, i])[..., None] * B[:, i, :, None, :]
        ys.append(np.einsum("bnps,bns->bnp", h, C[:, i]))
    return np.stack(ys, 1), h


def selective_loop(x, dt, A, B, C, seg=None, h0=None):
    """The selective-scan recurrence token by token, in float64 NumPy."""
    b, t, e = x.shape
    h = np.zeros((b, e, A.shape[1])) if h0 is None else h0
    ys = []
    for i in range(t):
        real, survives = _keep(seg, i, b)
        d = dt[:, i] * real  # [B, E]
        h = np.exp(d[..., None] * A) * survives[..., None] * h + (d * x[:, i])[..., None] * B[:, i, None, :]
        ys.append(np.einsum("bes,bs->be", h, C[:, i]))
    return np.stack(ys, 1), h


LOOPS = {"ssd": ssd_loop, "selective": selective_loop}


def make_inputs(scan, seed=0, b=2, t=T, dt_range=(0.05, 1.0), a_range=(0.5, 2.0)):
    """float64 (x, dt, A, B, C, initial_state): ssd with N=4 heads in G=2 groups, P=3, S=5; selective E=6, S=5."""
    rng = np.random.default_rng(seed)
    s = 5
    if scan == "ssd":
        n, p, g = 4, 3, 2
        shapes = (b, t, n, p), (b, t, n), (n,), (b, t, g, s), (b, n, p, s)
    else:
        e = 6
        shapes = (b, t, e), (b, t, e), (e, s), (b, t, s), (b, e, s)
    x_shape, dt_shape, a_shape, bc_shape, h_shape = shapes
    return (rng.standard_normal(x_shape), rng.uniform(*dt_range, dt_shape), -rng.uniform(*a_range, a_shape),
            rng.standard_normal(bc_shape), rng.standard_normal(bc_shape), rng.standard_normal(h_shape))


def run(scan, impl, inputs, seg=None, dtype=jnp.float32, with_state=True):
    x, dt, A, B, C, h0 = (jnp.asarray(a, dtype) for a in inputs)
    return SCANS[scan](x, dt, A, B, C, segment_ids=None if seg is None else jnp.asarray(seg),
                       initial_state=h0 if with_state else None, impl=impl, chunk_size=CHUNK)


def close(got, want, tol):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scan", SCANS)
def test_matches_float64_loop(scan, impl):
    inputs = make_inputs(scan)
    want_y, want_h = LOOPS[scan](*inputs[:5], h0=inputs[5])
    y, h = run(scan, impl, inputs)
    assert y.dtype == jnp.float32 and h.dtype == jnp.float32
    close(y, want_y, 1e-5)
    close(h, want_h, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scan", SCANS)
def test_bf16_inputs_keep_float32_state(scan, impl):
    inputs = make_inputs(scan, seed=1)
    rounded = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in inputs]
    want_y, want_h = LOOPS[scan](*rounded[:5], h0=rounded[5])
    y, h = run(scan, impl, inputs, dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    close(y, want_y, 1e-2)
    close(h, want_h, 1e-5)


def _loss(fn, weights):
    """A scalar reading every real output and the final state, for gradients."""
    wy, wh = weights
    def loss(*args):
        y, h = fn(*args)
        return (y * wy).sum() + (h * wh).sum()
    return loss


@pytest.mark.parametrize("scan", SCANS)
def test_gradients_match_reference_and_float64(scan):
    """Through PACKED's resets and padding, from an initial state, with log decays near -100 a step in row 1's second
    chunk (where exp of a negated running sum would overflow): the gradients w.r.t. x, dt, A, B, C and initial_state
    are finite, chunked = reference, and both agree with the float64 loop's directional derivatives (central
    differences) along a random direction per argument."""
    inputs = make_inputs(scan, seed=2)
    inputs[1][1, 4:8] *= 100
    rng = np.random.default_rng(3)
    want_y, want_h = LOOPS[scan](*inputs[:5], seg=PACKED, h0=inputs[5])
    real = (PACKED != 0).reshape((2, T) + (1,) * (want_y.ndim - 2))  # outputs at padding mean nothing
    weights = rng.standard_normal(want_y.shape) * real, rng.standard_normal(want_h.shape)
    grads = {}
    for impl in IMPLS:
        fn = lambda x, dt, A, B, C, h0, impl=impl: SCANS[scan](x, dt, A, B, C, segment_ids=jnp.asarray(PACKED),
                                                               initial_state=h0, impl=impl, chunk_size=CHUNK)
        f32 = (jnp.asarray(a, jnp.float32) for a in inputs)
        grads[impl] = [np.asarray(g, np.float64) for g in jax.jit(jax.grad(_loss(fn, weights), tuple(range(6))))(*f32)]
    loss = _loss(lambda *args: LOOPS[scan](*args[:5], seg=PACKED, h0=args[5]), weights)
    eps = 1e-6
    for k, name in enumerate(("x", "dt", "A", "B", "C", "initial_state")):
        direction = rng.standard_normal(inputs[k].shape)
        moved = lambda sign: [a + sign * eps * direction if i == k else a for i, a in enumerate(inputs)]
        want = (loss(*moved(1)) - loss(*moved(-1))) / (2 * eps)
        ref, chunked = grads["reference"][k], grads["chunked"][k]
        scale = np.abs(ref).max()
        assert scale > 0 and np.isfinite(ref).all() and np.isfinite(chunked).all(), name
        np.testing.assert_allclose(chunked, ref, atol=1e-4 * scale, rtol=0, err_msg=name)
        for impl, g in grads.items():
            np.testing.assert_allclose((g[k] * direction).sum(), want, atol=1e-4 * np.abs(g[k] * direction).sum(),
                                       rtol=0, err_msg=f"{name} {impl}")


def _alone(inputs, row, times):
    """(x, dt, A, B, C) of one batch row at the given time positions, as a batch of one."""
    x, dt, A, B, C, _ = inputs
    return x[row:row + 1, times], dt[row:row + 1, times], A, B[row:row + 1, times], C[row:row + 1, times]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scan", SCANS)
def test_packed_row_equals_sequences_alone(scan, impl):
    """Row 0 of PACKED holds tokens 0-4 and 5-10, then right padding; row 1 left padding, then tokens 3-12. Their
    outputs are each sequence's run alone from a zero state (the float64 loop, without segments), and each row's
    final state is its last sequence's."""
    inputs = make_inputs(scan, seed=5)
    y, h = run(scan, impl, inputs, PACKED, with_state=False)
    for row, times in ((0, slice(0, 5)), (0, slice(5, 11)), (1, slice(3, 13))):
        alone_y, alone_h = LOOPS[scan](*_alone(inputs, row, times))
        close(y[row:row + 1, times], alone_y, 1e-5)
        if times.stop >= 11:  # the row's last sequence
            close(h[row:row + 1], alone_h, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scan", SCANS)
def test_continuation_equals_one_call(scan, impl):
    """PACKED's rows in one call = tokens 0-5, then 6 (a decode step), then 7-12, each call starting from the last
    one's final state: a call's first token continues its sequence, whatever its segment id."""
    inputs = make_inputs(scan, seed=6)
    whole_y, whole_h = run(scan, impl, inputs, PACKED, with_state=False)
    x, dt, A, B, C, h = inputs
    h, ys = np.zeros_like(h), []
    for times in (slice(0, 6), slice(6, 7), slice(7, T)):
        y, h = run(scan, impl, (x[:, times], dt[:, times], A, B[:, times], C[:, times], h), PACKED[:, times])
        ys.append(np.asarray(y))
    real = PACKED != 0  # outputs at padding mean nothing
    close(np.concatenate(ys, axis=1)[real], np.asarray(whole_y, np.float64)[real], 1e-5)
    close(h, np.asarray(whole_h, np.float64), 1e-5)


@pytest.mark.parametrize("bad, match", [
    (dict(impl="triton"), "impl='triton'"),
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(dt=np.ones((1, 3, 2))), "^dt: "),
    (dict(A=-np.ones(3)), "^A: "),
    (dict(B=np.ones((1, 3, 3, 5)), C=np.ones((1, 3, 3, 5))), "^B: .*G dividing N=4"),
    (dict(C=np.ones((1, 3, 2, 4))), "^C: "),
    (dict(segment_ids=np.ones((1, 4), int)), "^segment_ids: "),
    (dict(initial_state=np.ones((1, 4, 3, 4))), "^initial_state: "),
])
def test_ssd_rejects_bad_arguments(bad, match):
    args = dict(x=np.ones((1, 3, 4, 3)), dt=np.ones((1, 3, 4)), A=-np.ones(4), B=np.ones((1, 3, 2, 5)),
                C=np.ones((1, 3, 2, 5)))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ssd_lib.ssd(**args)


@pytest.mark.parametrize("bad, match", [
    (dict(x=np.ones((1, 3))), "^x: "),
    (dict(A=-np.ones((5, 4))), "^A: "),
    (dict(B=np.ones((1, 3, 3))), "^B: "),
    (dict(initial_state=np.ones((1, 6, 5))), "^initial_state: "),
])
def test_selective_scan_rejects_bad_arguments(bad, match):
    args = dict(x=np.ones((1, 3, 6)), dt=np.ones((1, 3, 6)), A=-np.ones((6, 4)), B=np.ones((1, 3, 4)),
                C=np.ones((1, 3, 4)))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ssd_lib.selective_scan(**args)
