"""Mesh shapes, rule sets, and the parameter PartitionSpecs each rule set yields (eval_shape
only), plus one compiled check that expert parallelism moves tokens rather than weights."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tfm.layers.feedforward import MoeMlp
from tfm.models import DecoderLM
from tfm.models.presets import tiny
from tfm.parallel import MeshConfig, flax_rules, logical_to_spec, make_mesh, make_rules, param_shardings
from tfm.train import LMTask, TrainConfig, Trainer

from parallel_cases import VARIANTS

LM_BATCH = {"inputs": np.ones((8, 16), np.int32), "targets": np.ones((8, 16), np.int32)}


def test_mesh_infers_one_axis_and_names_problems():
    assert MeshConfig(data=-1, tensor=4).resolve(8) == ((2, 1, 1, 1, 4), (1, 1, 1, 1, 1))
    assert MeshConfig(data=-1, num_slices=2).resolve(8) == ((4, 1, 1, 1, 1), (2, 1, 1, 1, 1))
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}
    assert dict(make_mesh(MeshConfig(data=2, context=-1)).shape)["context"] == 4
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="needs 6 devices"):
        MeshConfig(data=2, tensor=3).resolve(8)
    with pytest.raises(ValueError, match="not divisible"):
        MeshConfig(data=-1, tensor=3).resolve(8)


def test_rule_sets_combine_in_mesh_order():
    rules = dict(make_rules("fsdp", "tensor", "expert", "data"))
    assert rules["batch"] == ("data", "fsdp", "expert")
    assert rules["embed"] == ("fsdp", "expert") and rules["mlp"] == ("tensor",)  # FSDP over every batch axis
    assert "embed" not in dict(make_rules("data", "expert"))  # without fsdp, params outside experts replicate
    assert "embed" not in dict(make_rules("fsdp", activations=True))
    assert "latent" not in dict(make_rules("fsdp", activations=True))
    assert dict(make_rules("context", activations=True))["length"] == ("context",)
    assert "length" not in dict(make_rules("context"))  # a learned position table stays whole
    assert dict(make_rules("fsdp", "context"))["embed"] == ("fsdp", "context")  # state split over both
    assert "embed" not in dict(make_rules("context", activations=True))
    with pytest.raises(ValueError, match="unknown parallelism"):
        make_rules("pipeline")


def test_logical_to_spec_skips_used_and_indivisible_axes():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    rules = make_rules("fsdp", "tensor")
    assert logical_to_spec(("embed", "mlp"), (32, 64), mesh, rules) == P("fsdp", "tensor")
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (32, 2, 8), mesh, rules) == P("fsdp")
    assert logical_to_spec(("batch", "length"), (8, 16), mesh, rules) == P("fsdp")


def _specs(family, mesh_cfg, parallelism):
    cfg = TrainConfig(batch_size=8, mesh=mesh_cfg, parallelism=parallelism)
    preset, overrides = VARIANTS.get(family, (family, {}))
    tr = Trainer(DecoderLM(tiny(preset, **overrides)), LMTask(), cfg).setup(LM_BATCH)
    flat = lambda t: {jax.tree_util.keystr(p): s.spec
                      for p, s in jax.tree_util.tree_flatten_with_path(t)[0]}
    return flat(tr.param_shardings), flat(tr.state_shardings.opt_state)


# (family, mesh, rules) -> expected spec for params whose path ends with the key.
EXPECTED = {
    ("decoder", MeshConfig(data=8), "data"): {
        "['ffn']['wi']['kernel']": P(), "['embed']['embedding']": P()},
    ("decoder", MeshConfig(data=1, fsdp=8), "fsdp"): {
        "['ffn']['wi']['kernel']": P("fsdp"), "['ffn']['wo']['kernel']": P(None, "fsdp"),
        "['self_attn']['out']['kernel']": P(None, None, "fsdp"),
        "['embed']['embedding']": P(None, "fsdp"), "['ffn']['wi']['bias']": P()},
    ("decoder", MeshConfig(data=2, tensor=4), "data+tensor"): {
        "['ffn']['wi']['kernel']": P(None, "tensor"), "['ffn']['wo']['kernel']": P("tensor"),
        "['self_attn']['query']['kernel']": P(None, "tensor"),
        "['self_attn']['out']['kernel']": P("tensor"), "['embed']['embedding']": P("tensor")},
    ("decoder", MeshConfig(data=1, fsdp=4, tensor=2), "fsdp+tensor"): {
        "['ffn']['wi']['kernel']": P("fsdp", "tensor"), "['ffn']['wo']['kernel']": P("tensor", "fsdp"),
        "['embed']['embedding']": P("tensor", "fsdp")},
    # MLA (q_rank 8, kv_rank 16): the up-projections [C, N, H] have no "embed"; "latent" takes `fsdp`
    ("latent_attention", MeshConfig(data=1, fsdp=8), "fsdp"): {
        "['q_up']['kernel']": P("fsdp"), "['key_up']['kernel']": P("fsdp"), "['value_up']['kernel']": P("fsdp"),
        "['q_down']['kernel']": P("fsdp"), "['kv_norm']['scale']": P("fsdp")},
    ("moe", MeshConfig(data=2, expert=4), "data+expert"): {
        "['ffn']['wi_gate']": P("expert"), "['ffn']['wo']": P("expert"),
        "['ffn']['router']['kernel']": P()},
    # fsdp+expert: "embed" over fsdp x expert, except where the "expert" dim already takes `expert`
    ("moe", MeshConfig(data=1, fsdp=4, expert=2), "fsdp+expert"): {
        "['ffn']['wi_gate']": P("expert", "fsdp"), "['ffn']['wo']": P("expert", None, "fsdp"),
        "['ffn']['router']['kernel']": P(("fsdp", "expert")),
        "['self_attn']['query']['kernel']": P(("fsdp", "expert"))},
}


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: f"{k[0]}-{k[2]}")
def test_param_and_optimizer_specs_per_rule_set(key):
    family, mesh_cfg, parallelism = key
    params, opt = _specs(family, mesh_cfg, parallelism)
    for suffix, want in EXPECTED[key].items():
        hits = {k: s for k, s in params.items() if k.endswith(suffix)}
        assert hits, f"no param ends with {suffix}"
        for name, spec in hits.items():
            assert spec == want, f"{name}: {spec} != {want}"
            mirrored = [s for k, s in opt.items() if k.endswith(name) and "mu" in k]
            assert mirrored == [want], f"Adam mu of {name}: {mirrored}"
    if parallelism == "data":
        assert all(s == P() for s in params.values())


def test_expert_parallel_moves_tokens_not_expert_weights():
    """Under data=2 x expert=4 the dispatched tokens [B, E, C, D] of moe_impl="einsum" are split over
    `expert`, so the compiled MoE layer gathers activations but never the [E, D, F] expert weights
    (moe_impl="ragged": tests/test_moe.py)."""
    assert dict(make_rules("data", "expert"))["expert_batch"] == ("data",)
    cfg = tiny("moe", moe_impl="einsum")  # E 4, D 32, F 64
    mesh = make_mesh(MeshConfig(data=2, expert=4))
    layer, x = MoeMlp(cfg), jnp.ones((8, 16, cfg.d_model))
    with jax.set_mesh(mesh), nn.logical_axis_rules(flax_rules(make_rules("data", "expert", activations=True))):
        boxed = layer.init(jax.random.PRNGKey(0), x)
        shardings = param_shardings(boxed, mesh, make_rules("data", "expert"))
        f = jax.jit(lambda p, x: layer.apply(p, x, mutable=["losses"])[0],
                    in_shardings=(shardings, NamedSharding(mesh, P(("data", "expert")))))
        hlo = f.lower(nn.meta.unbox(boxed), x).compile().as_text()
    gathered = [line for line in hlo.splitlines() if " all-gather(" in line]
    assert gathered, "expected token all-gathers inside the expert group"
    assert not [line for line in gathered if "[4,32,64]" in line or "[4,64,32]" in line], gathered
