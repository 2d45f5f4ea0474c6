"""Dropless MoE by sorting (moe_impl="ragged") against the one-hot einsum dispatch with room for
every token (moe_impl="einsum", capacity_factor=None: C = T, nothing drops), and expert parallelism
(all-to-all) against one device; fp32."""
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.layers.feedforward import MoeMlp, top_k_gates
from tfm.models.presets import tiny
from tfm.parallel import MeshConfig, batch_sharding, flax_rules, make_mesh, make_rules, param_shardings
from tfm.parallel.experts import sort_by_expert

TOL = 1e-5  # fp32, absolute (values are O(1))
GRAD_RTOL = 1e-5  # fp32, relative, for weight gradients summed over many tokens
B, T, E = 2, 12, 6


def _skewed_case(num_experts=E, batch=B):
    """Params, inputs and cotangent whose routing is very unequal: expert 0 is nearly everyone's first
    choice, experts 4 and 5 are nobody's choice (their router columns point away from the inputs)."""
    cfg = tiny("moe", num_experts=num_experts, experts_per_token=2)
    kx, kp, kc = jax.random.split(jax.random.PRNGKey(0), 3)
    d = jnp.zeros(cfg.d_model).at[0].set(1.0)
    x = jax.random.normal(kx, (batch, T, cfg.d_model)) + 3.0 * d
    params = nn.meta.unbox(MoeMlp(cfg).init(kp, x)["params"])
    router = params["router"]["kernel"].at[0, 0].set(2.0).at[0, 4:6].set(-5.0)  # [D, E]
    params = dict(params, router={"kernel": router})
    return cfg, params, x, jax.random.normal(kc, x.shape)


def _loss_grad(cfg):
    """(params, x, dy) -> (y, gradients of <y, dy> + aux loss with respect to params and x)."""
    def loss(params, x, cotangent):
        y, sown = MoeMlp(cfg).apply({"params": params}, x, mutable=["losses"])
        return jnp.sum(y * cotangent) + sown["losses"]["moe_aux_loss"][0], y

    def step(params, x, cotangent):
        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x, cotangent)
        return y, grads
    return step


def _value_and_grads(cfg, params, x, cotangent):
    return jax.jit(_loss_grad(cfg))(params, x, cotangent)


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


def test_chunked_dispatch_equals_one_pass_and_refuses_a_non_divisor():
    """moe_chunks=3 (one device, 24 tokens: 8 at a time) gives the one-pass values and gradients; a
    chunk count that does not divide the tokens is refused with the config key's name."""
    cfg, params, x, cotangent = _skewed_case()
    y_ref, grads_ref = _value_and_grads(cfg, params, x, cotangent)
    y, grads = _value_and_grads(cfg.replace(moe_chunks=3), params, x, cotangent)
    np.testing.assert_allclose(y, y_ref, atol=TOL, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=TOL, rtol=GRAD_RTOL), grads, grads_ref)
    with pytest.raises(ValueError, match=r"moe_chunks=5 does not divide the 24 tokens per device"):
        _value_and_grads(cfg.replace(moe_chunks=5), params, x, cotangent)


@pytest.mark.parametrize("mesh_cfg, parallelism, chunks", [(MeshConfig(expert=4), "expert", 1),
                                                           (MeshConfig(data=2, expert=4), "data+expert", 1),
                                                           (MeshConfig(data=2, expert=4), "data+expert", 4),
                                                           (MeshConfig(expert=2, tensor=2), "expert+tensor", 1),
                                                           (MeshConfig(data=4), "data", 1)])
def test_expert_parallel_all_to_all_equals_single_device(mesh_cfg, parallelism, chunks):
    """Tokens travel to their experts' devices (E 8 over 4 devices, 2 each; or over 2, with the expert
    weights' F split over tensor outside the layer) under skewed routing:
    values and gradients equal the one-device ragged layer; the compiled step moves tokens by
    all-to-all and never gathers the expert weights. Data parallel alone: no token leaves its device.
    moe_chunks=4: each device's 12 tokens go 3 at a time, in all-to-all buffers a quarter the size."""
    cfg, params, x, cotangent = _skewed_case(num_experts=8, batch=8)
    cfg = cfg.replace(moe_chunks=chunks)
    y_ref, (g_params_ref, g_x_ref) = _one_device_reference()
    mesh = make_mesh(mesh_cfg, jax.devices()[:8 if mesh_cfg.data == 2 else 4])
    expert_parallel = "expert" in parallelism
    rules = make_rules(*parallelism.split("+"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(flax_rules(rules)):
        boxed = jax.eval_shape(lambda: MoeMlp(cfg).init(jax.random.PRNGKey(0), x))
        p_shardings = param_shardings(boxed, mesh, rules)["params"]
        step = jax.jit(_loss_grad(cfg), in_shardings=(p_shardings, batch_sharding(mesh, rules), None))
        compiled = step.lower(params, x, cotangent).compile()
        y, (g_params, g_x) = compiled(params, x, cotangent)
    hlo = compiled.as_text()
    assert (" all-to-all(" in hlo) == expert_parallel
    if parallelism == "data+expert":  # n = 4 pieces [1, N*k/chunks, D=32]: each device's 12 tokens x k 2 per chunk
        results = [line.split(" all-to-all(")[0] for line in hlo.splitlines() if " all-to-all(" in line]
        assert {len(re.findall(r"f32\[1,\d+,32\]", r)) for r in results if "f32" in r} == {4}, results
        assert {int(m) for r in results for m in re.findall(r"f32\[1,(\d+),32\]", r)} == {24 // chunks}, results
    assert not [line for line in hlo.splitlines() if " all-gather(" in line and ("[8,32,64]" in line or
                                                                                 "[8,64,32]" in line)]
    if not expert_parallel:  # tokens stay put: nothing of shape [N*k, D] or [N, D] is gathered or summed
        assert not [line for line in hlo.splitlines() if re.search(r" (all-gather|all-reduce)\(", line)
                    and re.search(r"\[(192|96|48|24),32\]", line)], hlo
    np.testing.assert_allclose(y, y_ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(g_x, g_x_ref, atol=TOL, rtol=0)
    # Weight gradients sum over all 96 tokens in another order across devices: |g| up to ~100.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=TOL, rtol=GRAD_RTOL), g_params, g_params_ref)


@functools.lru_cache(maxsize=None)
def _one_device_reference():
    return _value_and_grads(*_skewed_case(num_experts=8, batch=8))
