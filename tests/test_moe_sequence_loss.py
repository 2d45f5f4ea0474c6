"""DeepSeek-V3's sequence-wise balance loss (ModelConfig.router_seq_aux_loss_coef) against a brute-force
numpy computation of the paper's eq. 17-20, its gradient against finite differences of that brute force,
and its path into the train objective (where it changes the routers' gradients)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.layers.feedforward import MoeMlp
from tfm.models import DecoderLM
from tfm.models.presets import tiny
from tfm.train import LMTask

B, T, E, K, ALPHA = 3, 7, 6, 2, 0.3


def brute_force(logits, score: str) -> float:
    """logits [B, T, E] (float64) -> alpha * mean over sequences of sum_i f_i P_i, by loops: per token the
    K best scores; f_i = E / (K T) * tokens choosing i; P_i = mean of s_i / sum_j s_j over the sequence."""
    total = 0.0
    for seq in logits:
        f, p = np.zeros(E), np.zeros(E)
        for row in seq:
            s = np.exp(row - row.max()) / np.exp(row - row.max()).sum() if score == "softmax" else 1 / (1 + np.exp(-row))
            for i in np.argsort(-s)[:K]:
                f[i] += E / (K * T)
            p += s / s.sum() / T
        total += f @ p
    return ALPHA * total / len(logits)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_sequence_loss_and_its_router_gradient_equal_brute_force(score):
    cfg = tiny("moe", num_experts=E, experts_per_token=K, router_score=score, router_aux_loss_coef=0.0,
               router_seq_aux_loss_coef=ALPHA)
    x = jax.random.normal(jax.random.PRNGKey(0), (B, T, cfg.d_model))
    params = nn.meta.unbox(jax.jit(MoeMlp(cfg).init)(jax.random.PRNGKey(1), x)["params"])

    def sown(router):
        _, out = MoeMlp(cfg).apply({"params": {**params, "router": {"kernel": router}}}, x, mutable=["losses"])
        return out["losses"]["moe_seq_aux_loss"][0], out["losses"]["moe_aux_loss"][0]

    router = params["router"]["kernel"]  # [D, E]
    (value, batch_wise), grad = jax.jit(jax.value_and_grad(sown, has_aux=True))(router)
    assert batch_wise == 0.0  # only the sequence-wise term is on
    x64, w64 = np.asarray(x, np.float64), np.asarray(router, np.float64)
    ref = brute_force(x64 @ w64, score)
    assert ref > 0.1 * ALPHA
    np.testing.assert_allclose(float(value), ref, rtol=1e-5)
    # the choice is piecewise constant: a small step along v moves only P, whose derivative is <grad, v>
    v = np.asarray(jax.random.normal(jax.random.PRNGKey(2), router.shape), np.float64)
    eps = 1e-5
    fd = (brute_force(x64 @ (w64 + eps * v), score) - brute_force(x64 @ (w64 - eps * v), score)) / (2 * eps)
    assert abs(fd) > 1e-3
    np.testing.assert_allclose(float(jnp.sum(grad * v)), fd, rtol=1e-4)


def test_the_coefficient_reaches_the_objective_and_the_routers_gradients():
    """LMTask's objective with router_seq_aux_loss_coef = ALPHA is the one with 0 plus the brute force on the
    MoE layer's router logits (captured), and the router's gradient changes."""
    rng = np.random.default_rng(0)
    y = rng.integers(1, 64, (B, T + 1)).astype(np.int32)
    batch = {"inputs": y[:, :-1], "targets": y[:, 1:], "weights": np.ones((B, T), np.float32)}
    task = LMTask()
    totals = task.weight_totals(batch)

    def model_of(coef):
        return DecoderLM(tiny("moe", num_experts=E, experts_per_token=K, router_score="sigmoid", num_layers=1,
                              router_aux_loss_coef=0.0, router_seq_aux_loss_coef=coef))

    init = jax.jit(lambda key: model_of(ALPHA).init(key, batch["inputs"])["params"])
    params = nn.meta.unbox(init(jax.random.PRNGKey(0)))
    @jax.jit
    def objectives_and_logits(params):
        grad = lambda coef: jax.value_and_grad(lambda p: task.loss(
            model_of(coef), p, batch, jax.random.PRNGKey(1), totals, deterministic=True)[0])(params)
        _, state = model_of(ALPHA).apply({"params": params}, batch["inputs"], mutable=["intermediates"],
                                         capture_intermediates=lambda m, _: m.name == "router")
        return grad(ALPHA), grad(0.0), state["intermediates"]

    (with_loss, with_grads), (without, without_grads), captured = objectives_and_logits(params)
    layers = captured["decoder"]
    logits = np.asarray(layers["layer_0"]["ffn"]["router"]["__call__"][0], np.float64)
    assert logits.shape == (B, T, E)
    np.testing.assert_allclose(float(with_loss - without), brute_force(logits, "sigmoid"), rtol=1e-4)
    router = lambda g: g["decoder"]["layer_0"]["ffn"]["router"]["kernel"]
    change = float(jnp.linalg.norm(router(with_grads) - router(without_grads)))
    assert change > 1e-3 * float(jnp.linalg.norm(router(without_grads)))
