"""Losses, schedules, optimizers, and gradient accumulation equal to the full batch."""
import dataclasses
import re

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
    np.testing.assert_allclose(out.ce, -np.log(0.7), rtol=1e-6)
    assert out.weight == 1 and out.correct == 1
    perfect = cross_entropy(jnp.log(jnp.asarray([[0.9, 0.05, 0.05]])), jnp.asarray([0]),
                            label_smoothing=0.1)
    np.testing.assert_allclose(perfect.ce, 0.0, atol=1e-6)  # smoothed target itself scores 0
    z = cross_entropy(logits + 2.0, targets, weights, z_loss=1e-2).z
    np.testing.assert_allclose(z, 1e-2 * 2.0 ** 2, rtol=1e-5)  # log Z = 2 after the shift


def written_out_loss(logits, targets, weights, label_smoothing, z_loss):
    """The smoothed cross-entropy plus z-loss written out with jax.nn.log_softmax, autodiffed as is."""
    x = logits.astype(jnp.float32)
    V = x.shape[-1]
    log_p = jax.nn.log_softmax(x)
    soft = jax.nn.one_hot(targets, V) * (1 - label_smoothing) + (1 - jax.nn.one_hot(targets, V)) * label_smoothing / (V - 1)
    entropy = jnp.sum(jnp.where(soft > 0, soft * jnp.log(jnp.where(soft > 0, soft, 1.0)), 0.0), -1)
    ce = -jnp.sum(soft * log_p, -1) + entropy
    return jnp.sum(ce * weights) + z_loss * jnp.sum(jax.nn.logsumexp(x, -1) ** 2 * weights)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_cross_entropy_gradient_matches_the_written_out_loss(dtype, tolerance):
    """cross_entropy's own VJP (one elementwise pass, in the logits' dtype) against autodiff of the
    formula, with smoothing, z-loss and a padding weight; the gradient keeps the logits' dtype."""
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    logits = (3 * jax.random.normal(keys[0], (2, 5, 37))).astype(dtype)
    targets = jax.random.randint(keys[1], (2, 5), 0, 37)
    weights = jnp.ones((2, 5)).at[1, 3:].set(0.0)
    for smoothing, z in ((0.0, 0.0), (0.1, 1e-3)):
        ours = lambda x: (lambda t: t.ce + t.z)(cross_entropy(x, targets, weights, label_smoothing=smoothing, z_loss=z))
        value, grad = jax.value_and_grad(ours)(logits)
        want_value, want = jax.value_and_grad(written_out_loss)(logits.astype(jnp.float32), targets, weights, smoothing, z)
        assert grad.dtype == dtype
        np.testing.assert_allclose(value, want_value, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(grad, np.float32), want, atol=tolerance * float(jnp.abs(want).max()))
        assert float(jnp.abs(grad[1, 3:]).max()) == 0.0  # padding tokens get no gradient


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


def bert_learning_rate(step, peak, warmup, total):
    """BERT's create_optimizer (optimization.py), written out: polynomial decay (power 1) of
    the peak over `total` steps counted from step 0, replaced by peak * step / warmup before
    `warmup`."""
    return peak * step / warmup if step < warmup else peak * (1.0 - min(step, total) / total)


def test_bert_linear_schedule_counts_its_decay_from_step_zero():
    cfg = OptimizerConfig(schedule="bert_linear", learning_rate=2.0, warmup_steps=10)
    lr = make_schedule(cfg, 40)
    for step in [0, 1, 9, 10, 11, 25, 39, 40, 50]:
        assert float(lr(step)) == pytest.approx(bert_learning_rate(step, 2.0, 10, 40), abs=1e-6), step
    assert float(lr(10)) == pytest.approx(1.5)  # the drop at the end of warmup: peak * (1 - 10 / 40)
    assert float(make_schedule(OptimizerConfig(schedule="bert_linear", learning_rate=1.0,
                                               end_lr_factor=0.1), 10)(10)) == pytest.approx(0.1)


def test_adamw_without_bias_correction_is_berts_optimizer():
    """Six steps of BERT's AdamWeightDecayOptimizer in numpy (m, v without 1 - b^t divisors,
    update m / (sqrt(v) + eps) + wd * param for kernels only, times the lr, after clipping the
    global norm to 1) against make_optimizer with bias_correction=False and bert_linear; the
    bias-corrected optimizer ends measurably elsewhere, so the comparison can tell them apart."""
    cfg = OptimizerConfig(name="adamw", learning_rate=0.1, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01,
                          bias_correction=False, schedule="bert_linear", warmup_steps=2, clip_grad_norm=1.0)
    rng = np.random.default_rng(0)
    params = {"dense": {"kernel": rng.normal(size=(4, 3)), "bias": rng.normal(size=(3,))},
              "attn": {"bias": rng.normal(size=(2, 3))}, "norm": {"scale": rng.normal(size=(3,))}}
    decays = {"dense": {"kernel": True, "bias": False}, "attn": {"bias": False}, "norm": {"scale": False}}
    grads = [jax.tree.map(lambda x: rng.normal(size=x.shape) * 3.0, params) for _ in range(6)]

    def run(config):
        tx, _ = make_optimizer(config, 6)
        p = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        state = tx.init(p)
        for g in grads:
            updates, state = tx.update(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g), state, p)
            p = jax.tree.map(jnp.add, p, updates)
        return p

    ref = jax.tree.map(np.copy, params)
    m, v = jax.tree.map(np.zeros_like, params), jax.tree.map(np.zeros_like, params)
    for step, g in enumerate(grads):
        norm = np.sqrt(sum(np.sum(x ** 2) for x in jax.tree.leaves(g)))
        g = jax.tree.map(lambda x: x * min(1.0, 1.0 / norm), g)
        lr = bert_learning_rate(step, 0.1, 2, 6)
        m = jax.tree.map(lambda m_, x: 0.9 * m_ + 0.1 * x, m, g)
        v = jax.tree.map(lambda v_, x: 0.999 * v_ + 0.001 * x * x, v, g)
        ref = jax.tree.map(lambda p, m_, v_, d: p - lr * (m_ / (np.sqrt(v_) + 1e-6) + (0.01 * p if d else 0.0)),
                           ref, m, v, decays)
    error = lambda p: max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref)))
    assert error(run(cfg)) < 2e-6
    assert error(run(dataclasses.replace(cfg, bias_correction=True))) > 1e-2


@pytest.mark.parametrize("kw, field", [
    (dict(name="lamb", bias_correction=False), "bias_correction=False"),
    (dict(name="adam", weight_decay=0.01), "weight_decay=0.01"),
    (dict(name="sgd", b1=0.5), "b1=0.5"),
    (dict(name="adafactor", eps=1e-6), "eps=1e-06"),
    (dict(name="adam", decay_mask="all"), "decay_mask='all'"),
    (dict(schedule="constant", decay_steps=100), "decay_steps=100"),
    (dict(schedule="noam", warmup_steps=10, end_lr_factor=0.1), "end_lr_factor=0.1"),
    (dict(schedule="cosine", noam_d_model=512), "noam_d_model=512"),
])
def test_a_set_field_nothing_reads_is_refused_naming_it(kw, field):
    """A value the chosen optimizer and schedule would ignore is an error, never silently dropped;
    the same value where it is read is accepted."""
    with pytest.raises(ValueError, match=rf"OptimizerConfig\.{re.escape(field)} is not read with name="):
        OptimizerConfig(**kw)
    name, value = field.split("=")
    reader = {"bias_correction": "adam", "b1": "adam", "eps": "lamb", "decay_mask": "adamw",
              "weight_decay": "adamw"}.get(name)
    schedule = {"decay_steps": "linear", "end_lr_factor": "cosine", "noam_d_model": "noam"}.get(name)
    fixed = dict(kw, **({"name": reader} if reader else {}), **({"schedule": schedule} if schedule else {}))
    assert getattr(OptimizerConfig(**{"warmup_steps": 1, **fixed}), name) == kw[name]


def test_keep_best_mode_without_keep_best_is_refused():
    with pytest.raises(ValueError, match="TrainConfig.keep_best_mode='min' is not read without TrainConfig.keep_best"):
        TrainConfig(keep_best_mode="min")
    assert TrainConfig(keep_best="loss", keep_best_mode="min").keep_best_mode == "min"


@pytest.mark.parametrize("name", ["adam", "adamw", "lamb", "adafactor", "sgd"])
def test_each_optimizer_reduces_a_quadratic(name):
    decays = name in ("adamw", "lamb", "adafactor")
    tx, _ = make_optimizer(OptimizerConfig(name=name, learning_rate=0.05, weight_decay=0.01 if decays else 0.0), 100)
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


@pytest.mark.parametrize("task_cls, field, value", [
    ("RegressionTask", "label_smoothing", 0.1), ("RegressionTask", "z_loss", 1e-4), ("RegressionTask", "vocab_chunk", 8),
    ("ClassificationTask", "vocab_chunk", 8), ("SpanTask", "vocab_chunk", 8), ("ImageClassificationTask", "vocab_chunk", 8),
    ("ContrastiveTask", "label_smoothing", 0.1), ("ContrastiveTask", "vocab_chunk", 8),
])
def test_a_loss_field_the_task_does_not_read_is_refused(task_cls, field, value):
    from tfm.train import tasks
    cls = getattr(tasks, task_cls)
    with pytest.raises(ValueError, match=rf"{task_cls}\.{field}={value!r} is not read by its loss"):
        cls(**{field: value})
    assert getattr(tasks.LMTask(**{field: value}), field) == value  # where it is read, accepted


def test_moe_aux_weight_needs_a_model_with_experts():
    from tfm.models import DecoderLM
    from tfm.models.presets import tiny
    from tfm.train import LMTask
    with pytest.raises(ValueError, match=r"LMTask.moe_aux_weight=0.5 is not read: the model has no experts"):
        Trainer(DecoderLM(tiny("decoder")), LMTask(moe_aux_weight=0.5), TrainConfig())
    assert Trainer(DecoderLM(tiny("moe")), LMTask(moe_aux_weight=0.5), TrainConfig()).task.moe_aux_weight == 0.5


def test_flop_params_leave_out_lookup_tables_but_not_a_tied_output():
    """MFU's N: Llama (untied) loses its input table, GPT-2 (tied) keeps it, BERT loses its
    position and token-type tables; closed forms from the tiny configs (D 32, V 64)."""
    from tfm.models import DecoderLM, EncoderModel, presets
    from tfm.train import LMTask, MLMTask
    D, V = 32, 64
    sizes = {}
    for name, model, task in (("llama", DecoderLM(presets.tiny("llama")), LMTask()),
                              ("decoder", DecoderLM(presets.tiny("decoder")), LMTask()),
                              ("encoder", EncoderModel(presets.tiny("encoder")), MLMTask())):
        batch = parallel_cases._batch(name if name != "llama" else "decoder", np.random.default_rng(0))
        trainer = Trainer(model, task, TrainConfig(batch_size=parallel_cases.B, mesh=MeshConfig(data=-1)))
        trainer.setup(batch)
        sizes[name] = trainer.num_params - trainer.flop_params
    assert sizes == {"llama": V * D, "decoder": 0, "encoder": 2 * D}  # position tables were never in num_params
