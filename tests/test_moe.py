"""Dropless MoE by sorting (moe_impl="ragged") against the one-hot einsum dispatch with room for
every token (moe_impl="einsum", capacity_factor=None: C = T, nothing drops), fp32."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfm.layers.feedforward import MoeMlp, sort_by_expert, top_k_gates
from tfm.models.presets import tiny

TOL = 1e-5  # fp32, absolute (values are O(1))
B, T, E = 2, 12, 6


def _skewed_case():
    """Params, inputs and cotangent whose routing is very unequal: expert 0 is nearly everyone's first
    choice, experts 4 and 5 are nobody's choice (their router columns point away from the inputs)."""
    cfg = tiny("moe", num_experts=E, experts_per_token=2)
    kx, kp, kc = jax.random.split(jax.random.PRNGKey(0), 3)
    d = jnp.zeros(cfg.d_model).at[0].set(1.0)
    x = jax.random.normal(kx, (B, T, cfg.d_model)) + 3.0 * d
    params = nn.meta.unbox(MoeMlp(cfg).init(kp, x)["params"])
    router = params["router"]["kernel"].at[0, 0].set(2.0).at[0, 4:].set(-5.0)  # [D, E]
    params = dict(params, router={"kernel": router})
    return cfg, params, x, jax.random.normal(kc, x.shape)


def _value_and_grads(cfg, params, x, cotangent):
    def loss(params, x):
        y, sown = MoeMlp(cfg).apply({"params": params}, x, mutable=["losses"])
        return jnp.sum(y * cotangent) + sown["losses"]["moe_aux_loss"][0], y
    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


def test_ragged_equals_einsum_dropless_values_and_grads_under_skewed_routing():
    cfg, params, x, cotangent = _skewed_case()
    gates, experts, _ = top_k_gates(x.reshape(B * T, -1) @ params["router"]["kernel"], cfg)
    counts = np.asarray(sort_by_expert(experts, E)[2])
    assert counts.sum() == B * T * 2 and counts[4] == counts[5] == 0 and counts[0] >= B * T - 2, counts
    y, (g_params, g_x) = _value_and_grads(cfg, params, x, cotangent)
    y_ref, (g_params_ref, g_x_ref) = _value_and_grads(cfg.replace(moe_impl="einsum"), params, x, cotangent)
    assert float(jnp.abs(y).mean()) > 0.1
    np.testing.assert_allclose(y, y_ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(g_x, g_x_ref, atol=TOL, rtol=0)
    for path, g in jax.tree_util.tree_leaves_with_path(g_params):
        ref = g_params_ref
        for key in path:
            ref = ref[key.key]
        np.testing.assert_allclose(g, ref, atol=TOL, rtol=0, err_msg=jax.tree_util.keystr(path))
    # Gradients reach the router and exactly the experts that received tokens.
    assert float(jnp.abs(g_params["router"]["kernel"]).max()) > 1e-3
    for name in ("wi_gate", "wi_up", "wo"):
        per_expert = np.asarray(jnp.abs(g_params[name]).max(axis=(1, 2)))
        assert (per_expert[counts > 0] > 1e-4).all() and (per_expert[counts == 0] == 0).all(), (name, per_expert)


def test_sort_by_expert_groups_pairs_stably():
    experts = jnp.array([[2, 0], [0, 3], [2, 3]], jnp.int32)  # 3 tokens, k = 2, E = 5
    order, token, sizes = sort_by_expert(experts, 5)
    np.testing.assert_array_equal(order, [1, 2, 0, 4, 3, 5])  # flat (token, choice) index, by expert
    np.testing.assert_array_equal(token, [0, 1, 0, 2, 1, 2])
    np.testing.assert_array_equal(sizes, [2, 0, 2, 2, 0])
