"""The Triton launch parameters per call (`tfm.kernels.tiles.Launch` in `BlockSizes`) and the sweep that
chooses them on a GPU (`benchmarks.triton_sweep`), its smoke mode run end to end in the interpreter."""
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import triton_sweep
from tfm.config import ModelConfig
from tfm.kernels.tiles import BlockSizes, Launch
from tfm.models import presets
from tfm.ops.attention import dot_product_attention
from tfm.parallel.mesh import MeshConfig, make_mesh
from tfm.preflight.targets import parse_target


def test_launch_parameters_are_validated_and_default_to_8_warps_2_stages():
    assert BlockSizes().launches == (Launch(8, 2),) * 3
    blocks = BlockSizes(64, 32, launch=(4, 3), launch_bwd={"num_warps": 2})
    assert blocks.launches == (Launch(4, 3), Launch(2, 2), Launch(2, 2))  # dK/dV takes dQ's
    assert dataclasses.replace(blocks, launch_dkv=Launch(8, 1)).launches[2] == Launch(8, 1)
    assert BlockSizes(64, 32, 16).dkv == (16, 32) and BlockSizes(64, 32, 16, block_kv_dkv=128).dkv == (16, 128)
    for bad, match in (((3, 2), "num_warps must be a power of two"), ((4, 0), "num_stages must be an int >= 1"),
                       ((4,), "launch must be a Launch, a .num_warps, num_stages. pair")):
        with pytest.raises(ValueError, match=match):
            BlockSizes(launch=bad)
    with pytest.raises(ValueError, match="block_q_dkv must be a power of two"):
        BlockSizes(block_q_dkv=48)
    with pytest.raises(ValueError, match="TPU takes none"):
        BlockSizes(128, 128, launch=(4, 2)).check_backend("tpu")
    with pytest.raises(ValueError, match="every block size must be >= 16"):
        BlockSizes(64, 64, block_kv_dkv=8).check_backend("gpu")


def test_a_config_carries_the_launch_parameters_through_json():
    """ExecutionConfig.attention_block_sizes takes them as a dict (an experiment config's) and a saved
    record loads back to the same BlockSizes."""
    cfg = presets.tiny("llama").replace(attention_impl="pallas", attention_block_sizes=dict(
        block_q=64, block_kv=32, launch=dict(num_warps=4, num_stages=3), launch_dkv=(8, 1)))
    assert cfg.execution.attention_block_sizes.launches == (Launch(4, 3), Launch(4, 3), Launch(8, 1))
    record = json.loads(json.dumps(dataclasses.asdict(cfg)))
    assert ModelConfig.from_dict(record).execution.attention_block_sizes == cfg.execution.attention_block_sizes
    with pytest.raises(ValueError, match="attention_block_sizes=.*num_warps must be a power of two"):
        cfg.replace(attention_block_sizes=dict(launch=(6, 2)))


def test_each_kernels_launch_parameters_and_tiles_reach_its_triton_call():
    """Lowered for a compile-only H100 through the entry point: the forward, dQ and dK/dV Triton calls
    carry their own num_warps and num_stages, and their grids follow their own query/key tiles."""
    try:
        devices = parse_target("h100-1").devices()
    except ValueError as error:  # the CUDA compile-only plugin is not installed
        pytest.skip(str(error))
    mesh = make_mesh(MeshConfig(), devices)
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    blocks = BlockSizes(64, 32, 32, 64, block_q_dkv=32, block_kv_dkv=16, launch=(4, 3), launch_bwd=(2, 1),
                        launch_dkv=(16, 2))
    loss = lambda q, k, v: dot_product_attention(q, k, v, causal=True, impl="pallas",
                                                 block_sizes=blocks).astype(jnp.float32).sum()
    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower().as_text()
    calls = {}
    for line in text.splitlines():
        if "__gpu$xla.gpu.triton" in line:
            name = re.search(r'name = "flash_attention_(\w+)"', line).group(1)
            calls[name] = tuple(int(re.search(rf"{key} = (\d+)", line).group(1))
                                for key in ("num_warps", "num_stages", "grid_z"))
    # grid (B, N, T / block_q) for the forward and dQ, (B, K, S / block_kv) for dK/dV
    assert calls == {"fwd": (4, 3, 256 // 64), "dq": (2, 1, 256 // 32), "dkv": (16, 2, 256 // 16)}, calls


def test_smoke_sweep_end_to_end(tmp_path, monkeypatch):
    """--smoke: every step of the descent runs in the interpreter, each configuration checked against xla;
    one that cannot compile (here: any 8-row forward query tile, said to spill) is listed and never chosen;
    the report and JSON hold the best per shape and pass."""
    real = triton_sweep.dot_product_attention

    def spilling(q, k, v, *, block_sizes=None, **options):
        if block_sizes is not None and block_sizes.block_q == 8:
            raise ValueError("ptxas: register spilling refused (a stand-in)")
        return real(q, k, v, block_sizes=block_sizes, **options)

    monkeypatch.setattr(triton_sweep, "dot_product_attention", spilling)
    assert triton_sweep.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    rows, grid = result["rows"], triton_sweep.SMOKE
    assert {r["step"] for r in rows} == set(triton_sweep.BUDGET_S)
    spilled = [r for r in rows if r["status"].startswith("spills")]
    assert spilled and all(r["settings"]["block_q"] == 8 for r in spilled)
    ok = [r for r in rows if r["status"] == "ok"]
    assert all(r["settings"]["block_q"] != 8 for r in ok)
    assert all(r["error"] <= triton_sweep.TOLERANCE for r in ok if r["L"] == grid.length)
    assert all(r["tflops"] > 0 for r in ok)
    shapes = {(r["H"], r["L"], r["causal"], r["pass"]) for r in result["best"]}
    assert shapes == {(32, L, c, p) for L in (grid.length, grid.long) for c in (False, True)
                      for p in ("fwd", "fwd+bwd")}
    for best in result["best"]:
        same = [r["tflops"] for r in ok if (r["H"], r["L"], r["causal"], r["pass"])
                == (best["H"], best["L"], best["causal"], best["pass"])]
        assert best["tflops"] == max(same)
    tried = {(r["settings"]["block_q_dkv"], r["settings"]["block_kv_dkv"]) for r in rows if r["pass"] == "fwd+bwd"}
    assert tried == {(a, b) for a in grid.blocks for b in grid.blocks}
    report = (tmp_path / "report.md").read_text()
    assert "## Best per shape" in report and "FlashAttention-2's convention" in report
    assert re.search(r"H 32 causal: BlockSizes\(block_q=16, .*launch_dkv=\(\d, \d\)\)", report)
    assert f"## Left out: {len(spilled)} configuration(s)" in report
