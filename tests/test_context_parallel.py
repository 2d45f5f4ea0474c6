"""Context parallelism: the sequence split over the mesh's `context` axis (tfm.ops.context).

On 8 simulated CPU devices (fp32): attention by ring under meshes (context=4), (data=2,
context=4) and (context=2, tensor=2), and by all-gather under (data=2, context=4), equals the
single-device impl="xla" reference in values and in the gradients of q, k, v and the memory
(atol 2e-5) for causal packed-segment GQA attention with a window and ALiBi, bidirectional
attention over padding with a window and soft-cap, and cross-attention to a padded memory; so
does impl="pallas" (the flash kernels, interpreted, as each block) by ring and by all-gather under
(data=2, context=4);
the zig-zag layout gives device i chunks i and 2c-1-i (the tokens moved there, their global
positions, and the same count of visible causal pairs on every device); a causal ring step
off the diagonal computes half a block (dot FLOPs of its branches, forward and backward); and
what context parallelism cannot do fails with one clear line. A one-layer decoder trained under (data=2,
context=4) is in tests/test_parallel_decoder.py.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tfm.config import ModelConfig
from tfm.ops import context
from tfm.ops.attention import alibi_slopes, dot_product_attention
from tfm.parallel import MeshConfig, flax_rules, make_mesh, make_rules, parse_parallelism
from tfm.preflight.analysis import dot_flops

B, T, S, N, K, H = 2, 16, 8, 4, 2, 8
MESHES = {  # name -> (mesh config, rule sets)
    "context4": (MeshConfig(data=1, context=4), "context"),
    "data2_context4": (MeshConfig(data=2, context=4), "data+context"),
    "context2_tensor2": (MeshConfig(data=1, context=2, tensor=2), "context+tensor"),
}


def _inputs():
    """q, k, v, memory k and v, and one output cotangent per case (numpy: no eager compiles)."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)
    return normal(B, T, N, H), normal(B, T, K, H), normal(B, T, K, H), normal(B, S, K, H), normal(B, S, K, H), \
        normal(3, B, T, N, H)


SEGMENTS = np.asarray([[1] * 5 + [2] * 9 + [0] * 2, [1] * 11 + [3] * 5])  # packed, padded
MEMORY_SEGMENTS = np.asarray([[1] * 8, [1] * 5 + [0] * 3])


def _all_cases(strategy, impl="xla"):
    """(q, k, v, mem_k, mem_v, ct) -> (loss, outputs [3, B, T, N, H]): causal packed GQA with a
    window and ALiBi; bidirectional (an encoder's padding) with a window and soft-cap; cross."""
    def f(q, k, v, mem_k, mem_v, ct):
        attend = lambda *a, **kw: dot_product_attention(*a, impl=impl, context_strategy=strategy, **kw)
        outs = jnp.stack([
            attend(q, k, v, causal=True, q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS, window=6,
                   alibi_slopes=alibi_slopes(N)),
            attend(q, k, v, q_segment_ids=(SEGMENTS > 0) * 1, kv_segment_ids=(SEGMENTS > 0) * 1, window=5,
                   softcap=3.0),
            attend(q, mem_k, mem_v, kv_segment_ids=MEMORY_SEGMENTS)])
        return jnp.sum(outs * ct), outs
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.fixture(scope="module")
def reference():
    (_, outs), grads = _all_cases("ring")(*_inputs())  # no mesh: the xla backend on one device
    return outs, grads


def _context_parallel(mesh_name, strategies, impl):
    """Per strategy, the three cases' outputs and gradients under the mesh (one compile for all), the
    inputs split along the sequence."""
    mesh_cfg, parallelism = MESHES[mesh_name]
    mesh = make_mesh(mesh_cfg, jax.devices()[:int(np.prod(mesh_cfg.ici_sizes()))])
    rules = flax_rules(make_rules(*parse_parallelism(parallelism), activations=True))
    table = dict(rules)
    seq = P(table.get("batch"), "context")
    args = [jax.device_put(x, NamedSharding(mesh, seq)) for x in _inputs()[:5]]
    args.append(jax.device_put(_inputs()[5], NamedSharding(mesh, P(None, *seq))))
    cases = [_all_cases(strategy, impl) for strategy in strategies]
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        traced = jax.jit(lambda *xs: [f(*xs) for f in cases]).trace(*args)
        assert ("pallas_call" in str(traced.jaxpr)) == (impl == "pallas")
        lowered = traced.lower()
        assert ("all_gather" in lowered.as_text()) == ("all_gather" in strategies)  # the ring passes blocks on
        results = lowered.compile()(*args)
    return [(outs, grads) for (_, outs), grads in results]


def _assert_close(got, want, atol):
    (outs, grads), (ref_outs, ref_grads) = got, want
    np.testing.assert_allclose(outs, ref_outs, atol=atol)
    for g, w in zip(grads, ref_grads):
        np.testing.assert_allclose(g, w, atol=atol)


@pytest.mark.parametrize("mesh_name,strategy", [(m, "ring") for m in MESHES] + [("data2_context4", "all_gather")])
def test_context_parallel_attention_equals_one_device(reference, mesh_name, strategy):
    _assert_close(_context_parallel(mesh_name, [strategy], "xla")[0], reference, atol=2e-5)


def test_context_parallel_pallas_blocks_equal_one_device(reference):
    """The flash kernels as each block (positions offset per device and ring step), by ring and by
    all-gather, in values and gradients; under (data=2, context=4) only, both strategies in one compile:
    interpreted kernels compile slowly, and (context=4) runs the same per-device program on twice the
    batch."""
    for got in _context_parallel("data2_context4", ["ring", "all_gather"], "pallas"):
        _assert_close(got, reference, atol=2e-5)


def test_zigzag_layout_balances_causal_rows():
    """Device i of c holds chunks i and 2c-1-i: the tokens moved there are those its positions
    name, and every device has the same number of visible causal (query, key) pairs."""
    c, L = 4, 16
    mesh = make_mesh(MeshConfig(data=1, context=c), jax.devices()[:c])

    def per_device(tokens):
        moved = context._to_zigzag(tokens, c)
        return moved, context._zigzag_positions(L // c, c), context._from_zigzag(moved, c)

    tokens = jnp.arange(L)[None]
    moved, positions, back = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(None, "context"),
                                                   out_specs=P(None, "context")))(tokens)
    held = np.asarray(positions).reshape(c, L // c)
    half = L // (2 * c)
    for i in range(c):
        first, last = context.zigzag_chunks(i, c)
        np.testing.assert_array_equal(held[i], np.r_[first * half:(first + 1) * half, last * half:(last + 1) * half])
    np.testing.assert_array_equal(moved, positions)  # the data went where the positions say
    np.testing.assert_array_equal(back, tokens)
    pairs = [(held[i][:, None] + 1).sum() for i in range(c)]  # query p sees keys 0..p
    assert len(set(pairs)) == 1, pairs
    contiguous = [(np.arange(i * L // c, (i + 1) * L // c) + 1).sum() for i in range(c)]
    assert len(set(contiguous)) == c  # as a contiguous split they would differ


def _conds(jaxpr):
    """Every cond equation in jaxpr and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            yield eqn
        for value in eqn.params.values():
            for inner in (value if isinstance(value, (tuple, list)) else (value,)):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _conds(inner)


def test_causal_ring_steps_skip_the_invisible_half():
    """Each causal ring step runs one of three branches: the device's own block whole, or half
    of it (an earlier device's first chunk, or a later device's block for the second query
    chunk only): forward and backward, half the dot FLOPs of the whole block."""
    mesh = make_mesh(MeshConfig(data=1, context=4), jax.devices()[:4])
    x = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32, sharding=NamedSharding(mesh, P(None, "context")))
    loss = lambda q, k, v: dot_product_attention(q, k, v, causal=True).sum()
    with jax.set_mesh(mesh), nn.logical_axis_rules(flax_rules(make_rules("context", activations=True))):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x)
    branch_flops = [tuple(dot_flops(b.jaxpr) for b in eqn.params["branches"]) for eqn in _conds(jaxpr.jaxpr)]
    assert len(branch_flops) == 3  # the forward loop, its last step, the backward loop
    for whole, first_keys, last_queries in branch_flops:
        assert whole > 0 and first_keys == last_queries == whole / 2


def test_context_parallelism_refuses_what_it_cannot_do():
    mesh = make_mesh(MeshConfig(data=1, context=4), jax.devices()[:4])
    q = jnp.zeros((1, 12, 2, 4))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match="divisible by 8"):
            dot_product_attention(q, q, q)
        with pytest.raises(ValueError, match=r"^context-parallel .* impl xla/chunked/pallas/auto \(got 'cudnn'\)"):
            dot_product_attention(q, q, q, impl="cudnn")
    with pytest.raises(ValueError, match="unknown context_strategy"):
        dot_product_attention(q, q, q, context_strategy="tree")
    with pytest.raises(ValueError, match="context_strategy"):
        ModelConfig(vocab_size=8, d_model=8, num_heads=2, num_layers=1, d_ff=8, execution=dict(context_strategy="tree"))
