"""The token lookup that keeps a sharded table sharded (tfm.layers.embeddings.sharded_lookup,
ExecutionConfig.embedding_impl) on 8 CPU devices: values and table gradients equal the plain
lookup's under every rule set that shards the table (fsdp, fsdp+expert, data+fsdp, fsdp+context on
D; tensor on V, Megatron's vocab-parallel form), no collective in the compiled program moves
anything table-sized, a bad id still embeds as NaN, the gradient is accumulated in fp32 (to fp32
rounding of a float64 sum of the bf16 cotangents, where a bf16 accumulation is far off). The train
steps of test_parallel_families run it too ("auto": their tables have more rows than a device tokens)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

from benchmarks.embedding_gradient import zipf_ids
from tfm import parallel
from tfm.config import ExecutionConfig
from tfm.layers.embeddings import sharded_lookup
from tfm.models import DecoderLM
from tfm.models.presets import tiny
from tfm.parallel import MeshConfig, make_mesh
from tfm.parallel.mesh import AXES
from tfm.preflight.analysis import _largest_array, read_hlo
from tfm.train import LMTask, TrainConfig, Trainer

V, D, B, T = 512, 64, 8, 4


def _mesh(**sizes):
    return jax.make_mesh(tuple(sizes.get(a, 1) for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _lookup_and_grad(styles, sizes, table, ids, ct, lookup, dtype=jnp.float32):
    """(rows [B, T, D] fp32, d<rows, ct>/dtable [V, D], compiled HLO text) with the table laid out by
    the rule set's parameter rules and the ids by its batch rules."""
    mesh = _mesh(**sizes)
    rules = parallel.make_rules(*styles)
    activation_rules = parallel.flax_rules(parallel.make_rules(*styles, activations=True))

    def rows_and_loss(table, ids):
        with nn.logical_axis_rules(activation_rules), parallel.param_rules(rules):
            rows = sharded_lookup(table, ids, dtype=dtype, lookup=lookup).astype(jnp.float32)
        return jnp.sum(jnp.nan_to_num(rows) * ct), rows

    with jax.set_mesh(mesh):
        table_sharding = NamedSharding(mesh, parallel.logical_to_spec(("vocab", "embed"), table.shape, mesh, rules))
        step = jax.jit(jax.value_and_grad(rows_and_loss, has_aux=True),
                       in_shardings=(table_sharding, parallel.batch_sharding(mesh, rules)))
        (_, rows), grad = step(table, ids)
        text = step.lower(table, ids).compile().as_text()
    return np.asarray(rows), np.asarray(grad), text


@pytest.mark.parametrize("styles,sizes", [
    (("fsdp",), dict(fsdp=8)),
    (("fsdp", "expert"), dict(fsdp=4, expert=2)),
    (("data", "fsdp"), dict(data=2, fsdp=4)),
    (("fsdp", "context"), dict(fsdp=4, context=2)),
    (("fsdp", "tensor"), dict(fsdp=4, tensor=2)),
    (("tensor",), dict(data=4, tensor=2)),
], ids=lambda x: "+".join(x) if isinstance(x, tuple) else "x".join(map(str, x.values())))
def test_sharded_lookup_equals_the_plain_one(styles, sizes):
    """Rows exactly equal, table gradients to fp32 rounding (the scatter-adds sum in another order);
    id -1 and id V embed as NaN rows; no collective's array is larger than a device's shard of the table (the gradient's sum over `data`
is that size; a gathered table or its whole gradient would be 2-8x it)."""
    table = jax.random.normal(jax.random.PRNGKey(0), (V, D))
    ids = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, V).at[0, 0].set(-1).at[3, 2].set(V)
    ct = jax.random.normal(jax.random.PRNGKey(2), (B, T, D))
    rows, grad, text = _lookup_and_grad(styles, sizes, table, ids, ct, "sharded")
    want_rows, want_grad, _ = _lookup_and_grad(styles, {}, table, ids, ct, "xla")
    assert np.isnan(rows[0, 0]).all() and np.isnan(rows[3, 2]).all()
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(grad, want_grad, rtol=0, atol=1e-5)
    collectives, _, _ = read_hlo(text)
    shard_bytes = table.nbytes // np.prod([n for n in sizes.values()]) * sizes.get("data", 1)
    for kind, entry in collectives.items():
        for shape in entry["shapes"]:
            assert _largest_array(shape)[0] <= shard_bytes, (kind, shape, "larger than a device's table shard")


def test_the_gradient_accumulates_in_fp32():
    """bf16 rows (the model's compute dtype): the fp32 table's gradient under fsdp is the float64 sum
    of the bf16 cotangents to fp32 rounding (relative 1e-6), on Zipf-distributed ids where one row
    gathers thousands of cotangents; the same sum accumulated in bf16 is >= 1e-3 off."""
    vocab, tokens = 64, (8, 512)
    ids = jnp.asarray(zipf_ids(vocab, np.prod(tokens), 1.1).reshape(tokens))
    ct = jax.random.normal(jax.random.PRNGKey(3), tokens + (D,)).astype(jnp.bfloat16).astype(jnp.float32)
    table = jnp.zeros((vocab, D))
    _, grad, _ = _lookup_and_grad(("fsdp",), dict(fsdp=8), table, ids, ct, "sharded", dtype=jnp.bfloat16)
    exact = np.zeros((vocab, D))
    np.add.at(exact, np.asarray(ids).reshape(-1), np.asarray(ct, np.float64).reshape(-1, D))
    scale = np.abs(exact).max()
    assert np.abs(grad - exact).max() / scale < 1e-6
    in_bf16 = jnp.zeros((vocab, D), jnp.bfloat16).at[ids.reshape(-1)].add(ct.reshape(-1, D).astype(jnp.bfloat16))
    assert np.abs(np.asarray(in_bf16, np.float64) - exact).max() / scale > 1e-3


def test_a_bad_setting_is_one_line():
    with pytest.raises(ValueError, match="embedding_impl='gather' is not one of"):
        ExecutionConfig(embedding_impl="gather")
    with pytest.raises(ValueError, match="embedding lookup 'gather' is not one of"):
        sharded_lookup(jnp.zeros((4, 2)), jnp.zeros((1, 1), jnp.int32), lookup="gather")


@pytest.mark.parametrize("impl", ["sharded", "xla"])
def test_the_config_value_reaches_the_train_step(impl):
    """ModelConfig.execution.embedding_impl reaches the Trainer's step (fsdp over 8 CPU devices, a tiny
    LM whose 64-row table has more rows than a device's 16 tokens): "sharded" traces the lookup's
    shard_map with its all-to-all, "xla" a plain gather of the table."""
    model = DecoderLM(tiny("decoder", num_layers=1, embedding_impl=impl))
    cfg = TrainConfig(num_train_steps=1, batch_size=8, mesh=MeshConfig(data=1, fsdp=8), parallelism="fsdp")
    batch = {"inputs": np.ones((8, 16), np.int32), "targets": np.ones((8, 16), np.int32),
             "weights": np.ones((8, 16), np.float32)}
    trainer = Trainer(model, LMTask(), cfg, make_mesh(cfg.mesh, jax.devices()[:8])).setup(batch)
    with trainer.context():
        jaxpr = str(trainer.jitted_train_step.trace(trainer.abstract_state, trainer.global_batch(batch)).jaxpr)
    assert ("all_to_all" in jaxpr) == (impl == "sharded"), impl
