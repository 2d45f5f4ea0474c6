"""Attention dropout in the flash kernels (interpret mode on CPU) against the xla reference.

The mask is `tfm.kernels.dropout`'s hash of (seed, batch row, query head, query, key), drawn by both
backends from the same rng, so the kernels are compared with xla given the same mask: forward and
dq, dk, dv, fp32 max-abs <= 1e-5 (forward) and 1e-4 (gradients), as tests/test_flash_attention.py
(measured <= 6e-7 and <= 1.5e-6; a wrong mask anywhere gives differences of order 1).
The mask does not depend on the tiles, the driver or the mesh; its keep rate and independence
across heads, batch rows, positions and seeds hold within 3 sigma.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_flash_attention import Case, _inputs, _segment_ids
from tfm.kernels import dropout, sparsity
from tfm.kernels import flash_attention as fa
from tfm.ops import attention, pallas, xla
from tfm.parallel import MeshConfig, flax_rules, make_mesh, make_rules, parse_parallelism

RATE = 0.3
RNG = jax.random.PRNGKey(7)
# name -> (case, backend): the loop driver ("cpu") and the TPU grid driver ("tpu"), both interpreted
CASES = {
    "causal_gqa_cross": (Case(T=40, S=56, N=4, K=2, H=16, causal=True, blocks=fa.BlockSizes(16, 32, 32, 16)), "cpu"),
    "all_features": (Case(T=48, S=48, N=4, K=2, H=16, causal=True, window=20, segments="packed", alibi=True,
                          softcap=3.0, blocks=fa.BlockSizes(16, 8)), "cpu"),
    "grid_mqa_window_segments": (Case(T=40, S=72, N=4, K=1, H=16, window=24, segments="packed",
                                      blocks=fa.BlockSizes(16, 16)), "tpu"),
}


def _kwargs(case: Case):
    q_seg, kv_seg = _segment_ids(case)
    return dict(causal=case.causal, window=case.window, softcap=case.softcap,
                alibi_slopes=attention.alibi_slopes(case.N) if case.alibi else None,
                q_segment_ids=q_seg, kv_segment_ids=kv_seg)


def _xla(case: Case, rate=RATE, rng=RNG):
    kw = _kwargs(case)
    return lambda q, k, v: xla.attention(
        q, k, v, causal=case.causal, q_seg=kw["q_segment_ids"], kv_seg=kw["kv_segment_ids"],
        q_pos=jnp.arange(case.T)[None], kv_pos=jnp.arange(case.S)[None], window=case.window,
        slopes=kw["alibi_slopes"], softcap=case.softcap, scale=case.H ** -0.5, dropout_rate=rate, dropout_rng=rng)


def _pallas(case: Case, backend: str, blocks=None, rate=RATE, rng=RNG):
    return lambda q, k, v: pallas.attention(
        q, k, v, scale=case.H ** -0.5, block_sizes=blocks or case.blocks, backend=backend, interpret=True,
        dropout_rate=rate, dropout_rng=rng, **_kwargs(case))


def _value_and_grads(f, q, k, v, ct):
    """(o, (dq, dk, dv)) of sum(o * ct), jitted."""
    def loss(q, k, v):
        o = f(q, k, v)
        return jnp.sum(o * ct), o

    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return o, grads


def _assert_close(got, want, fwd_tol=1e-5, grad_tol=1e-4):
    (o, grads), (o_ref, grads_ref) = got, want
    np.testing.assert_allclose(o, o_ref, rtol=0, atol=fwd_tol, err_msg="o")
    for name, a, b in zip("qkv", grads, grads_ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=grad_tol, err_msg=f"d{name}")


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_xla_given_the_same_mask(name):
    case, backend = CASES[name]
    inputs = _inputs(case, jnp.float32)
    got = _value_and_grads(_pallas(case, backend), *inputs)
    _assert_close(got, _value_and_grads(_xla(case), *inputs))
    assert np.abs(np.asarray(got[0] - _xla(case, rate=0.0)(*inputs[:3]))).max() > 0.1  # dropout changed o


def test_grid_driver_with_block_lists_matches_xla():
    """A sparsity pattern's block lists and the seed, both scalar-prefetched by the grid driver."""
    case = Case(T=64, S=64, N=2, K=1, H=16, causal=True, blocks=fa.BlockSizes(16, 16))
    pattern = sparsity.Strided(8)
    inputs = _inputs(case, jnp.float32)
    xla_sparse = lambda q, k, v: xla.attention(
        q, k, v, causal=True, q_seg=None, kv_seg=None, q_pos=jnp.arange(case.T)[None],
        kv_pos=jnp.arange(case.S)[None], window=None, slopes=None, softcap=None, scale=case.H ** -0.5,
        dropout_rate=RATE, dropout_rng=RNG, sparsity=pattern)
    kernels = lambda q, k, v: pallas.attention(
        q, k, v, causal=True, sparsity=pattern, scale=case.H ** -0.5, block_sizes=case.blocks, backend="tpu",
        interpret=True, dropout_rate=RATE, dropout_rng=RNG)
    _assert_close(_value_and_grads(kernels, *inputs), _value_and_grads(xla_sparse, *inputs))


def test_mask_is_the_same_for_any_tiles_and_driver():
    """The forward with other tiles and with the other driver gives the same output (the backward with
    tiles other than the forward's matches xla above)."""
    case, _ = CASES["causal_gqa_cross"]
    q, k, v, _ = _inputs(case, jnp.float32)
    first = _pallas(case, "cpu", fa.BlockSizes(8, 16))(q, k, v)
    for backend, blocks in (("cpu", fa.BlockSizes(32, 8)), ("tpu", fa.BlockSizes(16, 32))):
        np.testing.assert_allclose(_pallas(case, backend, blocks)(q, k, v), first, rtol=0, atol=1e-5)


def test_rate_zero_changes_nothing():
    case, _ = CASES["causal_gqa_cross"]
    q, k, v, _ = _inputs(case, jnp.float32)
    plain = fa.flash_attention(q, k, v, causal=True, block_sizes=case.blocks)
    np.testing.assert_array_equal(_pallas(case, "cpu", rate=0.0)(q, k, v), plain)
    np.testing.assert_array_equal(_xla(case, rate=0.0)(q, k, v), _xla(case, rate=0.0, rng=None)(q, k, v))


def _kernel_mask(B=2, T=64, S=64, N=4, K=2, rate=RATE, seed=11):
    """bool [B, N, T, S]: the forward kernel's keep mask, read back through uniform probabilities
    (q = 0) and one-hot values (v[s] = e_s): o[b, t, n, s] = keep / ((1 - rate) S)."""
    q = jnp.zeros((B, T, N, S), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, K, S))
    o = fa.flash_attention(q, v, v, block_sizes=fa.BlockSizes(16, 32), dropout_rate=rate,
                           dropout_seed=jnp.int32(seed))
    scaled = np.asarray(o).transpose(0, 2, 1, 3) * (1 - rate) * S
    assert np.allclose(scaled, np.round(scaled), atol=1e-4) and set(np.unique(np.round(scaled))) <= {0.0, 1.0}
    return np.round(scaled).astype(bool)


def _within_3_sigma(count, n, p, what):
    """count successes of n Bernoulli(p) trials: |count / n - p| <= 3 sqrt(p (1 - p) / n)."""
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(count / n - p) <= 3 * sigma, f"{what}: {count / n:.5f} vs {p:.5f} +- {3 * sigma:.5f}"


def _uncorrelated(a, b, what):
    """Pearson correlation of two bool arrays within 3 / sqrt(n) of 0 (independent pairs)."""
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    r = np.corrcoef(a, b)[0, 1]
    assert abs(r) <= 3 / np.sqrt(a.size), f"{what}: correlation {r:.4f}, n {a.size}"


def test_kernel_mask_keep_rate_and_independence():
    """The kernel's own mask (2 x 4 x 64 x 64): keep rate 1 - rate; heads, batch rows and neighbouring
    queries and keys uncorrelated; the same mask as the xla reference's for that seed."""
    keep = _kernel_mask()
    _within_3_sigma(keep.sum(), keep.size, 1 - RATE, "keep rate")
    _uncorrelated(keep[:, :-1], keep[:, 1:], "query heads n, n + 1")
    _uncorrelated(keep[:, 0], keep[:, 2], "query heads 0, 2 (different kv heads)")
    _uncorrelated(keep[0], keep[1], "batch rows")
    _uncorrelated(keep[..., :-1, :], keep[..., 1:, :], "queries t, t + 1")
    _uncorrelated(keep[..., :-1], keep[..., 1:], "keys s, s + 1")
    B, N, T, S = keep.shape
    upper = np.triu(np.ones((T, S), bool), 1)
    _uncorrelated(keep[..., upper], np.swapaxes(keep, -1, -2)[..., upper], "(t, s) and (s, t), t < s")
    key = dropout.head_key(jnp.int32(11), jnp.arange(B)[:, None, None, None], jnp.arange(N)[None, :, None, None])
    np.testing.assert_array_equal(dropout.keep(key, jnp.arange(T)[:, None], jnp.arange(S), RATE), keep)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_hash_keep_rate_and_independence(rate):
    """2^21 elements per rate: keep rate within 3 sigma, and no correlation across seeds (consecutive
    ones), batch rows, heads, positions and the diagonal."""
    B, N, T, S = 2, 4, 256, 512
    rows, cols = jnp.arange(T)[:, None], jnp.arange(S)
    batch, head = jnp.arange(B)[:, None, None, None], jnp.arange(N)[None, :, None, None]
    keep = lambda seed: np.asarray(dropout.keep(dropout.head_key(jnp.int32(seed), batch, head), rows, cols, rate))
    a, b = keep(0), keep(1)
    _within_3_sigma(a.sum(), a.size, 1 - rate, "keep rate")
    _uncorrelated(a, b, "seeds 0, 1")
    _uncorrelated(a[0], a[1], "batch rows")
    _uncorrelated(a[:, :-1], a[:, 1:], "heads")
    _uncorrelated(a[..., :-1, :], a[..., 1:, :], "queries")
    _uncorrelated(a[..., :-1], a[..., 1:], "keys")
    _uncorrelated(a[..., :-1, :-1], a[..., 1:, 1:], "diagonal neighbours")


def test_sharded_call_drops_what_the_unsharded_call_drops():
    """8 simulated devices, batch over (data, fsdp) (2 x 2) and heads over tensor (2): the shards' global
    batch and head offsets enter the hash, so values and gradients equal xla's (unsharded, global indices)."""
    case = Case(T=24, S=24, N=4, K=2, H=16, causal=True, blocks=fa.BlockSizes(8, 8))
    B = 8
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q, ct = (jax.random.normal(key, (B, case.T, case.N, case.H)) for key in keys[:2])
    k, v = (jax.random.normal(key, (B, case.S, case.K, case.H)) for key in keys[2:])

    run = lambda f: _value_and_grads(f, q, k, v, ct)

    f = lambda q, k, v: pallas.attention(q, k, v, causal=True, scale=case.H ** -0.5, block_sizes=case.blocks,
                                         dropout_rate=RATE, dropout_rng=RNG)
    rules = flax_rules(make_rules(*parse_parallelism("data+fsdp+tensor"), activations=True))
    with jax.set_mesh(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))), nn.logical_axis_rules(rules):
        sharded = run(f)
    _assert_close(sharded, run(_xla(case)))


def test_refusals():
    q = jnp.zeros((1, 16, 2, 16))
    with pytest.raises(ValueError, match="needs a dropout_seed"):
        fa.flash_attention(q, q, q, dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
        fa.flash_attention(q, q, q, dropout_rate=1.0, dropout_seed=jnp.int32(0))
    with pytest.raises(ValueError, match="needs a dropout_rng"):
        pallas.attention(q, q, q, causal=False, scale=0.25, dropout_rate=0.1)
    with pytest.raises(ValueError, match="context-parallel attention .* take no dropout"):
        fa.block_forward(q, q, q, 0, dropout_rate=0.1)
