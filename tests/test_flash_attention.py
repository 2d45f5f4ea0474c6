"""Pallas flash attention (interpret mode on CPU) against the xla reference.

Every case checks the forward output and dq, dk, dv: fp32 max-abs <= 1e-5 (forward) and
1e-4 (gradients); bf16/fp16 <= 2e-2.
"""
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.kernels import flash_attention as fa
from tfm.ops import attention

TOLERANCES = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (2e-2, 2e-2), jnp.float16: (2e-2, 2e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
    T: int = 128
    S: int = 128
    N: int = 2
    K: int = 2
    H: int = 64
    causal: bool = False
    window: Optional[int] = None
    segments: Optional[str] = None  # "packed": q/kv ids with 0-padding; "kv": key padding only
    alibi: bool = False
    softcap: Optional[float] = None
    blocks: fa.BlockSizes = fa.BlockSizes(block_q=32, block_kv=32)


CASES = {
    "bidirectional_mha": Case(blocks=fa.BlockSizes(64, 32, 32, 64)),
    "causal_ragged_gqa2_h16": Case(T=100, S=100, N=4, K=2, H=16, causal=True),
    "cross_mqa8_ragged": Case(T=72, S=130, N=8, K=1, H=16),
    "causal_cross_q_longer": Case(T=96, S=64, H=16, causal=True),
    "packed_segments_padding_causal": Case(T=128, S=128, N=4, K=2, H=16, causal=True, segments="packed"),
    "packed_segments_cross_ragged": Case(T=80, S=112, H=16, segments="packed"),
    "kv_padding_only": Case(T=64, S=100, H=16, segments="kv"),
    "window_causal_skips": Case(T=160, S=160, H=16, causal=True, window=33),
    "window_bidirectional": Case(T=130, S=130, H=16, window=24),
    "alibi_causal_gqa2": Case(T=96, S=96, N=4, K=2, H=16, causal=True, alibi=True),
    "softcap_bidirectional": Case(T=64, S=96, H=16, softcap=2.0),
    "all_features": Case(T=100, S=100, N=4, K=2, H=16, causal=True, window=40, segments="packed",
                         alibi=True, softcap=3.0),
}
LOW_PRECISION = ["causal_ragged_gqa2_h16", "packed_segments_padding_causal", "all_features"]
GRID_DRIVER = ["cross_mqa8_ragged", "window_causal_skips", "all_features"]


def _segment_ids(case: Case):
    """Packed documents per batch row, with trailing 0 (padding); query ids 3 are absent
    from the keys of the cross case, so those query rows see nothing."""
    if case.segments is None:
        return None, None
    def ids(length, cuts):
        out = np.zeros(length, np.int32)
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            out[a:b] = i + 1
        return out
    T, S = case.T, case.S
    kv = np.stack([ids(S, [0, S // 3, S - 9]), ids(S, [0, S // 2, S])])
    if case.segments == "kv":
        return None, jnp.asarray(kv)
    q = np.stack([ids(T, [0, T // 3, T - 7]), ids(T, [0, T // 4, T // 2, T - 5])])
    return jnp.asarray(q), jnp.asarray(kv)


def _inputs(case: Case, dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, case.T, case.N, case.H), jnp.float32)
    k = jax.random.normal(keys[1], (2, case.S, case.K, case.H), jnp.float32)
    v = jax.random.normal(keys[2], (2, case.S, case.K, case.H), jnp.float32)
    ct = jax.random.normal(keys[3], (2, case.T, case.N, case.H), jnp.float32)
    return tuple(x.astype(dtype) for x in (q, k, v, ct))


def _loss_and_grads(case: Case, impl: str, backend=None):
    q_seg, kv_seg = _segment_ids(case)
    kwargs = dict(causal=case.causal, window=case.window, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
                  alibi_slopes=attention.alibi_slopes(case.N) if case.alibi else None,
                  softcap=case.softcap)

    def f(q, k, v, ct):
        if backend is None:
            o = attention.dot_product_attention(q, k, v, impl=impl, block_sizes=case.blocks, **kwargs)
        else:
            o = fa.flash_attention(q, k, v, block_sizes=case.blocks, backend=backend, **kwargs)
        return jnp.sum(o.astype(jnp.float32) * ct.astype(jnp.float32)), o

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


@functools.lru_cache(maxsize=None)  # the fully-masked-rows test reuses a case's run
def _check(name, dtype, backend=None):
    case = CASES[name]
    q, k, v, ct = _inputs(case, dtype)
    (_, o_ref), g_ref = _loss_and_grads(case, "xla")(q, k, v, ct)
    (_, o), g = _loss_and_grads(case, "pallas", backend)(q, k, v, ct)
    fwd_tol, grad_tol = TOLERANCES[dtype]
    assert o.dtype == q.dtype and o.shape == q.shape
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), rtol=0, atol=fwd_tol)
    for name_, a, b in zip("qkv", g, g_ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name_
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0,
                                   atol=grad_tol, err_msg=f"d{name_}")
    return o


@pytest.mark.parametrize("name", list(CASES))
def test_matches_xla_fp32(name):
    _check(name, jnp.float32)


@pytest.mark.parametrize("name", LOW_PRECISION)
def test_matches_xla_bf16(name):
    _check(name, jnp.bfloat16)


def test_matches_xla_fp16():
    _check("bidirectional_mha", jnp.float16)


@pytest.mark.parametrize("name", GRID_DRIVER)
def test_tpu_grid_driver_matches_xla(name):
    """The TPU (Mosaic) driver, run by the interpreter: grid over key blocks + scratch."""
    _check(name, jnp.float32, backend="tpu")


def test_fully_masked_rows_are_zero_and_finite():
    case = CASES["packed_segments_cross_ragged"]
    q_seg, _ = _segment_ids(case)
    o = _check("packed_segments_cross_ragged", jnp.float32)
    empty = np.asarray(q_seg) == 0  # padding queries, and (row 1) ids missing from keys
    empty[1] |= np.asarray(q_seg[1]) == 3
    assert empty.any() and np.all(np.asarray(o)[empty] == 0.0)
    assert np.all(np.isfinite(np.asarray(o)))


@pytest.mark.parametrize("causal,window", [(True, None), (True, 7), (False, 7), (False, None)])
@pytest.mark.parametrize("T,S,bq,bk", [(64, 64, 16, 16), (48, 80, 16, 32), (96, 40, 32, 8)])
@pytest.mark.parametrize("shift", [0, -37, 21])
def test_block_ranges_skip_exactly_the_empty_blocks(causal, window, T, S, bq, bk, shift):
    """Visible-block ranges hold every block with a visible key and no other, also with the queries
    shifted (query i at position i + shift, as a block of context parallelism)."""
    Sp = -(-S // bk) * bk
    cfg = fa.TileConfig(causal=causal, window=window, softcap=None, scale=1.0, kv_len=S if Sp != S else None,
                     segments=False, alibi=False, groups=1, block_q=bq, block_kv=bk, driver="loop",
                     interpret=True)
    pos_q, pos_k = shift + np.arange(-(-T // bq) * bq)[None], np.arange(Sp)[None]
    visible = attention.visibility(pos_q, pos_k, None, None, causal=causal, window=window)[0]
    visible = np.asarray(visible & (pos_k < S))
    blocks = visible.reshape(visible.shape[0] // bq, bq, Sp // bk, bk).any(axis=(1, 3))  # [nq, nk]
    for qi in range(blocks.shape[0]):
        lo, hi = map(int, fa.kv_block_range(qi, cfg, bq, bk, blocks.shape[1], shift))
        assert set(range(lo, hi)) == set(np.flatnonzero(blocks[qi])), (qi, lo, hi)
    for kj in range(-(-S // bk)):
        lo, hi = map(int, fa.q_block_range(kj, cfg, bq, bk, blocks.shape[0], shift))
        needed, ranged = set(np.flatnonzero(blocks[:, kj])), set(range(lo, hi))
        assert needed == ranged if cfg.kv_len is None else needed <= ranged, (kj, lo, hi)


def test_block_kernels_with_a_position_shift_match_xla():
    """block_forward / block_backward (the kernels with a traced query-position shift, the caller's
    lse and delta) against the xla reference given the shifted positions, for shifts that leave the
    block fully visible, partly visible and invisible; fp32 <= 1e-5 (forward), 1e-4 (gradients). The
    TPU grid driver (interpreted), whose index maps read the shift from scalar prefetch; the loop
    driver's shifts are exercised by tests/test_context_parallel.py."""
    causal, window = True, 5
    B, T, S, N, K, H = 2, 24, 40, 4, 2, 16
    q, k, v, do = (jax.random.normal(key, shape) for key, shape in zip(
        jax.random.split(jax.random.PRNGKey(1), 4), [(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)]))
    q_seg, kv_seg = jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32).at[1, -6:].set(0)
    mask = dict(causal=causal, window=window, softcap=3.0)
    kernel_args = dict(mask, q_segment_ids=q_seg, kv_segment_ids=kv_seg, alibi_slopes=attention.alibi_slopes(N),
                       scale=H ** -0.5, block_sizes=fa.BlockSizes(8, 8), backend="tpu", interpret=True)

    def both(shift):
        o, lse = fa.block_forward(q, k, v, shift, **kernel_args)
        delta = jnp.einsum("BTNH,BTNH->BNT", do, o)
        grads = fa.block_backward(q, k, v, do, lse, delta, shift, **kernel_args)
        reference = lambda q, k, v: attention.dot_product_attention(
            q, k, v, q_positions=shift + jnp.arange(T)[None], kv_positions=jnp.arange(S)[None], q_segment_ids=q_seg,
            kv_segment_ids=kv_seg, alibi_slopes=attention.alibi_slopes(N), **mask)
        o_ref, vjp = jax.vjp(reference, q, k, v)
        return (o, *grads), (o_ref, *vjp(do))

    shifts = jnp.asarray([-45, -9, 0, 5, 17, 60])
    got, want = jax.jit(lambda s: jax.lax.map(both, s))(shifts)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 if i == 0 else 1e-4, err_msg="o dq dk dv".split()[i])
    assert np.abs(np.asarray(want[0][0])).max() == 0 and np.abs(np.asarray(want[0][2])).max() > 0


@pytest.mark.parametrize("dropout_rate", [0.0, 0.1])
@pytest.mark.parametrize("platform,backend", [("cuda", "gpu"), ("tpu", "tpu")])
def test_kernels_lower_for_gpu_and_tpu(platform, backend, dropout_rate):
    """Forward and backward lower to Triton (GPU) and Mosaic (TPU) from this CPU machine, also with
    dropout (the seed a scalar operand, scalar-prefetched on TPU)."""
    B, T, N, K, H = 1, 256, 4, 1, 128
    q = jnp.zeros((B, T, N, H), jnp.bfloat16)
    k = jnp.zeros((B, T, K, H), jnp.bfloat16)
    seg = jnp.ones((B, T), jnp.int32)

    def loss(q, k, v):
        o = fa.flash_attention(q, k, v, causal=True, window=100, softcap=5.0, alibi_slopes=jnp.ones(N),
                               q_segment_ids=seg, kv_segment_ids=seg, backend=backend, interpret=False,
                               dropout_rate=dropout_rate, dropout_seed=jnp.int32(1))
        return o.astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower(lowering_platforms=(platform,))
    marker = "xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert lowered.as_text().count(marker) == 3  # forward, dq, dk/dv


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_q=0), "power of two"),
    (dict(block_kv=48), "power of two"),
    (dict(block_q=4), ">= 8"),
    (dict(block_q_bwd=100), "block_q_bwd"),
    (dict(block_kv=64.0), "must be an int"),
    (dict(block_q=True), "must be an int"),
])
def test_block_sizes_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fa.BlockSizes(**kwargs)


def test_block_sizes_backend_checks():
    with pytest.raises(ValueError, match="TPU .*block_kv must be a multiple of 128"):
        fa.BlockSizes(block_q=128, block_kv=64).check_backend("tpu")
    with pytest.raises(ValueError, match="on GPU every block size must be >= 16"):
        fa.BlockSizes(block_q=8, block_kv=64).check_backend("gpu")
    fa.BlockSizes(block_q=8, block_kv=8).check_backend("cpu")
    assert fa.BlockSizes(64, 32).backward == (64, 32)
    assert fa.BlockSizes(64, 32, 16).backward == (16, 32)
    q = jnp.zeros((1, 8, 1, 16))
    with pytest.raises(ValueError, match="block_sizes must be a BlockSizes"):
        fa.flash_attention(q, q, q, block_sizes=(64, 64))
    with pytest.raises(ValueError, match="backend must be one of"):
        fa.flash_attention(q, q, q, backend="ipu")


def test_auto_picks_xla_on_cpu_and_for_dropout_or_positions():
    from tfm.ops import select
    q = jnp.zeros((2, 128, 4, 16))
    assert select.choose_impl(q, q) == "xla"
    assert select.choose_impl(jnp.zeros((8, 8192, 16, 64)), jnp.zeros((8, 8192, 16, 64))) == "chunked"
    assert select.choose_impl(q, q, dropout_rate=0.1) == "xla"
    assert select.choose_impl(q, q, positions_given=True) == "xla"
    assert select.choose_context_impl(q) == "chunked"  # context parallelism's blocks on CPU


@pytest.mark.parametrize("kwargs,message", [
    (dict(softcap=5.0), "does not implement softcap"),
    (dict(window=4), "does not implement bidirectional_window"),
    (dict(causal=True), "needs GPU devices"),
])
def test_cudnn_rejects_what_it_cannot_do(kwargs, message):
    q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        attention.dot_product_attention(q, q, q, impl="cudnn", **kwargs)
