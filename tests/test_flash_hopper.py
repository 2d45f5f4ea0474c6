"""The Hopper (Mosaic GPU) flash-attention kernels: in Mosaic GPU's interpreter on CPU against the
xla reference (o, log-sum-exp and dq, dk, dv; bf16 inputs: max-abs <= 2e-2, gradients relative to
their largest), the one-line refusals, and the lowering of forward and backward for a compile-only
H100 (every feature, H 64/128/256) into Mosaic GPU calls.

The interpreter runs the kernel's warpgroups, barriers and TMA copies but not its register layouts
or the wgmma instruction itself (`flash_hopper._Registers`); the lowering covers those up to the
Mosaic GPU module (ptxas, which reports registers and spills, needs a GPU: benchmarks.gpu_check)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_flash_attention import Case, _segment_ids
from tfm.kernels import dropout
from tfm.kernels import flash_hopper
from tfm.kernels.flash_hopper import flash_attention
from tfm.ops import attention

# Every feature the driver takes, in few interpreted calls (one batch row: the interpreter runs each
# thread block's three warpgroups in turn): ragged lengths pad to whole tiles, row 0 of the packed
# case has query ids its keys lack (rows that see nothing: o 0, lse +inf). The interpreter's time goes by
# thread blocks (batch x q blocks x heads): the mask-only cases have one head, GQA and MQA have their own.
CASES = {
    "causal_gqa_ragged_softcap_alibi": Case(T=100, S=100, N=4, K=2, H=16, causal=True, softcap=3.0, alibi=True),
    "cross_mqa_window_bidirectional_alibi": Case(T=72, S=200, N=2, K=1, H=64, window=40, alibi=True),
    "packed_segments_causal_window": Case(T=160, S=160, N=1, K=1, H=32, causal=True, window=33, segments="packed"),
    "kv_padding_only": Case(T=64, S=100, N=1, K=1, H=16, segments="kv"),
}


def _inputs(case):
    """bf16 q [1, T, N, H], k, v [1, S, K, H]."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    shapes = [(1, case.T, case.N, case.H), (1, case.S, case.K, case.H), (1, case.S, case.K, case.H)]
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key, shape in zip(keys, shapes))


def _options(case):
    q_seg, kv_seg = (None if ids is None else ids[:1] for ids in _segment_ids(case))
    return dict(causal=case.causal, window=case.window, softcap=case.softcap, q_segment_ids=q_seg,
                kv_segment_ids=kv_seg, alibi_slopes=attention.alibi_slopes(case.N) if case.alibi else None)


@pytest.mark.parametrize("name", CASES)
def test_matches_xla_in_the_interpreter(name):
    """o, lse and the gradients of <o, ct> (the dQ and dK/dV kernels) against the xla reference on
    the same bf16 inputs in fp32. The causal GQA case also has attention dropout 0.1: the kernels
    regenerate the keep mask xla builds from the same seed (tfm.kernels.dropout), in the forward and
    both backward kernels."""
    rng = jax.random.PRNGKey(3)
    with_dropout = dict(hopper=dict(dropout_rate=0.1, dropout_seed=dropout.seed(rng)),
                        xla=dict(dropout_rate=0.1, dropout_rng=rng))
    _check(CASES[name], **(with_dropout if name == "causal_gqa_ragged_softcap_alibi" else {}))


def _check(case, hopper=None, xla=None):
    q, k, v = _inputs(case)
    ct = jax.random.normal(jax.random.PRNGKey(9), q.shape, jnp.float32)
    options = _options(case)
    f32 = lambda x: x.astype(jnp.float32)

    def loss(impl, q, k, v):
        if impl == "hopper":
            o, lse = flash_attention(q, k, v, interpret=True, **options, **(hopper or {}))
        else:
            o, lse = attention.dot_product_attention(f32(q), f32(k), f32(v), impl="xla", **options,
                                                     **(xla or {})), None
        return jnp.sum(f32(o) * ct), (o, lse)

    grad = lambda impl: jax.jit(jax.value_and_grad(functools.partial(loss, impl), argnums=(0, 1, 2), has_aux=True))
    (_, (o, lse)), grads = grad("hopper")(q, k, v)
    (_, (want, _)), want_grads = grad("xla")(q, k, v)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    np.testing.assert_allclose(np.asarray(f32(o)), np.asarray(want), rtol=0, atol=2e-2)
    for name_, got, ref, x in zip(("dq", "dk", "dv"), grads, want_grads, (q, k, v)):
        assert got.shape == x.shape and got.dtype == x.dtype, name_
        np.testing.assert_allclose(np.asarray(f32(got)), np.asarray(f32(ref)), rtol=0,
                                   atol=2e-2 * max(1.0, float(jnp.abs(ref).max())), err_msg=name_)
    # lse against the reference's logits: log-sum-exp over the visible keys, +inf where none is
    G = case.N // case.K
    logits = jnp.einsum("btnh,bsnh->bnts", f32(q), jnp.repeat(f32(k), G, axis=2)) * case.H ** -0.5
    if case.softcap:
        logits = case.softcap * jnp.tanh(logits / case.softcap)
    if case.alibi:
        distance = jnp.abs(jnp.arange(case.T)[:, None] - jnp.arange(case.S)[None, :])
        logits = logits - options["alibi_slopes"][:, None, None] * distance
    q_seg, kv_seg = options["q_segment_ids"], options["kv_segment_ids"]
    if kv_seg is not None and q_seg is None:  # key padding only
        q_seg, kv_seg = jnp.ones((q.shape[0], case.T), jnp.int32), (kv_seg != 0).astype(jnp.int32)
    seen = attention.visibility(jnp.arange(case.T)[None], jnp.arange(case.S)[None], q_seg, kv_seg,
                                causal=case.causal, window=case.window)[:, None]  # [B, 1, T, S]
    want_lse = jnp.where(seen.any(-1), jax.nn.logsumexp(jnp.where(seen, logits, -jnp.inf), axis=-1), jnp.inf)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(jnp.broadcast_to(want_lse, lse.shape)), rtol=0, atol=2e-2)


def test_pingpong_forward_matches_xla_in_the_interpreter():
    """FORWARD_SCHEDULE "pingpong" (unmeasured on hardware): causal over 200 ragged keys, so some warpgroups
    see whole key blocks unmasked before their diagonal block, others skip blocks past it, and the last
    block is padding; PV accumulated in place; with ALiBi and dropout (o, lse, dq, dk, dv against xla)."""
    rng = jax.random.PRNGKey(8)
    with flash_hopper.forward_schedule("pingpong"):
        _check(Case(T=200, S=200, N=1, K=1, H=16, causal=True, alibi=True),
               hopper=dict(dropout_rate=0.1, dropout_seed=dropout.seed(rng)), xla=dict(dropout_rate=0.1, dropout_rng=rng))


def test_refusals_are_one_line():
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    for options, match in ((dict(dropout_rate=0.1), "dropout_rate > 0 needs a dropout_seed"),
                           (dict(), "all bfloat16 or all float16, not float32/float32/float32")):
        x = q.astype(jnp.float32) if not options else q
        with pytest.raises(ValueError, match=match):
            flash_attention(x, x, x, **options)
    with pytest.raises(ValueError, match="head dims up to 256, got 320"):
        flash_attention(*(jnp.zeros((1, 128, 2, 320), jnp.bfloat16),) * 3)
    wide = jnp.zeros((1, 128, 2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="backward takes head dims up to 128, got 256; use impl='pallas'"):
        jax.make_jaxpr(jax.grad(lambda q: flash_attention(q, wide, wide)[0].astype(jnp.float32).sum()))(wide)


@pytest.mark.parametrize("schedule", flash_hopper.FORWARD_SCHEDULES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_lowers_to_one_mosaic_gpu_call_for_an_h100(head_dim, schedule):
    """Every feature subset the driver takes, forward and backward, traced for a compile-only H100:
    the Mosaic GPU modules are built (register layouts, wgmma operands, TMA shapes, shared memory)
    into three custom calls (forward, dQ, dK/dV), for each forward schedule."""
    from test_kernel_compile import _devices
    mesh = jax.sharding.Mesh(np.array(_devices("h100-1")[:1]), ("x",))
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(
        shape, dtype, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    subsets = [dict(causal=True), dict(window=100), dict(causal=True, window=100, softcap=30.0, segments=True),
               dict(segments=True, alibi_slopes=attention.alibi_slopes(8)),
               dict(causal=True, dropout_rate=0.1, dropout_seed=jnp.int32(5))]
    for options in subsets:
        segments = options.pop("segments", False)
        f = lambda q, k, v, ids: jnp.sum(flash_attention(
            q, k, v, q_segment_ids=ids if segments else None, kv_segment_ids=ids if segments else None,
            **options)[0].astype(jnp.float32))
        traced = jax.jit(jax.grad(f, argnums=(0, 1, 2)) if head_dim <= 128 else f)  # the backward up to H 128
        with flash_hopper.forward_schedule(schedule):
            text = traced.lower(spec(2, 384, 8, head_dim), spec(2, 384, 2, head_dim), spec(2, 384, 2, head_dim),
                                spec(2, 384, dtype=jnp.int32)).as_text()
        assert text.count("stablehlo.custom_call @mosaic_gpu") == (3 if head_dim <= 128 else 1), options



def test_a_shard_drops_what_the_whole_call_drops_there():
    """dropout_offsets: a call on row 1 and head 1 of a batch, given their global offsets (as
    `tfm.ops.shard.per_device` gives each device's shard), equals that block of the whole call.
    (Two heads and one kv head: the interpreter's time goes by thread blocks, batch x q heads.)"""
    q, k, v = (jnp.concatenate([x] * 2) for x in _inputs(Case(T=64, S=64, N=2, K=1, H=16)))
    q = q + jax.random.normal(jax.random.PRNGKey(4), q.shape, jnp.float32).astype(jnp.bfloat16)  # rows differ
    options = dict(causal=True, dropout_rate=0.3, dropout_seed=jnp.int32(11), interpret=True)
    whole, _ = jax.jit(functools.partial(flash_attention, **options))(q, k, v)
    part, _ = jax.jit(functools.partial(flash_attention, **options))(q[1:, :, 1:], k[1:], v[1:], dropout_offsets=(1, 1))
    np.testing.assert_array_equal(np.asarray(part.astype(jnp.float32)), np.asarray(whole[1:, :, 1:].astype(jnp.float32)))
    moved, _ = jax.jit(functools.partial(flash_attention, **options))(q[1:, :, 1:], k[1:], v[1:])
    assert not np.array_equal(np.asarray(moved), np.asarray(part))  # the offsets change the mask


def test_entry_point_runs_the_kernels_per_device_under_a_mesh():
    """impl="hopper" through `dot_product_attention` under fsdp 4 x tensor 2 (traced, not run: the
    interpreter's warpgroup threads deadlock across concurrently running CPU devices): forward, dQ and
    dK/dV are kernel calls inside shard_map on each device's [1 row, 2 query heads | 1 kv head] block."""
    import flax.linen as nn
    from jax.extend.core import jaxprs_in_params
    from tfm.parallel import MeshConfig, flax_rules, make_mesh, make_rules, parse_parallelism

    def calls(jaxpr, inside=False):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "mpmd_map":  # an interpreted Mosaic GPU kernel (its warpgroups)
                yield eqn, inside
                continue
            for sub in jaxprs_in_params(eqn.params):
                yield from calls(sub, inside or eqn.primitive.name == "shard_map")

    q, k = jnp.zeros((4, 64, 4, 16), jnp.bfloat16), jnp.zeros((4, 64, 2, 16), jnp.bfloat16)
    loss = lambda q, k, v: attention.dot_product_attention(q, k, v, impl="hopper", causal=True, dropout_rate=0.1,
                                                           dropout_rng=jax.random.PRNGKey(0)).astype(jnp.float32).sum()
    rules = flax_rules(make_rules(*parse_parallelism("fsdp+tensor"), activations=True))
    with jax.set_mesh(make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))), nn.logical_axis_rules(rules):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k).jaxpr
    found = list(calls(jaxpr))
    assert len(found) == 3 and all(inside for _, inside in found), found
    leading = {tuple(x.aval.shape[:3]) for eqn, _ in found for x in eqn.invars if x.aval.ndim == 4}
    assert leading == {(1, 128, 2), (1, 128, 1)}, leading  # [B/4, T padded to 128, N/2 | K/2]


def test_entry_point_passes_every_mask_to_the_kernels():
    """impl="hopper" through `dot_product_attention` (interpreted, no mesh) equals impl="xla" given the
    same masks and dropout rng: scale, causal, soft-cap, ALiBi, packed segment ids and the rng all
    reach the kernels (o, bf16 inputs, 2e-2). Two heads: each its own ALiBi slope."""
    case = dataclasses.replace(CASES["packed_segments_causal_window"], N=2, K=2)
    q, k, v = _inputs(case)
    options = dict(_options(case), softcap=4.0, alibi_slopes=attention.alibi_slopes(case.N), scale=0.3,
                   dropout_rate=0.2, dropout_rng=jax.random.PRNGKey(6))
    attend = lambda impl, *x: attention.dot_product_attention(*x, impl=impl, **options).astype(jnp.float32)
    got = jax.jit(functools.partial(attend, "hopper"))(q, k, v)
    want = jax.jit(functools.partial(attend, "xla"))(*(x.astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-2)
    assert float(jnp.abs(want).max()) > 0.5
