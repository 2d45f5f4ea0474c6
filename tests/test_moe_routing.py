"""DeepSeek-V3's routing against brute force, and its auxiliary-loss-free balancing update
(score_bias -= rate * sign(load - mean load), outside the gradient) through the real train step."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from parallel_cases import MESHES
from tfm.layers.feedforward import top_k_gates
from tfm.models import DecoderLM, presets
from tfm.parallel import make_mesh
from tfm.train import LMTask, OptimizerConfig, TrainConfig, Trainer

E, K, GROUPS, TOP = 12, 3, 4, 2
GS = E // GROUPS  # experts per group
ROUTED = dict(num_experts=E, experts_per_token=K, router_score="sigmoid", router_groups=GROUPS,
              router_group_top=TOP, router_bias=True, router_scale=2.5, router_aux_loss_coef=0.0)


def brute_force(logits, bias):
    """Per token: sigmoid scores; groups ranked by their two best (score + bias); the best TOP groups;
    the K best experts among them by score + bias; gates = their scores renormalised, x 2.5."""
    out = []
    for row in logits:
        s = 1 / (1 + np.exp(-row))
        c = s + bias
        rank = [np.sort(c[g * GS:(g + 1) * GS])[::-1][:2].sum() for g in range(GROUPS)]
        allowed = [e for g in np.argsort(rank)[::-1][:TOP] for e in range(g * GS, (g + 1) * GS)]
        chosen = sorted(allowed, key=lambda e: -c[e])[:K]
        out.append({e: 2.5 * s[e] / s[chosen].sum() for e in chosen})
    return out


def test_group_limited_sigmoid_routing_equals_brute_force():
    rng = np.random.default_rng(0)
    logits, bias = rng.normal(size=(64, E)).astype(np.float32), rng.normal(scale=0.3, size=E).astype(np.float32)
    cfg = presets.tiny("moe", **ROUTED)
    gates, experts, _ = top_k_gates(jnp.asarray(logits), cfg, jnp.asarray(bias))
    ref = brute_force(logits, bias)
    for t in range(len(logits)):
        got = dict(zip(np.asarray(experts[t]).tolist(), np.asarray(gates[t]).tolist()))
        assert got.keys() == ref[t].keys(), t
        np.testing.assert_allclose([got[e] for e in ref[t]], list(ref[t].values()), rtol=1e-5)


def test_balancing_bias_steps_against_the_load_and_nothing_else_moves_it():
    """One Adam train step of a tiny DeepSeek-style LM (clip 1.0, weight decay): every MoE layer's
    score_bias moves by exactly -rate * sign(tokens routed to the expert - mean), the count taken
    by brute force from the routing the step saw; the loss equals the one without the bias signal, and the logged
    grad_norm is the loss's gradient norm without the bias's load signal (what clipping sees)."""
    rate = 0.01
    cfg = presets.tiny("moe", **ROUTED, dense_layers=1, num_layers=2, router_bias_rate=rate)
    model, task = DecoderLM(cfg), LMTask()
    rng = np.random.default_rng(1)
    y = rng.integers(1, 64, (4, 9)).astype(np.int32)
    batch = {"inputs": y[:, :-1], "targets": y[:, 1:], "weights": np.ones((4, 8), np.float32)}
    opt = OptimizerConfig(name="adamw", learning_rate=1e-2, weight_decay=0.1, clip_grad_norm=1.0)
    train_cfg = TrainConfig(num_train_steps=2, batch_size=4, mesh=MESHES["single"][0], parallelism="data",
                            optimizer=opt)
    trainer = Trainer(model, task, train_cfg, make_mesh(train_cfg.mesh, jax.devices()[:1])).setup(batch)
    state = trainer.init_state()
    params = jax.device_get(nn.meta.unbox(state.params))
    bias = params["decoder"]["layer_1"]["ffn"]["score_bias"]
    assert np.all(bias == 0) and "score_bias" not in params["decoder"]["layer_0"]["ffn"]
    new_state, metrics = trainer.train_step(state, trainer.global_batch(batch))
    new_bias = np.asarray(jax.device_get(nn.meta.unbox(new_state.params))["decoder"]["layer_1"]["ffn"]["score_bias"])

    # The routing of layer 1 in that step, recomputed from its input.
    _, inter = model.apply({"params": params}, jnp.asarray(batch["inputs"]), capture_intermediates=True,
                           mutable=["intermediates"])
    router_logits = inter["intermediates"]["decoder"]["layer_1"]["ffn"]["router"]["__call__"][0]
    _, experts, _ = top_k_gates(router_logits, cfg, jnp.asarray(bias))
    load = np.bincount(np.asarray(experts).ravel(), minlength=E).astype(np.float32)
    assert load.std() > 0, load
    np.testing.assert_allclose(new_bias, -rate * np.sign(load - load.mean()), atol=1e-7)

    def loss_of(params):
        logits = model.apply({"params": params}, jnp.asarray(batch["inputs"])).logits
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(batch["targets"])[..., None], -1))

    np.testing.assert_allclose(float(metrics["loss"]), float(loss_of(params)), rtol=1e-5)
    # grad_norm is the norm clipping sees: the loss's gradients, not the bias's load signal (E times |excess|)
    grads = jax.grad(loss_of)(params)
    learned = [g for path, g in jax.tree_util.tree_leaves_with_path(grads)
               if "score_bias" not in jax.tree_util.keystr(path)]
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(learned)), rtol=1e-4)
