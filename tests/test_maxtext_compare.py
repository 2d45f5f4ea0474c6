"""benchmarks.maxtext_compare: tfm's side through the preflight, MaxText's read from its compiled step.

MaxText is not installed here: its side is exercised on a stand-in checkout whose `train_compile`
hands a small scanned, sharded step to `jit_and_compile` positionally, as MaxText's `main` does,
compiled for compile-only v5p chips.
"""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import xla_env
from benchmarks import maxtext_compare
from tfm import parallel, preflight
from tfm.kernels import flash_attention
from tfm.ops.attention import dot_product_attention
from tfm.parallel.mesh import MeshConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A stand-in for MaxText's train_compile (the entry points the benchmark uses, with MaxText's signature):
# W [D, D] split over 4 chips, X [B, D] over the batch; 4 scanned layers h = tanh(h W), then one more
# product and a sum: 5 matmuls unrolled, 2 with the scan body once.
STAND_IN = '''
import types
import jax
import jax.numpy as jnp
from flax.linen import partitioning as nn_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P
from tfm import parallel, preflight
from tfm.parallel.mesh import MeshConfig

B, D = 16, 256


def jit_and_compile(func, func_input_args, func_input_kwargs, mesh, in_shardings, out_shardings, static_argnums,
                    donate_argnums, config, logical_axis_rules):
    with jax.set_mesh(mesh), mesh, logical_axis_rules:
        lowered = jax.jit(func, in_shardings=in_shardings, out_shardings=out_shardings,
                          static_argnums=static_argnums, donate_argnums=donate_argnums).lower(
                              *func_input_args, **func_input_kwargs)
    return lowered.compile()


def main(argv):
    settings = dict(a.split("=", 1) for a in argv[2:])
    devices = preflight.parse_target(settings["compile_topology"]).devices()
    mesh = parallel.make_mesh(MeshConfig(data=1, fsdp=-1), devices)
    at = lambda *spec: NamedSharding(mesh, P(*spec))
    w = jax.ShapeDtypeStruct((D, D), jnp.float32, sharding=at("fsdp"))
    x = jax.ShapeDtypeStruct((B, D), jnp.float32, sharding=at("fsdp"))

    def step(w, x):
        h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=4)
        return (h @ w).sum()

    config = types.SimpleNamespace(logical_axis_rules=(("batch", "fsdp"),))
    jit_and_compile(step, (w, x), {}, mesh, (at("fsdp"), at("fsdp")), None, (), (), config,
                    nn_partitioning.axis_rules(config.logical_axis_rules))
'''


def _stand_in(root):
    """A checkout at `root` in MaxText's current layout, with the stand-in train_compile."""
    package = root / "src" / "maxtext"
    (package / "trainers" / "pre_train").mkdir(parents=True)
    (package / "configs").mkdir()
    for folder in (package, package / "trainers", package / "trainers" / "pre_train"):
        (folder / "__init__.py").write_text("")
    (package / "trainers" / "pre_train" / "train_compile.py").write_text(STAND_IN)
    (package / "configs" / "base.yml").write_text("model_name: default\n")
    return root


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The stand-in checkout; its folders leave sys.path, and its modules sys.modules, after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield _stand_in(tmp_path / "maxtext")
    for name in [m for m in sys.modules if m.split(".")[0] == "maxtext"]:
        del sys.modules[name]


def test_maxtext_side_is_read_from_the_step_its_train_compile_compiles(stand_in, tmp_path):
    """The compiled step is taken from `jit_and_compile`, its loop factor from the same function's
    jaxpr (5 / 2), memory and collectives from the compiled program; the table sets the two sides
    side by side with their ratio."""
    checkout = stand_in
    argv = maxtext_compare.maxtext_argv(maxtext_compare.base_config(str(checkout)), target="v5p-8", batch_size=16,
                                        chips=4, seq_len=8, model_name="llama2-7b", remat_policy="minimal",
                                        output_dir=str(tmp_path / "out"))
    assert argv[1] == str(checkout / "src/maxtext/configs/base.yml") and "per_device_batch_size=4" in argv
    figures = maxtext_compare.maxtext_figures(maxtext_compare.find_train_compile(str(checkout)), argv)

    assert figures["loop_factor"] == 2.5
    assert figures["estimate_seconds"] == pytest.approx(2.5 * figures["cost_model_seconds"])
    assert figures["cost_model_seconds"] > 0
    assert figures["estimate_seconds_without_kernels"] == figures["estimate_seconds"]  # no kernels to leave out
    assert figures["argument_bytes"] == (256 * 256 + 16 * 256) * 4 // 4  # W and X, a quarter each per chip
    assert figures["total_bytes"] == (figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"]
                                      + figures["temp_bytes"])
    gathered = figures["collectives"]["all-gather"]["shapes"]  # W whole (in bf16: TPU's default matmul precision)
    assert any(s.endswith("[256,256]") for s in gathered), figures["collectives"]
    assert figures["kernel_calls"] == 0
    assert figures["time_by_op"] and 0 < sum(share for _, share in figures["time_by_op"]) <= 1 + 1e-9
    lines = maxtext_compare.table(figures, figures)
    assert any(l.startswith("| memory: total") and l.endswith("| 1.000 |") for l in lines), lines
    assert any(l.startswith("| all-gather (loop bodies once) | x") for l in lines), lines


def test_kernels_that_carry_a_cost_estimate_are_counted_in_the_compiled_program():
    """tfm's flash kernel carries a cost estimate in its call's backend config; inside
    `without_cost_estimates` (as MaxText's splash kernel) it carries none, and XLA's cost model then
    scores the step lower."""
    mesh = parallel.make_mesh(MeshConfig(data=4), preflight.parse_target("v5p-8").devices())
    q = jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))

    def compiled():
        with jax.set_mesh(mesh):
            return jax.jit(lambda q: dot_product_attention(q, q, q, causal=True, impl="pallas")).lower(q).compile()

    def figures(step):
        return maxtext_compare.read_compiled(step.as_text(), step.memory_analysis(), preflight.cost_analysis(step), 1.0)

    carried = figures(compiled())
    with flash_attention.without_cost_estimates():
        bare = figures(compiled())
    assert carried["kernel_calls"] == carried["kernels_with_cost_estimate"] == bare["kernel_calls"] > 0
    assert bare["kernels_with_cost_estimate"] == 0
    assert 0 < bare["estimate_seconds"] < carried["estimate_seconds"]


def test_without_maxtext_one_line_says_so_and_tfms_side_is_reported(tmp_path):
    """A --maxtext with no checkout: one line naming what to pass, exit 0, and tfm's side in the table
    and the JSON (its flash kernels' part apart)."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.maxtext_compare", "--config=experiments/lm/configs/tiny.py",
         "--target=v5p-8", "--config.model.overrides.execution.attention_impl=pallas", f"--out={out}",
         f"--maxtext={tmp_path / 'nothing'}"],
        cwd=ROOT, env=xla_env.subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = [l for l in proc.stdout.splitlines() if l.startswith("MaxText:")]
    assert len(said) == 1 and "no MaxText checkout at" in said[0] and "pass --maxtext=PATH" in said[0], said
    table = (out / "report.md").read_text()
    total = next(l for l in table.splitlines() if l.startswith("| memory: total"))
    assert total.split("|")[2].strip().endswith("MiB") and total.split("|")[3].strip() == "—", total
    assert "splash kernel carries no cost estimate" in table
    assert any(line.startswith("- tfm: ") and "dot_general" in line for line in table.splitlines()), table
    result = json.loads((out / "report.json").read_text())
    tfm = result["tfm_figures"]
    assert result["maxtext_figures"] is None and result["step_ratio_without_kernels"] is None
    assert 0 < tfm["estimate_seconds_without_kernels"] < tfm["estimate_seconds"] and tfm["kernel_seconds"] > 0
    assert tfm["kernel_calls"] == tfm["kernels_with_cost_estimate"] > 0
