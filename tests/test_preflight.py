"""Preflight: recipes compiled for compile-only TPU slices and H100s from this CPU.

The compile-only devices come from the plugins `make compile-plugins` installs (conftest puts
them on the path). Nothing runs on those devices; shapes are tiny so compiles take seconds.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xla_env
from tfm import parallel, preflight
from tfm.data import pipeline
from tfm.models import DecoderLM
from tfm.models.presets import tiny
from tfm.ops.attention import dot_product_attention
from tfm.parallel.mesh import MeshConfig
from tfm.train import LMTask, TrainConfig, Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,chips,topology", [
    ("v5p-8", 4, "2x2x1"), ("v5p-512", 256, "4x8x8"), ("v4-32", 16, "2x2x4"), ("v5e-256", 256, "16x16"),
    ("v6e-16", 16, "4x4"), ("v5litepod-4", 4, "2x2"), ("v5p:4x4x8", 128, "4x4x8"),
    ("h100-1", 1, "1x1x1"), ("h100-8", 8, "1x1x8"), ("h100-32", 32, "1x4x8"), ("H200-8", 8, "1x1x8")])
def test_targets_by_slice_name(name, chips, topology):
    target = preflight.parse_target(name)
    assert (target.chips, target.topology) == (chips, topology)


@pytest.mark.parametrize("name,wrap", [
    ("v5p-8", (False,) * 3), ("v5p-64", (False,) * 3), ("v5p-128", (True,) * 3), ("v5p:4x4x12", (True,) * 3),
    ("v4-2048", (True,) * 3), ("v5p:2x4x8", (False,) * 3), ("v5e-64", (False,) * 3),
    ("v5e-128", (False, True, False)), ("v6e-256", (True, True, False))])
def test_slices_have_their_wraparound_links(name, wrap):
    """v4/v5p slices of whole 4x4x4 cubes are tori (the compile-only topology is then told so: see
    test_fsdp_over_a_whole_torus_gathers_with_all_gathers); v5e/v6e dims wrap at the pod's 16 chips."""
    target = preflight.parse_target(name)
    assert target.wraparound() == wrap
    assert ("(a torus)" in target.describe()) == (sum(wrap) == target.chip.topology_dims), target.describe()


@pytest.mark.parametrize("name,message", [
    ("v5p-7", "unknown target 'v5p-7'; valid: TPU slices such as"), ("v5p-6", "no v5p slice of 3 chips"),
    ("tpu", "unknown target 'tpu'"), ("v5e:2x2x2", "v5e topologies have 2 dimensions"),
    ("h100-12", "12 GPUs is neither 1..8 on one host nor whole hosts of 8")])
def test_bad_targets_are_named_with_the_valid_ones(name, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        preflight.parse_target(name)


def test_compile_only_devices_per_target():
    assert [d.device_kind for d in preflight.parse_target("v5p-8").devices()] == ["TPU v5"] * 4
    two = preflight.parse_target("v5p-8", num_slices=2).devices()
    assert len(two) == 8 and sorted({d.slice_index for d in two}) == [0, 1]
    gpus = preflight.parse_target("h100-16").devices()
    assert len(gpus) == 16 and {d.process_index for d in gpus} == {0, 1}
    assert gpus[0].device_kind == "NVIDIA H100 80GB HBM3"
    inherited = subprocess.run(["env"], capture_output=True, text=True).stdout  # libtpu's pod guesses: gone
    assert "CLOUD_TPU_TASK_ID=" not in inherited and "TPU_WORKER_ID=" not in inherited


def test_model_flops_match_the_closed_form():
    """3 x forward matmul FLOPs of a GPT-2-style decoder, written out per layer: QKV 6D², out
    2D², MLP 4DF, scores and values 4TD, and the tied output projection 2DV, per token."""
    cfg = tiny("decoder")
    B, T, D, F, V, L = 4, 16, cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.num_layers
    model = DecoderLM(cfg)
    params = jax.eval_shape(lambda: LMTask().init_variables(
        model, jax.random.PRNGKey(0), {k: jnp.zeros((1, T), jnp.int32) for k in pipeline.lm_batch_spec(1, T)}))
    params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, params["params"],
                          is_leaf=lambda x: hasattr(x, "value"))
    per_token = L * (8 * D * D + 4 * D * F + 4 * T * D) + 2 * D * V
    counted = preflight.model_flops(model, LMTask(), params, pipeline.lm_batch_spec(B, T))
    assert counted == 3 * per_token * B * T


def test_scanned_layers_count_every_layer():
    cfg = tiny("llama", num_layers=4)
    batch = pipeline.lm_batch_spec(2, 16)

    def flops(config):
        model = DecoderLM(config)
        params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32)))
        params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, params["params"],
                              is_leaf=lambda x: hasattr(x, "value"))
        return preflight.model_flops(model, LMTask(), params, batch)

    assert flops(cfg.replace(scan_layers=True)) == flops(cfg) > 0


def test_collectives_and_largest_arrays_are_read_from_the_compiled_program():
    """x [16, 64] @ w [64, 32], both split on the contracted dim over 4 chips: each chip's partial
    product is summed by one all-reduce of the [16, 32] f32 result (2 KiB)."""
    devices = preflight.parse_target("v5p-8").devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    split = lambda spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    f = jax.jit(lambda x, w: x @ w, out_shardings=split(()))
    compiled = f.lower(jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=split((None, "x"))),
                       jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=split(("x",)))).compile()
    collectives, kernels, largest = preflight.read_hlo(compiled.as_text())
    assert collectives == {"all-reduce": {"count": 1, "bytes": 16 * 32 * 4, "shapes": ["f32[16,32]"]}}
    assert kernels == []
    assert largest[0][0] == 16 * 32 * 4
    # the [256, 256] bf16 result split over rows instead: TPU's reduce-scatter, a fusion whose computation
    # all-reduces and slices, counted once as the [64, 256] shard it leaves
    scattered = jax.jit(lambda x, w: x @ w, out_shardings=split(("x",))).lower(
        jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=split((None, "x"))),
        jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=split(("x",)))).compile().as_text()
    assert "calls=%all-reduce-scatter" in scattered
    collectives, _, _ = preflight.read_hlo(scattered)
    assert collectives == {"reduce-scatter": {"count": 1, "bytes": 64 * 256 * 2, "shapes": ["bf16[64,256]"]}}


def test_time_by_op_multiplies_loop_bodies_by_their_trip_counts():
    """A scan of n matmuls [512, 512] @ [512, 512] (named "inside") then one more ("outside"), compiled
    for v5p with n = 3 and n = 6: the loop's body is in each program once, with the same estimated
    cycles, so the inside/outside ratio of the breakdown doubles with n (to 1%); shares sum to 1."""
    devices = preflight.parse_target("v5p-8").devices()[:1]
    mesh = jax.sharding.Mesh(np.array(devices), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                               sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def f(x, ws, w):
        def body(carry, w_):
            with jax.named_scope("inside"):
                return carry @ w_, None
        y, _ = jax.lax.scan(body, x, ws)
        with jax.named_scope("outside"):
            return y @ w

    ratios = []
    for n in (3, 6):
        shares = dict(preflight.time_by_op(jax.jit(f).lower(spec(512, 512), spec(n, 512, 512), spec(512, 512))
                                           .compile().as_text(), top=20))
        assert abs(sum(shares.values()) - 1.0) < 1e-9, shares
        ratios.append(shares["inside/dot_general"] / shares["outside/dot_general"])
    assert ratios[1] / ratios[0] == pytest.approx(2.0, rel=0.01), ratios


def test_all_reduces_are_read_by_what_they_do():
    """Over 128 v5p chips (a 4x4x8 torus) libtpu writes the all-gather of a small array (256 KiB) as
    an all-reduce of the shard placed in zeros and a reduce-scatter as an all-reduce of which each chip
    keeps its slice; `all_reduce_forms` tells them from a sum of partial products, which
    `unexpected_all_reduces` flags."""
    devices = preflight.parse_target("v5p-256").devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    split = lambda *spec: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    rows = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=split("x"))
    weight = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16, sharding=split("x"))
    use = jax.jit(lambda x, w: x @ jax.lax.with_sharding_constraint(w, split()), out_shardings=split("x"))
    grad = jax.jit(lambda x, y: x.T @ y, out_shardings=split("x"))
    partial = jax.jit(lambda x, w: x @ w, out_shardings=split())
    texts = [f.lower(*args).compile().as_text() for f, args in [
        (use, (rows, weight)), (grad, (rows, jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=split("x")))),
        (partial, (jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=split(None, "x")), weight))]]
    assert all(preflight.read_hlo(t)[0].keys() == {"all-reduce"} for t in texts)
    forms = [[(r["form"], r["array"], r["group_size"]) for r in preflight.all_reduce_forms(t)] for t in texts]
    assert forms == [[("gather", "bf16[512,256]", 128)], [("scatter", "bf16[512,256]", 128)],
                     [("sum", "bf16[256,256]", 128)]]
    records = [r for t in texts for r in preflight.all_reduce_forms(t)]
    assert [r["form"] for r in preflight.unexpected_all_reduces(records, min_bytes=1 << 10)] == ["sum"]
    assert preflight.unexpected_all_reduces(records, min_bytes=1 << 20) == []  # 128 KiB: below the bar
    assert preflight.unexpected_all_reduces(records, min_bytes=1 << 10, expected_groups=(128,)) == []
    report = preflight.StepReport("train", "v5p-256", 128, 1.0, 1 << 30, all_reduce_forms={
        "gather": {"count": 1, "bytes": 1 << 18, "shapes": ["bf16[512,256]"]}}, unexpected=records[2:])
    lines = "\n".join(preflight.format_report(report, preflight.CHIPS["v5p"]))
    assert "all-reduced arrays by what they do: all-gathers x1 (0.2 MiB)" in lines
    assert "UNEXPECTED under fsdp: 1 weight- or activation-sized arrays summed whole" in lines
    assert "bf16[256,256] over 128 chips" in lines


_MULTI_OUTPUT_GATHER = """HloModule m

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %sum = bf16[] add(%x, %y)
}

%fused (p0: bf16[4,8], p1: bf16[1,8], p2: s32[]) -> (bf16[4,8], bf16[4,8]) {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = bf16[1,8]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  %placed = bf16[4,8]{1,0} dynamic-update-slice(%p0, %p1, %p2, %zero)
  %negated = bf16[4,8]{1,0} negate(%p0)
  ROOT %both = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) tuple(%placed, %negated)
}

ENTRY %main (shard: bf16[1,8], at: s32[], zeros: bf16[4,8]) -> (bf16[4,8], bf16[4,8]) {
  %shard = bf16[1,8]{1,0} parameter(0)
  %at = s32[] parameter(1)
  %zeros = bf16[4,8]{1,0} parameter(2)
  %two = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) fusion(%zeros, %shard, %at), kind=kLoop, calls=%fused
  %first = bf16[4,8]{1,0} get-tuple-element(%two), index=0
  %second = bf16[4,8]{1,0} get-tuple-element(%two), index=1
  ROOT %summed = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) all-reduce(%first, %second), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
}
"""


def test_a_gather_from_a_multi_output_fusion_is_a_gather():
    """libtpu may place FSDP shards into zeros inside a multi-output fusion (the v5p-128 Qwen3-Next step's
    gated DeltaNet weights, [1, 2048, 16|32, 128]); the summed output that is a dynamic-update-slice there
    is a gather, its sibling (a negate) a sum."""
    forms = [(r["form"], r["array"], r["group_size"]) for r in preflight.all_reduce_forms(_MULTI_OUTPUT_GATHER)]
    assert forms == [("gather", "bf16[4,8]", 4), ("sum", "bf16[4,8]", 4)]


def _pallas_trainer(target_name, mesh_config, parallelism):
    cfg = tiny("llama", attention_impl="pallas", num_heads=4, num_kv_heads=2, d_model=64, dtype="bfloat16")
    train = TrainConfig(batch_size=8, mesh=mesh_config, parallelism=parallelism, num_train_steps=10)
    target = preflight.parse_target(target_name)
    mesh = parallel.make_mesh(train.mesh, target.devices())
    batch = pipeline.lm_batch_spec(8, 128)
    return Trainer(DecoderLM(cfg), LMTask(), train, mesh).setup(batch), batch, target


@pytest.mark.parametrize("target_name,backend", [("v5p-8", "pallas (Mosaic)"), ("h100-4", "pallas (Triton)")])
def test_sharded_pallas_train_step_compiles_for_the_accelerator(target_name, backend):
    """fsdp 2 x tensor 2: the kernels run per device on [B/2 | N/2] blocks, each chip holds a
    quarter of every parameter split on both axes, and the step fits."""
    trainer, batch, target = _pallas_trainer(target_name, MeshConfig(data=1, fsdp=2, tensor=2), "fsdp+tensor")
    (report,) = preflight.check_step(trainer, batch, target, with_eval=False)
    assert report.fits and report.total_bytes > 0 and report.compile_seconds > 0
    assert {k["backend"] for k in report.kernels} == {backend}, report.kernels
    names = {k["name"] for k in report.kernels}  # each gets B/2 = 4 rows and K/2 = 1 kv head of [T 128, H 64]
    assert {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"} <= names, names
    assert all(all(o.split("[")[1].startswith("4,") for o in k["operands"]) and "bf16[4,1,128,64]" in k["operands"]
               for k in report.kernels), report.kernels
    params = trainer.abstract_state.params
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    shards = sum(np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    split_both = [x for x in jax.tree.leaves(params) if x.sharding.num_devices == 4 and
                  np.prod(x.sharding.shard_shape(x.shape)) * 4 == x.size]
    assert split_both and shards < total / 2
    assert report.state_bytes == sum(np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                                     for x in jax.tree.leaves(trainer.abstract_state))
    if target.chip.platform == "tpu":
        assert report.estimate_seconds > 0 and 0 < report.mfu < 1
    else:
        assert report.estimate_seconds is None and "no cost model" in report.estimate_note


def test_the_flash_kernels_part_of_the_estimate_is_reported_apart():
    """kernels_apart: the step compiled again without the kernels' cost estimates is estimated faster
    by XLA's cost model (each kernel then scores 0 s); the difference is the kernels' part, in the text
    report too. Leaving that compile restores the estimates (a third compile gives the first figure)."""
    trainer, batch, target = _pallas_trainer("v5p-8", MeshConfig(data=1, fsdp=2, tensor=2), "fsdp+tensor")
    (report,) = preflight.check_step(trainer, batch, target, with_eval=False, kernels_apart=True)
    assert 0 < report.estimate_seconds_without_kernels < report.estimate_seconds
    assert report.kernel_seconds == report.estimate_seconds - report.estimate_seconds_without_kernels > 0
    (line,) = [l for l in preflight.format_report(report, target.chip) if "flash kernels' part" in l]
    assert f"{report.kernel_seconds * 1e3:.2f} ms" in line and "compiled again" in line, line
    (again,) = preflight.check_step(trainer, batch, target, with_eval=False)
    assert again.estimate_seconds == report.estimate_seconds and again.kernel_seconds is None


@pytest.mark.parametrize("target_name", ["v5p-8", "h100-4"])
def test_context_parallel_train_step_compiles_for_the_accelerator(target_name):
    """fsdp 2 x context 2, ring attention with the flash kernels per block (impl auto): a Llama
    decoder's train step compiled for 4 chips. Each device holds 2 rows x 64 of the 128 tokens; the ring passes its K/V block of [2 rows, 64
    tokens, 2 kv heads, 16] bf16 to the next device by collective-permute, and every parameter
    (each has an "embed" dim) is split over fsdp x context: a quarter of it per chip."""
    cfg = tiny("llama", num_layers=1, num_heads=4, num_kv_heads=2, d_model=64, dtype="bfloat16", attention_impl="auto")
    train = TrainConfig(batch_size=4, mesh=MeshConfig(data=1, fsdp=2, context=2), parallelism="fsdp+context",
                        num_train_steps=10)
    target = preflight.parse_target(target_name)
    batch = pipeline.lm_batch_spec(4, 128)
    trainer = Trainer(DecoderLM(cfg), LMTask(), train, parallel.make_mesh(train.mesh, target.devices())).setup(batch)
    (report,) = preflight.check_step(trainer, batch, target, with_eval=False)
    assert report.fits
    # the ring's blocks are the flash kernels, called per pair of zig-zag runs (32 of a device's 64
    # tokens) with the runs' position offset (s32[1]); head dim 16 padded to 64, and on TPU the run to a
    # 128-token block
    assert {k["name"] for k in report.kernels} == {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"}
    assert all("s32[1]" in k["operands"] for k in report.kernels)
    run = "bf16[2,4,128,64]" if target.chip.platform == "tpu" else "bf16[2,4,32,64]"
    queries = [[o for o in k["operands"] if o != "s32[1]"][0]  # TPU prefetches the offset first
               for k in report.kernels if k["name"] == "flash_attention_fwd"]
    assert queries and set(queries) == {run}, report.kernels
    ring = report.collectives["collective-permute"]
    assert ring["count"] >= 2 and "bf16[2,64,2,16]" in ring["shapes"], report.collectives
    params = jax.tree.leaves(trainer.abstract_state.params)
    assert all(np.prod(x.sharding.shard_shape(x.shape)) * 4 == x.size for x in params)
    state = jax.tree.leaves(trainer.abstract_state)
    total = sum(x.size * x.dtype.itemsize for x in state)
    replicated = sum(x.size * x.dtype.itemsize for x in state if x.sharding.is_fully_replicated)  # step, rng, count
    assert report.state_bytes == (total - replicated) / 4 + replicated and replicated < 64


def test_advice_names_context_parallelism_when_a_device_holds_one_sequence():
    """Fewer rows cannot help a device that holds one row per pass: the advice splits the sequence.
    Tips name tfm's own fields."""
    cfg = tiny("llama", remat_policy="full")
    plain = TrainConfig(batch_size=8, mesh=MeshConfig(data=1, fsdp=8), parallelism="fsdp")
    assert preflight.advice(plain, cfg, rows_per_device=4) == [
        preflight.Tip("accumulate gradients", {"TrainConfig.microbatches": 2}),
        preflight.Tip("or a smaller batch", {"TrainConfig.batch_size": 4})]
    assert preflight.advice(plain, cfg, rows_per_device=1) == [preflight.Tip(
        "each device holds one whole sequence per pass: split sequences over devices (context parallelism)",
        {"TrainConfig.parallelism": "fsdp+context", "TrainConfig.mesh.context": 4})]
    split = TrainConfig(batch_size=2, mesh=MeshConfig(data=1, fsdp=2, context=4), parallelism="fsdp+context")
    assert preflight.advice(split, cfg, rows_per_device=1) == [preflight.Tip(
        "each device holds 1/4 of a sequence per pass: split sequences over more devices (context parallelism)",
        {"TrainConfig.parallelism": "fsdp+context", "TrainConfig.mesh.context": 8})]


def test_advice_is_in_tfms_terms_and_the_command_renders_its_flags():
    from experiments import preflight as command
    data = TrainConfig(batch_size=8, mesh=MeshConfig(data=4), parallelism="data")
    tips = preflight.advice(data, tiny("llama"), rows_per_device=2)
    assert [str(t) for t in tips[:2]] == [
        "shard parameters and optimizer state (parallelism data+fsdp does too): TrainConfig.parallelism='fsdp', "
        "TrainConfig.mesh.fsdp=-1, TrainConfig.mesh.data=1",
        "rematerialise more (now 'none'; 'full' saves the most): "
        "ModelConfig.execution.remat_policy='dots_with_no_batch_dims_saveable'"]
    assert [command.as_flags(t) for t in tips] == [
        "shard parameters and optimizer state (parallelism data+fsdp does too): --config.parallelism=fsdp "
        "--config.mesh.fsdp=-1 --config.mesh.data=1",
        "rematerialise more (now 'none'; 'full' saves the most): "
        "--config.model.overrides.execution.remat_policy=dots_with_no_batch_dims_saveable",
        "accumulate gradients: --config.microbatches=2", "or a smaller batch: --config.batch_size=4"]
    with pytest.raises(ValueError, match="'LMTask.z_loss' is not a field an experiment config sets"):
        command.as_flags(preflight.Tip("x", {"LMTask.z_loss": 0.0}))


def test_pallas_in_a_plain_jit_under_a_mesh_is_split_per_device():
    """Outside the Trainer (no flax rules) the kernel still meets the mesh through shard_map:
    Mosaic refuses an unpartitioned kernel, so this compiling is the check."""
    devices = preflight.parse_target("v5p-8").devices()
    mesh = parallel.make_mesh(MeshConfig(data=2, tensor=2), devices)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None, "tensor"))
    q = jax.ShapeDtypeStruct((4, 256, 4, 128), jnp.bfloat16, sharding=spec)
    with jax.set_mesh(mesh):
        compiled = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, causal=True, impl="pallas")
                           ).lower(q, q, q).compile()
    _, kernels, _ = preflight.read_hlo(compiled.as_text())
    assert kernels and all(k["result"].startswith("bf16[2,2,256,128]") for k in kernels), kernels

    other = jax.sharding.Mesh(np.array(devices), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(other), pytest.raises(ValueError, match=r"mesh with axes \('x',\) needs rules"):
        jax.jit(lambda q: dot_product_attention(q, q, q, impl="pallas")).lower(
            jax.ShapeDtypeStruct((4, 256, 4, 128), jnp.bfloat16))


def _preflight(*args, **env_changes):
    env = xla_env.subprocess_env(**env_changes)
    return subprocess.run([sys.executable, "-m", "experiments.preflight", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error")]


def test_command_reports_a_recipe_and_writes_json(tmp_path):
    out = tmp_path / "report.json"
    proc = _preflight("--config=experiments/lm/configs/tiny.py", "--target=v5p-8", f"--json={out}",
                      "--kernels_apart", "--config.mesh.data=2", "--config.mesh.fsdp=2",
                      "--config.parallelism=data+fsdp",
                      "--config.model.overrides.scan_layers=True")  # a ModelConfig field the recipe leaves unset
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for text in ("v5p-8: 4 x TPU v5p", "mesh {'data': 2, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 1}", "scan_layers True",
                 # (2DV + 2 layers of 8D² + 4DF + 4TD) / (2DV + 1 layer): 57344 / 36864 = 1.56 at D 32, F 64, T 32, V 256
                 "XLA cost model x 1.6: it counts a scanned body once",
                 "train step on v5p-8 (4 chips)", "eval step on v5p-8", "memory per chip", "MFU",
                 "collectives", "fits: every step"):
        assert text in proc.stdout, (text, proc.stdout)
    records = json.loads(out.read_text())
    assert [r["step"] for r in records] == ["train", "eval"] and all(r["fits"] for r in records)
    assert records[0]["model_flops"] == pytest.approx(3 * records[1]["model_flops"])
    # attention xla: no kernels to take apart, so no second compile and a part of 0
    assert all(r["kernel_seconds"] == 0 and r["estimate_seconds_without_kernels"] == r["estimate_seconds"]
               for r in records), records


def test_a_step_that_does_not_fit_exits_3_with_advice():
    """A 2M-token vocabulary at D 512 replicated (data parallel) is 12 GiB of fp32 parameters and
    Adam moments per chip: more than a v5e's 16 GiB with its gradients."""
    proc = _preflight("--config=experiments/lm/configs/tiny.py", "--target=v5e-4", "--noeval",
                      "--config.vocab_size=2000000", "--config.model.overrides.d_model=512",
                      "--config.model.overrides.num_heads=8")
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "DOES NOT FIT" in proc.stdout and "to fit: shard parameters and optimizer state" in proc.stdout


@pytest.mark.parametrize("args,message", [
    (["--target=v5p-7"], "error: unknown target 'v5p-7'; valid:"),
    (["--target=v5p-8", "--config.batch_size=6"],
     "error: batch 6 (6 per microbatch) does not split over the batch axes data = 4 devices"),
    (["--target=v5p-8", "--config.mesh.data=3"], "error: mesh {'data': 3, 'fsdp': 1, 'expert': 1, 'context': 1, 'tensor': 1} needs 3"),
])
def test_bad_input_is_one_line(args, message):
    proc = _preflight("--config=experiments/lm/configs/tiny.py", *args)
    assert proc.returncode == 1 and _error_lines(proc.stderr) == [l for l in _error_lines(proc.stderr)
                                                                  if l.startswith(message)], proc.stderr[-2000:]
    assert len(_error_lines(proc.stderr)) == 1


def test_a_missing_compiler_plugin_names_the_pip_command(tmp_path):
    proc = _preflight("--config=experiments/lm/configs/tiny.py", "--target=h100-1", TFM_COMPILE_PLUGINS=str(tmp_path))
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: compiling for GPU needs jax-cuda12-pjrt: pip install --no-deps --target "
                               f"{tmp_path} jax-cuda12-pjrt==")


def test_a_fine_tuning_recipe_is_refused_in_one_line():
    proc = _preflight("--config=experiments/bert/configs/glue.py:rte", "--target=v5p-8")
    assert proc.returncode == 1 and "preflight takes the training recipes" in proc.stderr


def test_an_estimate_above_peak_is_refused():
    """A step time that would put MFU above 100% has left work out (e.g. kernels inside a loop that
    the loop factor cannot see): the report refuses it instead of printing it."""
    target = preflight.parse_target("v5p-8")
    mesh = jax.sharding.Mesh(np.array(target.devices()), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("x")))
    compiled = jax.jit(lambda a: a @ a.T).lower(x).compile()
    flops = 2 * 1024 ** 3  # the matmul's
    for model_flops, refused in ((flops, False), (1e6 * flops, True)):
        report = preflight.StepReport("train", target.name, target.chips, 1.0, target.chip.hbm_bytes)
        report.model_flops = model_flops
        preflight.analysis._fill(report, compiled, target, 1.0)
        assert (report.estimate_seconds is None) == refused, report.estimate_note
        assert report.estimate_note.startswith("refused: ") == refused, report.estimate_note
        assert (report.mfu is None) == refused and (refused or 0 < report.mfu <= 1.0), report.mfu
        lines = "\n".join(preflight.format_report(report, target.chip))
        assert ("estimated step time: refused: " in lines) == refused, lines
        assert (", MFU " in lines) != refused, lines
