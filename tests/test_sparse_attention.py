"""Sparse attention patterns (tfm.kernels.sparsity) through the one entry point: the Pallas kernels (interpret
mode; the loop driver of GPU/CPU, and the TPU grid driver with its scalar-prefetched block lists) against the
xla reference with the same mask materialised (and, for BigBird, the chunked backend, which masks every
chunk: its padding of S to a chunk multiple must not resize a BigBird table), and the tiles the kernels visit
against a brute-force count of the non-empty tiles of that mask.

Each case: output and dq, dk, dv, fp32, max-abs <= 1e-5 (output) and 1e-4 (gradients).

Under a (data=2, tensor=2) mesh of simulated CPU devices the kernels run per device on [B/2 | N/2]
shards of every pattern and equal the single-device kernels (values and gradients, 1e-5), and an
encoder with `attention_sparsity` (Longformer) gives the single-device loss and gradients (1e-5).
"""
import dataclasses
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding, PartitionSpec as P

from parallel_cases import B, _batch
from tfm.kernels import flash_attention as fa
from tfm.models import EncoderModel, presets
from tfm.kernels import sparsity
from tfm.ops import attention, select
from tfm.parallel import MeshConfig, flax_rules, make_mesh, make_rules
from tfm.train import MLMTask, TrainConfig, Trainer


@dataclasses.dataclass(frozen=True)
class Case:
    pattern: sparsity.Pattern
    T: int = 64
    S: int = 64
    N: int = 2
    K: int = 2
    causal: bool = False
    window: Optional[int] = None
    key_padding: bool = False
    blocks: fa.BlockSizes = fa.BlockSizes(8, 8)
    backend: Optional[str] = None  # "tpu": the grid driver (flash_attention called directly)
    chunked: bool = False  # also the chunked backend (chunks of 32 keys, each masked, none skipped)


CASES = {
    "strided_causal_uneven_tiles_mqa_grid_driver": Case(sparsity.Strided(8), N=2, K=1, causal=True,
                                                       blocks=fa.BlockSizes(8, 16, 16, 8), backend="tpu"),
    "fixed_bidirectional_gqa": Case(sparsity.Fixed(16, summary=3), N=4, K=2),
    "bigbird_key_padding": Case(sparsity.BigBird(16, window=1, globals=1, random=1, seed=3), T=128, S=104,
                                key_padding=True, blocks=fa.BlockSizes(16, 16), chunked=True),
    "longformer_causal_ragged": Case(sparsity.Longformer(window=9, globals=5), T=60, S=60, causal=True),
}


def _mask_args(case: Case):
    kv_seg = None
    if case.key_padding:
        kv_seg = jnp.asarray(np.arange(case.S)[None] < case.S - 30, jnp.int32)
    return dict(causal=case.causal, window=case.window, sparsity=case.pattern, kv_segment_ids=kv_seg)


def _inputs(case: Case):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (1, case.T, case.N, 16), jnp.float32)
    k, v = (jax.random.normal(key, (1, case.S, case.K, 16), jnp.float32) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape, jnp.float32)


def _run(case: Case, impl: str):
    def loss(q, k, v, ct):
        if impl == "pallas" and case.backend is not None:
            o = fa.flash_attention(q, k, v, block_sizes=case.blocks, backend=case.backend, **_mask_args(case))
        else:
            o = attention.dot_product_attention(q, k, v, impl=impl, **_mask_args(case), chunk_size=32,
                                                block_sizes=case.blocks if impl == "pallas" else None)
        return jnp.sum(o * ct), o

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*_inputs(case))


def _brute_force_tiles(case: Case, block_q: int, block_kv: int) -> np.ndarray:
    """bool [T/bq, S/bk]: tiles of the materialised [T, S] mask (without segment ids) holding a visible pair."""
    args = {**_mask_args(case), "sparsity": sparsity.coerce(case.pattern)}
    args.pop("kv_segment_ids")
    visible = np.asarray(attention.visibility(jnp.arange(case.T)[None], jnp.arange(case.S)[None], None, None,
                                              **args))[0]
    T, S = -(-case.T // block_q) * block_q, -(-case.S // block_kv) * block_kv
    visible = np.pad(visible, ((0, T - case.T), (0, S - case.S)))
    return visible.reshape(T // block_q, block_q, S // block_kv, block_kv).any(axis=(1, 3))


@pytest.mark.parametrize("name", list(CASES))
def test_pattern_matches_xla_and_visits_only_non_empty_tiles(name):
    case = CASES[name]
    (_, o_ref), g_ref = _run(case, "xla")
    for impl in ("pallas", "chunked") if case.chunked else ("pallas",):
        (_, o), g = _run(case, impl)
        np.testing.assert_allclose(o, o_ref, rtol=0, atol=1e-5, err_msg=impl)
        for label, a, b in zip("qkv", g, g_ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-4, err_msg=f"{impl} d{label}")
    for bq, bk in (case.blocks.block_q, case.blocks.block_kv), case.blocks.backward:  # forward, backward tiles
        nq, nk = -(-case.T // bq), -(-case.S // bk)
        cfg = fa.TileConfig(causal=case.causal, window=case.window, softcap=None, scale=1.0,
                         kv_len=None if case.S % bk == 0 else case.S, segments=False, alibi=False, groups=1,
                         block_q=bq, block_kv=bk, driver="loop", interpret=True, sparsity=case.pattern)
        seen = fa.visible_tiles(cfg, nq, nk)
        brute = _brute_force_tiles(case, bq, bk)
        np.testing.assert_array_equal(seen, brute)
        assert seen.sum() < 0.75 * nq * nk  # the pattern is sparse at this tiling
        index, count = fa.block_lists(seen)  # what the kernels visit: row r, index[r, :count[r]]
        assert count.sum() == brute.sum()
        for r in range(nq):
            np.testing.assert_array_equal(index[r, :count[r, 0]], np.flatnonzero(brute[r]))


def test_kernel_reads_no_value_outside_its_block_lists():
    """NaN values in one key block reach exactly the query blocks whose BigBird row lists it: a kernel that
    touched an unlisted tile (even fully masked: 0 * NaN) would spread NaN to every row."""
    pattern = sparsity.BigBird(16, window=1, globals=1, random=1, seed=5)
    T, poisoned = 128, 5
    q, k, v, _ = _inputs(Case(pattern, T=T, S=T))
    v = v.at[:, poisoned * 16:(poisoned + 1) * 16].set(jnp.nan)
    o = jax.jit(lambda q, k, v: attention.dot_product_attention(
        q, k, v, sparsity=pattern, impl="pallas", block_sizes=fa.BlockSizes(16, 16)))(q, k, v)
    sees = pattern.table(T // 16, T // 16)[:, poisoned]  # [q blocks]
    nan_rows = np.isnan(np.asarray(o)).any(axis=(0, 2, 3)).reshape(T // 16, 16).all(axis=1)  # [q blocks]
    np.testing.assert_array_equal(nan_rows, sees)
    assert 0 < sees.sum() < T // 16


def test_bigbird_table_is_deterministic_and_has_its_block_counts():
    """Global rows see every block, every row sees the global columns and its window, each other row holds
    `random` further blocks; the same seed gives the same table, another seed another."""
    pattern = sparsity.BigBird(8, window=1, globals=2, random=3, seed=0)
    table = pattern.table(20, 20)
    assert table[:2].all() and table[:, :2].all()
    band = np.abs(np.arange(20)[:, None] - np.arange(20)[None]) <= 1
    assert (table | ~band).all()
    structural = band | (np.arange(20)[None] < 2)
    np.testing.assert_array_equal((table & ~structural)[2:].sum(axis=1), 3)
    np.testing.assert_array_equal(sparsity.BigBird(8, 1, 2, 3, seed=0).table(20, 20), table)
    assert (sparsity.BigBird(8, 1, 2, 3, seed=1).table(20, 20) != table).any()


def test_patterns_refused_where_they_cannot_apply():
    q = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="explicit positions"):
        attention.dot_product_attention(q, q, q, sparsity=sparsity.Strided(4), q_positions=jnp.arange(16)[None],
                                        kv_positions=jnp.arange(16)[None])
    with pytest.raises(ValueError, match="impl 'cudnn' does not implement sparsity"):
        attention.dot_product_attention(q, q, q, sparsity=sparsity.Strided(4), impl="cudnn")
    with pytest.raises(ValueError, match="tiles that divide it"):
        attention.dot_product_attention(q, q, q, sparsity=sparsity.BigBird(4), impl="pallas",
                                        block_sizes=fa.BlockSizes(8, 8))
    with pytest.raises(ValueError, match="sparsity must be one of"):
        sparsity.coerce({"kind": "butterfly"})
    assert sparsity.coerce({"kind": "fixed", "stride": 8, "summary": 2}) == sparsity.Fixed(8, 2)


@pytest.mark.parametrize("platform, dtype, impl", [("cpu", jnp.float32, "xla"), ("tpu", jnp.float32, "pallas"),
                                                   ("gpu", jnp.bfloat16, "pallas"), ("gpu", jnp.float32, "xla")])
def test_auto_picks_the_kernels_for_a_pattern_where_they_run(monkeypatch, platform, dtype, impl):
    monkeypatch.setattr(select, "current_platform", lambda: platform)
    monkeypatch.setattr(select, "cuda_present", lambda: True)
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), dtype)
    assert select.choose_impl(q, q, sparse=True) == impl


def test_model_config_takes_a_pattern_by_its_fields():
    cfg = presets.tiny("encoder", attention_sparsity={"kind": "bigbird", "block": 16, "random": 2, "seed": 7})
    assert cfg.attention_sparsity == sparsity.BigBird(16, window=1, globals=1, random=2, seed=7)
    with pytest.raises(ValueError, match="ModelConfig.attention_sparsity: sparsity must be one of"):
        presets.tiny("encoder", attention_sparsity={"kind": "butterfly"})
    with pytest.raises(ValueError, match="Linformer"):
        presets.tiny("encoder", attention_sparsity=sparsity.Strided(4), linformer_length=8)


MESH_PATTERNS = ((sparsity.Strided(8), True), (sparsity.Fixed(16, summary=3), False),
                 (sparsity.BigBird(8, window=1, globals=1, random=1, seed=2), False),
                 (sparsity.Longformer(window=5, globals=3), True))  # (pattern, causal)
DATA2_TENSOR2 = MeshConfig(data=2, tensor=2)


def _every_pattern(impl: str):
    """(q, k, v, ct) -> (sum(outputs * ct), outputs [4, B, T, N, H]): the four patterns in one program."""
    def f(q, k, v, ct):
        outs = jnp.stack([attention.dot_product_attention(
            q, k, v, impl=impl, sparsity=p, causal=causal, block_sizes=fa.BlockSizes(8, 8) if impl == "pallas" else None)
            for p, causal in MESH_PATTERNS])
        return jnp.sum(outs * ct), outs
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))


def _kernel_shapes(jaxpr, inside=False):
    """{(inside shard_map, [B, N|K] of a 4-D operand)} of every pallas_call in jaxpr and its sub-jaxprs."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found |= {(inside, tuple(x.aval.shape[:2])) for x in eqn.invars if x.aval.ndim == 4}
        for sub in jaxprs_in_params(eqn.params):
            found |= _kernel_shapes(sub, inside or eqn.primitive.name == "shard_map")
    return found


def test_patterns_under_a_mesh_equal_one_device():
    """data=2 x tensor=2: each device runs the sparse kernels on 2 of the 4 rows and 2 of the 4 query
    heads (1 of the 2 kv heads); values (1e-5) and dq, dk, dv (1e-4) equal the one-device xla reference."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 32, n, 8), np.float32) for n in (4, 2, 2))
    ct = rng.standard_normal((len(MESH_PATTERNS), 4, 32, 4, 8), np.float32)
    (_, want), want_grads = _every_pattern("xla")(q, k, v, ct)
    mesh = make_mesh(DATA2_TENSOR2, jax.devices()[:4])
    split = lambda x, *lead: jax.device_put(x, NamedSharding(mesh, P(*lead, "data", None, "tensor")))
    args = split(q), split(k), split(v), split(ct, None)
    with jax.set_mesh(mesh), nn.logical_axis_rules(flax_rules(make_rules("data", "tensor", activations=True))):
        traced = _every_pattern("pallas").trace(*args)
        (_, got), grads = traced.lower().compile()(*args)
    assert _kernel_shapes(traced.jaxpr.jaxpr) == {(True, (2, 2)), (True, (2, 1))}  # [B/2, N/2 | K/2] per device
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    for label, a, b in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4, err_msg=f"d{label}")


def test_sparse_encoder_under_a_mesh_equals_one_device():
    """A one-layer encoder with a Longformer `attention_sparsity`: its MLM loss and parameter gradients
    by the kernels under (data=2, tensor=2) equal the one-device xla reference's (1e-5), same parameters."""
    config = presets.tiny("encoder", num_layers=1, attention_sparsity=sparsity.Longformer(window=3, globals=2))
    task, batch = MLMTask(), _batch("encoder", np.random.default_rng(0))

    def loss_and_grads(model, mesh_config, parallelism, params=None):
        mesh = make_mesh(mesh_config, jax.devices()[:int(np.prod(mesh_config.ici_sizes()))])
        trainer = Trainer(model, task, TrainConfig(batch_size=B, mesh=mesh_config, parallelism=parallelism),
                          mesh).setup(batch)
        if params is None:  # random normal values of the parameters' shapes: no init program to compile
            shapes = jax.eval_shape(lambda key: nn.unbox(task.init_variables(model, key, batch)["params"]),
                                    jax.random.PRNGKey(0))
            rng = np.random.default_rng(1)
            params = jax.tree.map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)
        loss = lambda p, b: task.loss(model, p, b, jax.random.PRNGKey(0), task.weight_totals(b),
                                      deterministic=True)[0]
        with trainer.context():
            f = jax.jit(jax.value_and_grad(loss), in_shardings=(trainer.param_shardings, trainer.batch_sharding))
            return f(params, trainer.global_batch(batch)), params

    (want, want_grads), params = loss_and_grads(EncoderModel(config), MeshConfig(data=1), "data")
    kernels = EncoderModel(config.replace(attention_impl="pallas", attention_block_sizes=fa.BlockSizes(8, 8)))
    (got, grads), _ = loss_and_grads(kernels, DATA2_TENSOR2, "data+tensor", params)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    flat, want_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)
    assert len(flat) == len(want_flat) and sum(float(np.abs(g).max()) > 1e-4 for g in want_flat) > len(flat) // 2
    for (path, a), b in zip(flat, want_flat):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("window,pattern,tile", [(32, None, 128), (None, sparsity.Longformer(32, globals=1), 128),
                                                 (None, sparsity.BigBird(32, window=1, globals=1, random=1), 32),
                                                 (None, sparsity.Strided(32), 128)])
def test_visited_share_counts_the_tiles_of_the_materialised_mask(window, pattern, tile):
    """visited_share (benchmarks and experiments/long_context report it) equals the share of (tile x tile)
    tiles of the brute-force [1024, 1024] bidirectional mask holding a visible pair; BigBird refuses
    tiles that do not divide its block, as the kernels do."""
    L = 1024
    visible = np.asarray(attention.visibility(jnp.arange(L)[None], jnp.arange(L)[None], None, None, causal=False,
                                              window=window, sparsity=pattern))[0]
    brute = visible.reshape(L // tile, tile, L // tile, tile).any(axis=(1, 3)).mean()
    assert fa.visited_share(L, window=window, sparsity=pattern, block=tile) == pytest.approx(brute, abs=0)
    assert (brute == 1.0) == isinstance(pattern, sparsity.Strided)  # stride 32 < tile: every tile holds a column
    if isinstance(pattern, sparsity.BigBird):
        with pytest.raises(ValueError, match="tiles that divide it"):
            fa.visited_share(L, sparsity=pattern, block=128)
