"""Losses, schedules, optimizers, and gradient accumulation equal to the full batch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel_cases
from tfm.parallel import MeshConfig
from tfm.train import OptimizerConfig, TrainConfig, Trainer, cross_entropy, make_optimizer, make_schedule


def test_cross_entropy_smoothing_weights_and_z_loss():
    logits = jnp.log(jnp.asarray([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    targets, weights = jnp.asarray([0, 1]), jnp.asarray([1.0, 0.0])  # second token is padding
    out = cross_entropy(logits, targets, weights)
    np.testing.assert_allclose(out["ce"], -np.log(0.7), rtol=1e-6)
    assert out["weight"] == 1 and out["correct"] == 1
    perfect = cross_entropy(jnp.log(jnp.asarray([[0.9, 0.05, 0.05]])), jnp.asarray([0]),
                            label_smoothing=0.1)
    np.testing.assert_allclose(perfect["ce"], 0.0, atol=1e-6)  # smoothed target itself scores 0
    z = cross_entropy(logits + 2.0, targets, weights, z_loss=1e-2)["z"]
    np.testing.assert_allclose(z, 1e-2 * 2.0 ** 2, rtol=1e-5)  # log Z = 2 after the shift


def test_schedules():
    noam = make_schedule(OptimizerConfig(schedule="noam", learning_rate=1.0, warmup_steps=100), 1000)
    assert float(noam(99)) == pytest.approx(1.0) and float(noam(399)) == pytest.approx(0.5)
    noam_paper = make_schedule(OptimizerConfig(schedule="noam", learning_rate=1.0,
                                               warmup_steps=4000, noam_d_model=512), 1)
    assert float(noam_paper(3999)) == pytest.approx(512 ** -0.5 * 4000 ** -0.5, rel=1e-5)
    cos = make_schedule(OptimizerConfig(schedule="cosine", learning_rate=2.0, warmup_steps=10), 110)
    assert float(cos(5)) == pytest.approx(1.0) and float(cos(60)) == pytest.approx(1.0, abs=1e-3)
    assert float(cos(110)) == pytest.approx(0.0, abs=1e-6)
    lin = make_schedule(OptimizerConfig(schedule="linear", learning_rate=1.0, end_lr_factor=0.1), 10)
    assert float(lin(10)) == pytest.approx(0.1)


@pytest.mark.parametrize("name", ["adam", "adamw", "lamb", "adafactor", "sgd"])
def test_each_optimizer_reduces_a_quadratic(name):
    tx, _ = make_optimizer(OptimizerConfig(name=name, learning_rate=0.05, weight_decay=0.01), 100)
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}
    state = tx.init(params)
    loss = lambda p: sum(jnp.sum(x ** 2) for x in jax.tree.leaves(p))
    for _ in range(20):
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        params = jax.tree.map(jnp.add, params, updates)
    assert loss(params) < 0.9 * 15.0


def test_gradient_accumulation_equals_full_batch():
    model, task = parallel_cases.setup("decoder")
    batch = parallel_cases._batch("decoder", np.random.default_rng(0))
    batch["weights"][:4, 5:] = 0  # unequal weights across microbatches
    out = []
    for micro in (1, 4):
        # SGD: params compare directly (Adam would amplify fp noise in zero-gradient params).
        cfg = TrainConfig(batch_size=8, microbatches=micro, mesh=MeshConfig(data=8),
                          optimizer=OptimizerConfig(name="sgd", learning_rate=0.5))
        tr = Trainer(model, task, cfg).setup(batch)
        state = tr.init_state()
        state, m = tr.train_step(state, tr.global_batch(batch))
        out.append((m, jax.device_get(state.params)))
    (m1, p1), (m4, p4) = out
    for k in ("loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(m4[k], m1[k], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(a, b, atol=1e-6)
