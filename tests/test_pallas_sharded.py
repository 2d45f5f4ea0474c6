"""impl="pallas" under a mesh: the kernel runs inside shard_map on per-device shards.

On 8 simulated CPU devices (interpret mode) with the trainer's rule sets: values and
gradients equal impl="xla" (fp32, 1e-5); the traced shard_map body calls the kernel on
[B/b, ., N/n, .] shards; a sharded call and the Trainer's whole step lower for TPU (Mosaic) and
CUDA (Triton) from this CPU machine with the kernel custom calls on per-device shapes; and
ModelConfig.attention_block_sizes reaches the kernel's grid.
"""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding, PartitionSpec as P

from tfm.config import ModelConfig
from tfm.kernels.tiles import BlockSizes
from tfm.models import DecoderLM, presets
from tfm.ops import pallas
from tfm.ops.attention import alibi_slopes, dot_product_attention
from tfm.parallel import MeshConfig, flax_rules, make_mesh, make_rules, parse_parallelism
from tfm.train import LMTask, OptimizerConfig, TrainConfig, Trainer

B, T = 8, 24
MESHES = {  # name -> (mesh config, rule sets, B per device, N shards)
    "data8": (MeshConfig(data=8), "data", 1, 1),
    "fsdp4_tensor2": (MeshConfig(data=1, fsdp=4, tensor=2), "fsdp+tensor", 2, 2),
    "data2_tensor4": (MeshConfig(data=2, tensor=4), "data+tensor", 4, 4),
}
CASES = {  # name -> (N, K, attention keywords)
    "causal_gqa_packed_alibi": (4, 2, dict(causal=True, segments=True, alibi=True)),
    "mqa_window_softcap": (4, 1, dict(causal=False, window=7, softcap=4.0)),
}


def _mesh_and_rules(name):
    mesh_cfg, parallelism, _, _ = MESHES[name]
    rules = flax_rules(make_rules(*parse_parallelism(parallelism), activations=True))
    return make_mesh(mesh_cfg), rules


def _inputs(N, K):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (B, T, N, 16), jnp.float32)
    k, v = (jax.random.normal(key, (B, T, K, 16), jnp.float32) for key in keys[1:3])
    ct = jax.random.normal(keys[3], (B, T, N, 16), jnp.float32)
    return q, k, v, ct


def _loss(case, impl, attention=None):
    """(q, k, v, ct) -> (sum(o * ct), o); `attention` replaces the entry point when given."""
    N, _, kw = CASES[case]
    segments = jnp.asarray([[1] * (6 + b) + [2] * (13 - b) + [0] * 5 for b in range(B)])  # packed, padded
    kwargs = dict(causal=kw["causal"], window=kw.get("window"), softcap=kw.get("softcap"),
                  alibi_slopes=alibi_slopes(N) if kw.get("alibi") else None)
    if kw.get("segments"):
        kwargs.update(q_segment_ids=segments, kv_segment_ids=segments)

    def f(q, k, v, ct):
        if attention is None:
            o = dot_product_attention(q, k, v, impl=impl, **kwargs)
        else:
            o = attention(q, k, v, scale=q.shape[-1] ** -0.5, **kwargs)
        return jnp.sum(o * ct), o

    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)


def _sharded(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _input_specs(mesh, rules, K):
    """PartitionSpecs of q (and ct) [B, T, N, H] and of k, v [B, S, K, H], as the trainer's
    logical constraints place them (kv heads replicated when tensor does not divide K)."""
    table = dict(rules)
    q_spec = P(table.get("batch"), None, table.get("heads"))
    return q_spec, q_spec if K % mesh.shape["tensor"] == 0 else P(q_spec[0])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_pallas_under_mesh_matches_xla(mesh_name, case):
    N, K, _ = CASES[case]
    q, k, v, ct = _inputs(N, K)
    (_, o_ref), g_ref = jax.jit(_loss(case, "xla"))(q, k, v, ct)
    mesh, rules = _mesh_and_rules(mesh_name)
    spec, kv_spec = _input_specs(mesh, rules, K)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        args = (_sharded(q, mesh, spec), _sharded(k, mesh, kv_spec), _sharded(v, mesh, kv_spec),
                _sharded(ct, mesh, spec))
        (_, o), g = jax.jit(_loss(case, "pallas"))(*args)
    errors = {"o": float(jnp.max(jnp.abs(o - o_ref)))}
    errors.update({f"d{n}": float(jnp.max(jnp.abs(a - b))) for n, a, b in zip("qkv", g, g_ref)})
    print(mesh_name, case, errors)
    assert all(e <= 1e-5 for e in errors.values()), errors


def _pallas_calls(jaxpr, inside=False):
    """(eqn, inside a shard_map body) for every pallas_call, searching nested jaxprs."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn, inside
            continue
        for sub in jaxprs_in_params(eqn.params):
            yield from _pallas_calls(sub, inside or eqn.primitive.name == "shard_map")


def _leading_dims(calls):
    """{(B, N or K)} of the 4-D kernel operands ([B, N|K, L, H] in the kernel layout)."""
    return {tuple(x.aval.shape[:2]) for eqn, _ in calls for x in eqn.invars if x.aval.ndim == 4}


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_kernel_sees_per_device_shapes(mesh_name):
    """Forward and both backward kernels run inside shard_map on [B/b, N/n | K', L, H] blocks."""
    case = "causal_gqa_packed_alibi"
    N, K, _ = CASES[case]
    _, _, b_local, n_shards = MESHES[mesh_name]
    mesh, rules = _mesh_and_rules(mesh_name)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        jaxpr = jax.make_jaxpr(_loss(case, "pallas"))(*_inputs(N, K)).jaxpr
    calls = list(_pallas_calls(jaxpr))
    assert len(calls) == 3 and all(inside for _, inside in calls), calls  # fwd, dq, dkv
    kv_local = max(K, n_shards) // n_shards  # K=2 on tensor=4: each kv head repeated twice
    leading = _leading_dims(calls)
    print(mesh_name, "kernel operands [B, N|K] per device:", sorted(leading))
    assert leading == {(b_local, N // n_shards), (b_local, kv_local)}


def test_no_mesh_calls_the_kernel_directly():
    N, K, _ = CASES["causal_gqa_packed_alibi"]
    jaxpr = jax.make_jaxpr(_loss("causal_gqa_packed_alibi", "pallas"))(*_inputs(N, K)).jaxpr
    calls = list(_pallas_calls(jaxpr))
    assert len(calls) == 3 and not any(inside for _, inside in calls)
    assert _leading_dims(calls) == {(B, N), (B, K)}


_CUSTOM_CALLS = {"tpu": "@tpu_custom_call", "cuda": "@__gpu$xla.gpu.triton"}
_KERNEL_BUILDS = {"tpu": ("tpu", BlockSizes(128, 128)), "cuda": ("gpu", BlockSizes(16, 16))}  # backend, tiles


def _custom_call_leading_dims(line: str):
    """{(B, N or K)} of the 4-D operands in one lowered `stablehlo.custom_call` line, whose
    signature ends `: (tensor<2x2x128x64xf32>, ...) -> ...`."""
    operands = line.rsplit(" : (", 1)[1].split(") -> ")[0]
    shapes = [tuple(map(int, s.rstrip("x").split("x"))) for s in re.findall(r"tensor<((?:\d+x)+)\w+>", operands)]
    return {shape[:2] for shape in shapes if len(shape) == 4}


def _lowered_kernel_operands(text: str, platform: str) -> set:
    """{(B, N or K)} of the kernel operands in a module lowered for `platform`, which must hold
    exactly the forward, dQ and dK/dV kernel calls."""
    calls = [line for line in text.splitlines() if _CUSTOM_CALLS[platform] in line]
    assert len(calls) == 3, f"expected fwd, dq, dkv kernel calls for {platform}, found {len(calls)}"
    return set().union(*map(_custom_call_leading_dims, calls))


@pytest.mark.parametrize("mesh_name", ["fsdp4_tensor2", "data2_tensor4"])
@pytest.mark.parametrize("platform", list(_CUSTOM_CALLS))
def test_sharded_call_lowers_for_accelerators_on_per_device_shapes(platform, mesh_name):
    """The sharded forward + backward lowered from CPU for TPU (Mosaic) or CUDA (Triton)."""
    case = "causal_gqa_packed_alibi"
    N, K, _ = CASES[case]
    _, _, b_local, n_shards = MESHES[mesh_name]
    backend, blocks = _KERNEL_BUILDS[platform]
    attention = lambda *a, **kw: pallas.attention(*a, block_sizes=blocks, backend=backend,
                                                  interpret=False, **kw)
    mesh, rules = _mesh_and_rules(mesh_name)
    q_spec, kv_spec = _input_specs(mesh, rules, K)
    shapes = [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))  # Triton: no fp32
              for x, spec in zip(_inputs(N, K), (q_spec, kv_spec, kv_spec, q_spec))]
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        lowered = jax.jit(_loss(case, "pallas", attention)).trace(*shapes).lower(lowering_platforms=(platform,))
    operand_shapes = _lowered_kernel_operands(lowered.as_text(), platform)
    print(platform, mesh_name, "kernel operands [B, N|K] per device:", sorted(operand_shapes))
    kv_local = max(K, n_shards) // n_shards
    assert operand_shapes == {(b_local, N // n_shards), (b_local, kv_local)}, operand_shapes


def _llama_trainer(impl: str, steps: int = 2):
    """(Trainer, batch) of a Llama-style (N 4, K 2) decoder on (fsdp=4, tensor=2)."""
    mesh_cfg, parallelism, _, _ = MESHES["fsdp4_tensor2"]
    model = DecoderLM(presets.tiny("llama", num_layers=1, attention_impl=impl))
    tokens = np.random.default_rng(0).integers(1, 64, (B, 17)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.ones((B, 16), np.float32)}
    cfg = TrainConfig(num_train_steps=steps, batch_size=B, mesh=mesh_cfg, parallelism=parallelism,
                      optimizer=OptimizerConfig(name="adam", learning_rate=5e-3))
    return Trainer(model, LMTask(), cfg, make_mesh(mesh_cfg)).setup(batch), batch


def _train(impl: str, steps: int = 2):
    """Losses of the `_llama_trainer` model trained for `steps`, and the pallas_calls of its
    traced train step."""
    trainer, batch = _llama_trainer(impl, steps)
    state, losses = trainer.init_state(), []
    with trainer.context():  # the jitted step, traced as train_step would trace it
        calls = list(_pallas_calls(trainer.jitted_train_step.trace(state, trainer.global_batch(batch)).jaxpr.jaxpr))
    for _ in range(steps):
        state, metrics = trainer.train_step(state, trainer.global_batch(batch))
        losses.append(float(metrics["loss"]))
    return np.array(losses), calls


def test_trainer_step_runs_the_kernel_per_device():
    """The trainer's context (mesh + activation rules) is what `per_device` reads."""
    (xla, _), (losses, calls) = _train("xla"), _train("pallas")
    print("trainer losses xla", xla, "pallas", losses, "max |diff|", np.abs(losses - xla).max())
    np.testing.assert_allclose(losses, xla, rtol=0, atol=1e-5)
    assert len(calls) == 3 and all(inside for _, inside in calls)
    assert _leading_dims(calls) == {(B // 4, 2), (B // 4, 1)}  # fsdp=4 splits B, tensor=2 N and K


@pytest.mark.parametrize("platform", list(_CUSTOM_CALLS))
def test_sharded_train_step_lowers_for_accelerators_on_per_device_shapes(platform, monkeypatch):
    """The Trainer's whole jitted step (Llama-style, N 4, K 2, on fsdp=4 x tensor=2) lowered from
    CPU for TPU or CUDA, the kernels compiled for that platform: three kernel calls, each on
    [B/4, N/2 | K/2] blocks."""
    backend, blocks = _KERNEL_BUILDS[platform]
    compiled = pallas.flash_attention.flash_attention
    monkeypatch.setattr(pallas.flash_attention, "flash_attention", lambda q, k, v, **kw: compiled(
        *(x.astype(jnp.bfloat16) for x in (q, k, v)),  # the fp32 model's q, k, v: Triton takes bf16
        **{**kw, "backend": backend, "interpret": False, "block_sizes": blocks}).astype(q.dtype))
    trainer, batch = _llama_trainer("pallas")
    global_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
                    for k, v in batch.items()}
    with trainer.context():
        text = trainer.jitted_train_step.trace(trainer.abstract_state, global_batch).lower(
            lowering_platforms=(platform,)).as_text()
    operand_shapes = _lowered_kernel_operands(text, platform)
    print(platform, "train step kernel operands [B, N|K] per device:", sorted(operand_shapes))
    assert operand_shapes == {(B // 4, 2), (B // 4, 1)}, operand_shapes


def _kernel_grids(cfg: ModelConfig):
    """Grids of the pallas_calls in one decoder forward + backward (loop driver on CPU)."""
    model, x = DecoderLM(cfg), jnp.ones((2, 32), jnp.int32)
    params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), x)["params"])
    loss = lambda p: model.apply({"params": p}, x).logits.astype(jnp.float32).sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    return sorted(eqn.params["grid_mapping"].grid for eqn, _ in _pallas_calls(jaxpr))


def test_model_config_block_sizes_reach_the_kernel():
    cfg = presets.tiny("llama", num_layers=1, attention_impl="pallas")  # N 4, K 2, T 32
    blocks = dict(block_q=8, block_kv=16, block_q_bwd=16, block_kv_bwd=8)
    # fwd grid (B, N, T / 8); dQ (B, N, T / 16); dK/dV (B, K, S / 8).
    assert _kernel_grids(cfg.replace(attention_block_sizes=blocks)) == [(2, 2, 4), (2, 4, 2), (2, 4, 4)]
    assert _kernel_grids(cfg) == [(2, 2, 1), (2, 4, 1), (2, 4, 1)]  # CPU default: one 32-block


@pytest.mark.parametrize("value,message", [
    (dict(block_q=12), "power of two"),
    (dict(block_rows=16), "unexpected keyword"),
    ((8,) * 10, "positional"),  # BlockSizes has 9 fields
])
def test_model_config_rejects_bad_block_sizes(value, message):
    with pytest.raises(ValueError, match=f"attention_block_sizes.*{message}"):
        presets.tiny("decoder", attention_impl="pallas", attention_block_sizes=value)


def test_model_config_block_sizes_are_stored_frozen_and_never_ignored():
    cfg = presets.tiny("decoder", attention_impl="pallas", attention_block_sizes=(16, 32))
    assert cfg.execution.attention_block_sizes == BlockSizes(16, 32) and hash(cfg)
    with pytest.raises(ValueError, match="attention_impl='xla' would ignore them"):
        cfg.replace(attention_impl="xla")
