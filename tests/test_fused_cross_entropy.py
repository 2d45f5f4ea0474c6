"""Fused, vocabulary-chunked cross-entropy equals the plain loss on full logits: values and
gradients (hidden states, projection, bias), with smoothing, z-loss, padding weights, a
vocabulary that is not a multiple of the chunk, a tensor-sharded projection, inside an LM
train step, and in the seq2seq and MLM losses."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import parallel_cases
from tfm.models import DecoderLM
from tfm.models.embedding import Unembedding
from tfm.models.presets import tiny
from tfm.parallel import MeshConfig, make_mesh
from tfm.train import LMTask, MLMTask, OptimizerConfig, Seq2SeqTask, TrainConfig, Trainer
from tfm.train.losses import cross_entropy, fused_cross_entropy

TOL = 1e-5  # fp32
B, T, D, V = 4, 6, 8, 37  # V prime: no chunk size divides it
SMOOTH_Z = dict(label_smoothing=0.1, z_loss=1e-2)


def _inputs(bias: bool, seed: int = 0):
    r = np.random.default_rng(seed)
    hidden = jnp.asarray(r.normal(size=(B, T, D)), jnp.float32)
    kernel = jnp.asarray(r.normal(size=(V, D)), jnp.float32)
    b = jnp.asarray(r.normal(size=(V,)), jnp.float32) if bias else None
    targets = jnp.asarray(r.integers(0, V, (B, T)), jnp.int32)
    weights = jnp.asarray(np.r_[np.ones(T - 2), np.zeros(2)][None].repeat(B, 0), jnp.float32)  # padding
    return hidden, kernel, b, targets, weights


def _objective(loss_fn, hidden, kernel, bias, targets, weights, **kw):
    """(ce + z, all sums) as a Task would weigh them; differentiable in hidden, kernel, bias."""
    out = loss_fn(hidden, kernel, bias, targets, weights, **kw)
    return out.ce + out.z, out


def _plain(hidden, kernel, bias, targets, weights, **kw):
    logits = Unembedding(hidden, kernel, bias, jnp.float32).logits()
    return cross_entropy(logits, targets, weights, **kw)


def _fused(hidden, kernel, bias, targets, weights, vocab_chunk, **kw):
    return fused_cross_entropy(hidden, kernel, targets, weights, bias=bias, vocab_chunk=vocab_chunk, **kw)


def _value_and_grads(loss_fn, args, **kw):
    hidden, kernel, bias, targets, weights = args
    argnums = (0, 1) if bias is None else (0, 1, 2)
    f = jax.value_and_grad(functools.partial(_objective, loss_fn, **kw), argnums, has_aux=True)
    (_, sums), grads = jax.jit(f)(hidden, kernel, bias, targets, weights)
    return sums, grads


def _assert_match(got, ref):
    (sums, grads), (ref_sums, ref_grads) = got, ref
    errors = {k: float(jnp.max(jnp.abs(getattr(sums, k) - getattr(ref_sums, k)))) for k in ("ce", "z")}
    errors.update({f"d{n}": float(jnp.max(jnp.abs(g - r))) for n, g, r in zip(("hidden", "kernel", "bias"), grads, ref_grads)})
    print("fused vs plain max |diff|:", {k: f"{v:.1e}" for k, v in errors.items()})
    for k in ("ce", "z", "correct", "weight"):
        np.testing.assert_allclose(getattr(sums, k), getattr(ref_sums, k), atol=TOL, rtol=TOL, err_msg=k)
    for name, g, r in zip(("hidden", "kernel", "bias"), grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=0, err_msg=f"d loss / d {name}")


@pytest.mark.parametrize("vocab_chunk", [1, 8, 37])  # 8: 5 chunks of 8, 3 padding; 37: one chunk
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kw", [{}, SMOOTH_Z], ids=["plain", "smooth_z"])
def test_fused_equals_plain_loss_and_gradients(vocab_chunk, bias, kw):
    args = _inputs(bias)
    _assert_match(_value_and_grads(_fused, args, vocab_chunk=vocab_chunk, **kw),
                  _value_and_grads(_plain, args, **kw))


def test_ties_count_the_first_argmax_like_the_plain_path():
    hidden, kernel, _, targets, weights = _inputs(False)
    kernel = jnp.zeros_like(kernel)  # every logit equal: argmax is 0
    targets = targets.at[0, :].set(0)
    got = _fused(hidden, kernel, None, targets, weights, vocab_chunk=8)
    ref = _plain(hidden, kernel, None, targets, weights)
    assert float(got.correct) == float(ref.correct) == float(jnp.sum(weights * (targets == 0)))


def test_bfloat16_matmul_stays_close_to_plain():
    hidden, kernel, bias, targets, weights = _inputs(True)
    ref = cross_entropy(Unembedding(hidden, kernel, bias, jnp.bfloat16).logits(), targets, weights)
    got = fused_cross_entropy(hidden, kernel, targets, weights, bias=bias, dtype=jnp.bfloat16, vocab_chunk=8)
    np.testing.assert_allclose(got.ce, ref.ce, rtol=1e-5)


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=2, tensor=4), MeshConfig(data=1, fsdp=4, tensor=2)],
                         ids=["data2_tensor4", "fsdp4_tensor2"])
def test_tensor_sharded_projection_equals_single_device(mesh_cfg):
    """The projection split over `tensor` on V (vocab-parallel), tokens over the batch axes;
    the compiled step never gathers the whole projection onto a device."""
    mesh = make_mesh(mesh_cfg, jax.devices()[:8])
    batch_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1)
    hidden, kernel, bias, targets, weights = _inputs(True)
    vocab = 56  # split over tensor; chunk 12 gives 5 chunks of 12 and 4 padding columns
    r = np.random.default_rng(1)
    kernel = jnp.asarray(r.normal(size=(vocab, D)), jnp.float32)
    bias = jnp.asarray(r.normal(size=(vocab,)), jnp.float32)
    targets = jnp.asarray(r.integers(0, vocab, (B, T)), jnp.int32)
    args = (hidden, kernel, bias, targets, weights)
    ref = _value_and_grads(_plain, args, **SMOOTH_Z)
    shard = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    tokens = P(batch_axes or None)
    sharded = (shard(hidden, tokens), shard(kernel, P("tensor")), shard(bias, P("tensor")),
               shard(targets, tokens), shard(weights, tokens))
    f = jax.jit(jax.value_and_grad(functools.partial(_objective, _fused, vocab_chunk=12, **SMOOTH_Z),
                                   (0, 1, 2), has_aux=True))
    (_, sums), grads = f(*sharded)
    _assert_match((sums, grads), ref)
    assert grads[1].sharding.spec[0] == "tensor"
    hlo = f.lower(*sharded).compile().as_text()
    whole_kernel = f"f32[{vocab},{D}]"
    gathers = [line for line in hlo.splitlines() if "all-gather" in line and whole_kernel in line]
    assert not gathers, "the projection was gathered whole:\n" + "\n".join(gathers)


def _train_step(task, mesh_name="data2_tensor4"):
    """Metrics and params after one SGD step of the tiny GPT-2-style decoder."""
    model, _ = parallel_cases.setup("decoder")
    batch = parallel_cases._batch("decoder", np.random.default_rng(0))
    mesh_cfg, parallelism = parallel_cases.MESHES[mesh_name]
    cfg = TrainConfig(batch_size=parallel_cases.B, mesh=mesh_cfg, parallelism=parallelism,
                      optimizer=OptimizerConfig(name="sgd", learning_rate=0.5))
    n = int(np.prod(mesh_cfg.ici_sizes()))
    trainer = Trainer(model, task, cfg, make_mesh(mesh_cfg, jax.devices()[:n])).setup(batch)
    state, metrics = trainer.train_step(trainer.init_state(), trainer.global_batch(batch))
    return jax.device_get(metrics), jax.device_get(state.params)


def test_lm_train_step_with_vocab_chunk_equals_plain():
    """Tensor-sharded step; V 64, chunk 24: 3 chunks of 22 columns, 2 of them padding."""
    (fused, fused_params), (plain, plain_params) = (
        _train_step(LMTask(vocab_chunk=24, **SMOOTH_Z)), _train_step(LMTask(**SMOOTH_Z)))
    for k in ("loss", "z_loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(fused[k], plain[k], rtol=TOL, err_msg=k)
    for a, b in zip(jax.tree.leaves(fused_params), jax.tree.leaves(plain_params)):
        np.testing.assert_allclose(a, b, atol=TOL)


def _task_loss_and_grads(task, family):
    """((objective, metrics), grads) of the task's loss on the tiny model, and whether the
    traced loss went through the fused cross-entropy."""
    model, _ = parallel_cases.setup(family)
    batch = parallel_cases._batch(family, np.random.default_rng(0))
    rng = jax.random.PRNGKey(0)
    params = jax.jit(task.init_variables, static_argnums=0)(model, rng, batch)["params"]
    loss = functools.partial(task.loss, model, batch=batch, rng=rng, totals=task.weight_totals(batch))
    fused = "name=_fused_token_terms" in str(jax.make_jaxpr(loss)(params))
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params), fused


@pytest.mark.parametrize("family, task_cls", [("decoder", LMTask), ("encdec", Seq2SeqTask),
                                              ("encoder", MLMTask)])
def test_tasks_with_vocab_chunk_use_the_fused_loss_and_equal_plain(family, task_cls):
    ((objective, metrics), grads), fused = _task_loss_and_grads(task_cls(vocab_chunk=24, **SMOOTH_Z), family)
    ((ref_objective, ref_metrics), ref_grads), ref_fused = _task_loss_and_grads(task_cls(**SMOOTH_Z), family)
    assert fused and not ref_fused
    np.testing.assert_allclose(objective, ref_objective, rtol=TOL)
    np.testing.assert_allclose(metrics["accuracy"], ref_metrics["accuracy"], rtol=TOL)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, atol=TOL)


def test_model_unembedding_gives_the_models_logits():
    """logits=False hands over exactly what the logits are made of (tied and untied)."""
    for cfg in (tiny("decoder", num_layers=1), tiny("llama", num_layers=1)):
        model, tokens = DecoderLM(cfg), jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
        params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)
        out = jax.jit(functools.partial(model.apply, logits=False))(params, tokens)
        assert type(out) is type(model.apply(params, tokens)) and out.logits is None  # one output type
        head = out.unembedding
        assert head.kernel.shape == (cfg.vocab_size, cfg.d_model)
        np.testing.assert_allclose(head.logits(), jax.jit(model.apply)(params, tokens).logits, atol=1e-6)


def test_vocab_chunk_must_be_positive():
    with pytest.raises(ValueError, match="vocab_chunk"):
        LMTask(vocab_chunk=0)
