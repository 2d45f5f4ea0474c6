"""wkv: every impl (the recurrence, the chunked form, the Pallas kernel interpreted) against a float64 NumPy loop
of the formula (fp32, bf16, and large keys in log space), against transformers' `rwkv_linear_attention_cpu`
(outputs and states), chunked and kernel gradients against the reference scan's, segment semantics (packed,
padded, continued) and input errors."""
import ast
import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.ops.wkv import IMPLS, wkv

B, T, C, CHUNK = 2, 13, 3, 4  # T not a multiple of the chunk
SEGMENTS = np.array([[1] * 5 + [2] * 5 + [0] * 3,                 # packed, right padding
                     [0, 0, 1, 1, 1, 0, 1, 1, 2, 2, 2, 2, 2]])    # left and inner padding
EMPTY = -1e38
run = jax.jit(wkv, static_argnames=("impl", "chunk_size"))


def inputs(seed=0, batch=B, k_mean=0.0, k_scale=1.0):
    rng = np.random.default_rng(seed)
    w = np.exp(rng.normal(-1.0, 1.0, C)).astype(np.float32)
    u = rng.normal(size=C).astype(np.float32)
    k = (k_mean + k_scale * rng.normal(size=(batch, T, C))).astype(np.float32)
    v = rng.normal(size=(batch, T, C)).astype(np.float32)
    state = (rng.normal(size=(batch, C)), rng.uniform(0.5, 2.0, (batch, C)), rng.normal(size=(batch, C)))
    state = tuple(x.astype(np.float32) for x in state)
    if batch > 1:  # the last row starts from the empty state
        state = tuple(np.concatenate([x[:-1], e]) for x, e in zip(state, empty_state(1)))
    return w, u, k, v, state


def empty_state(batch):
    return np.zeros((batch, C), np.float32), np.zeros((batch, C), np.float32), np.full((batch, C), EMPTY, np.float32)


def loop(w, u, k, v, segment_ids=None, state=None, log_space=False):
    """The formula in float64 as sums of terms e^exponent * (numerator coefficient, denominator
    coefficient): for each token, its sequence's earlier tokens, the initial state while no reset
    has dropped it, and the token itself with its bonus. log_space subtracts the largest exponent
    before exp; without it the sums are the plain formula. Returns (out, (num, den, max)) with the
    state's max the largest exponent of its terms (0 without log_space, so num and den are the sums)."""
    w, u, k, v = (np.asarray(x, np.float64) for x in (w, u, k, v))
    n0, d0, m0 = (np.full((k.shape[0], k.shape[2]), x) for x in (0.0, 0.0, EMPTY)) if state is None \
        else (np.asarray(x, np.float64) for x in state)
    one = np.ones_like(w)

    def total(terms):
        if not terms:
            return np.zeros_like(w), np.zeros_like(w), np.full_like(w, EMPTY)
        a, num, den = (np.stack(x) for x in zip(*terms))
        m = a.max(axis=0) if log_space else np.zeros_like(w)
        return (np.exp(a - m) * num).sum(0), (np.exp(a - m) * den).sum(0), m

    out, final = np.zeros_like(v), []
    for r in range(k.shape[0]):
        seen, carried = [], True  # the sequence's real tokens so far; whether the initial state counts
        for t in range(k.shape[1]):
            if segment_ids is not None and t >= 1 and segment_ids[r, t] not in (0, segment_ids[r, t - 1]):
                seen, carried = [], False
            if segment_ids is not None and segment_ids[r, t] == 0:
                continue
            n = len(seen)
            terms = [(k[r, i] - (n - 1 - j) * w, v[r, i], one) for j, i in enumerate(seen)]
            terms += [(m0[r] - n * w, n0[r], d0[r])] if carried else []
            num, den, _ = total(terms + [(u + k[r, t], v[r, t], one)])
            out[r, t] = num / den
            seen.append(t)
        n = len(seen)
        terms = [(k[r, i] - (n - 1 - j) * w, v[r, i], one) for j, i in enumerate(seen)]
        final.append(total(terms + ([(m0[r] - n * w, n0[r], d0[r])] if carried else [])))
    return out, tuple(np.stack(x) for x in zip(*final))


def unscaled(state):
    num, den, m = (np.asarray(x, np.float64) for x in state)
    return num * np.exp(m), den * np.exp(m)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("segments", [False, True])
def test_matches_float64_loop(impl, segments):
    """fp32 within 1e-5 of the plain formula in float64, from a given state and the empty one."""
    w, u, k, v, state = inputs()
    seg = SEGMENTS if segments else None
    out, final = run(w, u, k, v, segment_ids=seg, initial_state=state, impl=impl, chunk_size=CHUNK)
    want, want_final = loop(w, u, k, v, seg, state)
    assert out.dtype == jnp.float32 and all(s.dtype == jnp.float32 for s in final)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.stack(unscaled(final)), np.stack(want_final[:2]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_large_keys(impl):
    """Keys around 60 +- 30 (e^k overflows float32 from 89): the stable forms agree with a float64
    computation in log space and with each other, outputs and states within 1e-5."""
    w, u, k, v, _ = inputs(k_mean=60.0, k_scale=30.0)
    assert k.max() > 89
    out, final = run(w, u, k, v, segment_ids=SEGMENTS, impl=impl, chunk_size=CHUNK)
    want, want_final = loop(w, u, k, v, SEGMENTS, log_space=True)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(final, want_final):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    other = run(w, u, k, v, segment_ids=SEGMENTS, impl=[i for i in IMPLS if i != impl][0], chunk_size=CHUNK)
    np.testing.assert_allclose(out, other[0], rtol=1e-5, atol=1e-5)
    for got, expected in zip(final, other[1]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16(impl):
    """bf16 k and v give bf16 outputs within 1e-2 (bf16's rounding) of the float64 formula over the
    same bf16 inputs; the float32 state stays within 1e-5."""
    w, u, k, v, state = inputs()
    k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    out, final = run(w, u, k, v, segment_ids=SEGMENTS, initial_state=state, impl=impl, chunk_size=CHUNK)
    want, want_final = loop(w, u, np.float32(k), np.float32(v), SEGMENTS, state)
    assert out.dtype == jnp.bfloat16 and all(s.dtype == jnp.float32 for s in final)
    np.testing.assert_allclose(np.float32(out), want, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.stack(unscaled(final)), np.stack(want_final[:2]), rtol=1e-5, atol=1e-5)


def transformers_wkv():
    """transformers' own `rwkv_linear_attention_cpu`, compiled from its source file with torch as its
    only global: importing its module would load transformers' model stack (5 s) for one torch function."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.find_spec("transformers.models.rwkv.modeling_rwkv")
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "rwkv_linear_attention_cpu")
    namespace = {"torch": torch}
    exec(compile(ast.Module([node], type_ignores=[]), spec.origin, "exec"), namespace)
    return torch, namespace["rwkv_linear_attention_cpu"]


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_transformers(impl):
    """transformers' own CPU WKV (torch, fp32): outputs and its (num, den, max) state within 1e-5,
    over a first call from the empty state and a second continued from transformers' state."""
    torch, rwkv_linear_attention_cpu = transformers_wkv()
    time_decay, u, k, v, _ = inputs(seed=3)
    time_decay = np.log(time_decay)
    halves = [(k[:, :6], v[:, :6]), (k[:, 6:12], v[:, 6:12])]
    ours = functools.partial(run, jnp.exp(time_decay), u, impl=impl, chunk_size=CHUNK)
    hf_state = None
    for k_half, v_half in halves:
        state = empty_state(B) if hf_state is None else tuple(s.numpy() for s in hf_state)
        out, final = ours(k_half, v_half, initial_state=state)  # one compile: the same shapes twice
        hf_out, hf_state = rwkv_linear_attention_cpu(torch.tensor(time_decay), torch.tensor(u), torch.tensor(k_half),
                                                     torch.tensor(v_half), state=hf_state, return_state=True)
        np.testing.assert_allclose(out, hf_out.numpy(), rtol=1e-5, atol=1e-5)
        for got, want in zip(final, hf_state):
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


def test_gradients():
    """Chunked and kernel gradients (of w, u, k, v and the initial state) equal the reference scan's within
    1e-4 and are finite, across resets and padding, from a given state and from the empty one
    (max -1e38), with moderate keys and with keys of 60 +- 30."""
    rng = np.random.default_rng(1)
    r_out = rng.normal(size=(B, T, C)).astype(np.float32)
    r_state = rng.normal(size=(3, B, C)).astype(np.float32)

    def loss(impl, w, u, k, v, state):
        out, final = wkv(w, u, k, v, segment_ids=SEGMENTS, initial_state=state, impl=impl, chunk_size=CHUNK)
        return jnp.sum(out * r_out) + sum(jnp.sum(s * r) for s, r in zip(final, r_state))

    grad = {impl: jax.jit(jax.grad(functools.partial(loss, impl), argnums=(0, 1, 2, 3, 4))) for impl in IMPLS}
    for k_mean, k_scale in ((0.0, 1.0), (60.0, 30.0)):
        args = inputs(k_mean=k_mean, k_scale=k_scale)
        want = jax.tree.leaves(grad["reference"](*args))
        for impl in ("chunked", "pallas"):
            got = jax.tree.leaves(grad[impl](*args))
            assert len(got) == 7
            for g, r in zip(got, want):
                assert np.isfinite(g).all(), impl
                np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_segments(impl):
    """A packed row equals its sequences run alone, left padding equals none, and a call continued
    from another's final state equals one call over both."""
    w, u, k, v, state = inputs(batch=1)
    k, v, ones = k[:, :12], v[:, :12], np.ones((1, 6), np.int32)

    def call(k, v, segment_ids, initial_state):  # ids and state always given: one compile per length
        return run(w, u, k, v, segment_ids=segment_ids, initial_state=initial_state, impl=impl, chunk_size=CHUNK)

    def close(got, want):
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)

    out, final = call(k, v, np.array([[1] * 6 + [2] * 6]), state)
    first, _ = call(k[:, :6], v[:, :6], ones, state)
    second, second_final = call(k[:, 6:], v[:, 6:], ones, empty_state(1))
    close((out, final), (np.concatenate([first, second], axis=1), second_final))

    out, final = call(k, v, np.array([[0] * 6 + [1] * 6]), empty_state(1))
    close((out, final), (np.concatenate([np.zeros((1, 6, C)), second], axis=1), second_final))

    seg = np.array([[1] * 3 + [2] * 7 + [0] * 2])
    whole = call(k, v, seg, state)
    head, head_final = call(k[:, :6], v[:, :6], seg[:, :6], state)
    tail, tail_final = call(k[:, 6:], v[:, 6:], seg[:, 6:], head_final)
    close(whole, (np.concatenate([head, tail], axis=1), tail_final))


@pytest.mark.parametrize("kwargs, match", [
    (dict(impl="scan"), "impl='scan'"),
    (dict(chunk_size=0), "chunk_size=0"),
    (dict(k=np.zeros((B, T))), "k has shape"),
    (dict(v=np.zeros((B, T, C + 1))), "v has shape"),
    (dict(w=np.zeros((C + 1,))), "w has shape"),
    (dict(u=np.zeros((1, C))), "u has shape"),
    (dict(segment_ids=np.zeros((B, T + 1), np.int32)), "segment_ids has shape"),
    (dict(initial_state=(np.zeros((B, C)),) * 2), "initial_state has shapes"),
])
def test_errors(kwargs, match):
    w, u, k, v, _ = inputs()
    kwargs = {"w": w, "u": u, "k": k, "v": v, **kwargs}
    with pytest.raises(ValueError, match=match) as err:
        wkv(kwargs.pop("w"), kwargs.pop("u"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)
    assert "\n" not in str(err.value)
