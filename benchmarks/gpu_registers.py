"""Registers per thread of the flash-attention kernels compiled for an H100 (sm_90a), from a CPU.

    python -m benchmarks.gpu_registers               # the covering variants, forward + backward
    python -m benchmarks.gpu_registers --sweep       # forward only, every mask-feature subset

Each variant goes through the attention entry point (`dot_product_attention(impl="pallas")`)
inside `jax.jit`, bf16, compiled for a compile-only H100 (`tfm.preflight`) at the default
block sizes, XLA dumping the PTX into a temporary folder (`xla_dump_to` as a compile option,
so no subprocess is needed); `ptxas -v` (the nvidia-cuda-nvcc-cu12 wheel of
`make compile-plugins`) then reports each kernel entry (`flash_attention_fwd`,
`flash_attention_dq`, `flash_attention_dkv`): registers per thread, spill bytes and the
headroom 255 - registers (255 is the per-thread limit at any warp count).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import itertools
import os
import re
import subprocess
import tempfile
from typing import NamedTuple, Optional

MAX_REGISTERS = 255  # per thread on sm_90
KERNELS = ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv")
REFUSE_SPILLS = {"xla_gpu_fail_ptx_compilation_on_register_spilling": True}


class Variant(NamedTuple):
    """One attention call's shapes, q [B, T, N, H] and k, v [B, S, K, H], and mask features."""
    name: str
    T: int = 512
    S: int = 512
    N: int = 4
    K: int = 4
    causal: bool = False
    window: Optional[int] = None
    segments: bool = False
    alibi: bool = False
    softcap: Optional[float] = None


# Each feature alone; causal + window + segments + ALiBi (40 spill bytes at H 128 with 4 warps);
# all features at once (self- and cross-attention).
VARIANTS = (
    Variant("bidirectional"),
    Variant("causal", causal=True),
    Variant("cross", T=256, S=320),  # T != S, S not a multiple of the key block
    Variant("segments", segments=True),
    Variant("window", window=96),
    Variant("alibi", alibi=True),
    Variant("softcap", softcap=30.0),
    Variant("gqa", K=2),
    Variant("mqa", K=1),
    Variant("causal_window_segments_alibi", causal=True, window=96, segments=True, alibi=True),
    Variant("all", causal=True, window=96, segments=True, alibi=True, softcap=30.0, K=2),
    Variant("cross_all", T=256, S=320, window=96, segments=True, alibi=True, softcap=30.0, K=1),
)


def feature_sweep() -> list[Variant]:
    """Every subset of {causal, window, segments, alibi, softcap} (self-attention, MHA)."""
    features = ("causal", "window", "segments", "alibi", "softcap")
    values = dict(causal=True, window=96, segments=True, alibi=True, softcap=30.0)
    return [Variant("+".join(chosen) or "bidirectional", **{f: values[f] for f in chosen})
            for r in range(len(features) + 1) for chosen in itertools.combinations(features, r)]


def compile_attention(variant: Variant, head_dim: int, devices, *, backward: bool = True,
                      dtype="bfloat16", compiler_options: Optional[dict] = None):
    """The compiled `jax.jit` of the attention entry point (impl="pallas") for `variant` with
    q, k, v of `dtype`, forward only or the gradients of sum(o) w.r.t. q, k, v, on a mesh over
    `devices` (compile-only ones) with the batch split over them (one sequence per device)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from tfm.ops.attention import dot_product_attention
    from tfm.parallel.mesh import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(), devices)
    B, v = len(devices), variant
    batch, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    args = [jax.ShapeDtypeStruct((B, v.T, v.N, head_dim), dtype, sharding=batch),
            jax.ShapeDtypeStruct((B, v.S, v.K, head_dim), dtype, sharding=batch),
            jax.ShapeDtypeStruct((B, v.S, v.K, head_dim), dtype, sharding=batch)]
    if v.segments:
        args += [jax.ShapeDtypeStruct((B, v.T), jnp.int32, sharding=batch),
                 jax.ShapeDtypeStruct((B, v.S), jnp.int32, sharding=batch)]
    if v.alibi:
        args.append(jax.ShapeDtypeStruct((v.N,), jnp.float32, sharding=whole))

    def attend(q, k, w, *extra):
        segments, extra = (extra[:2], extra[2:]) if v.segments else ((None, None), extra)
        return dot_product_attention(q, k, w, causal=v.causal, window=v.window, softcap=v.softcap,
                                     q_segment_ids=segments[0], kv_segment_ids=segments[1],
                                     alibi_slopes=extra[0] if v.alibi else None, impl="pallas")

    def grads(q, k, w, *extra):
        loss = lambda q, k, w: attend(q, k, w, *extra).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, w)

    with jax.set_mesh(mesh):
        return jax.jit(grads if backward else attend).lower(*args).compile(compiler_options=compiler_options)


def ptxas_path() -> Optional[str]:
    """ptxas of the nvidia-cuda-nvcc-cu12 wheel in the compile-only plugin folder, or None."""
    from tfm.preflight.targets import plugin_dir
    path = os.path.join(plugin_dir(), "nvidia", "cuda_nvcc", "bin", "ptxas")
    return path if os.access(path, os.X_OK) else None


class Registers(NamedTuple):
    """ptxas -v for one kernel entry: registers per thread, spill bytes, threads per block."""
    registers: int
    spill_stores: int
    spill_loads: int
    threads: int

    @property
    def headroom(self) -> int:
        return MAX_REGISTERS - self.registers


def ptxas_registers(ptx_files, ptxas: str) -> dict[str, Registers]:
    """{kernel entry: Registers} for the flash-attention entries found in `ptx_files`."""
    found = {}
    for path in ptx_files:
        text = open(path).read()
        entries = [e for e in re.findall(r"\.entry (\w+)\(", text) if e in KERNELS]
        if not entries:
            continue
        threads = int(re.search(r"\.reqntid (\d+)", text).group(1))
        info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
        for entry, body in re.findall(r"Compiling entry function '(\w+)'.*?\n(.*?Used \d+ registers)", info, re.S):
            stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body).groups())
            registers = int(re.search(r"Used (\d+) registers", body).group(1))
            found[entry] = Registers(registers, stores, loads, threads)
    return found


def kernel_registers(variant: Variant, head_dim: int, devices, *, backward: bool = True,
                     refuse_spills: bool = True, ptxas: Optional[str] = None) -> dict[str, Registers]:
    """{kernel entry: Registers} of `variant` compiled for `devices` (one compile-only H100);
    with refuse_spills a spilling kernel raises XlaRuntimeError "... register spilling"."""
    with tempfile.TemporaryDirectory() as dump:
        options = {**(REFUSE_SPILLS if refuse_spills else {}), "xla_dump_to": dump}
        compile_attention(variant, head_dim, devices, backward=backward, compiler_options=options)
        return ptxas_registers(glob.glob(os.path.join(dump, "*.ptx")), ptxas or ptxas_path())


def versions(ptxas: str) -> str:
    """'jax X, jax-cuda12-pjrt Y, ptxas Z' for the table's header."""
    import importlib.metadata

    import jax
    release = re.search(r"V([\d.]+)", subprocess.run([ptxas, "--version"], capture_output=True,
                                                     text=True, check=True).stdout).group(1)
    return f"jax {jax.__version__}, jax-cuda12-pjrt {importlib.metadata.version('jax-cuda12-pjrt')}, ptxas {release}"


def table(variants, *, backward: bool):
    """Yields a markdown table, a row per (variant, H in 64, 128): each kernel's registers and
    headroom at the default blocks (forward block_q x block_kv / backward ones)."""
    from tfm.kernels.tiles import BlockSizes
    from tfm.preflight.targets import parse_target

    devices, ptxas = parse_target("h100-1").devices(), ptxas_path()
    kernels = KERNELS if backward else KERNELS[:1]
    names = ", ".join(k.removeprefix("flash_attention_") for k in kernels)
    yield f"| variant | H | blocks fwd / bwd | warps, stages | registers ({names}) | spill bytes | headroom ({names}) |"
    yield "|---|---|---|---|---|---|---|"
    for head_dim in (64, 128):
        blocks = BlockSizes.default("gpu", head_dim)
        for variant in variants:
            found = kernel_registers(variant, head_dim, devices, backward=backward, refuse_spills=False,
                                     ptxas=ptxas)
            regs = [found[k] for k in kernels]
            yield (f"| {variant.name} | {head_dim} | {blocks.block_q}x{blocks.block_kv} / "
                   f"{'x'.join(map(str, blocks.backward))} | {regs[0].threads // 32}, {blocks.launch.num_stages} | "
                   f"{', '.join(str(r.registers) for r in regs)} | "
                   f"{sum(r.spill_stores + r.spill_loads for r in regs)} | "
                   f"{', '.join(str(r.headroom) for r in regs)} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true",
                        help="forward kernel only, at every subset of the mask features")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before JAX starts: compile-only devices
    from tfm.preflight.targets import use_plugins
    use_plugins()
    ptxas = ptxas_path()
    if ptxas is None:
        raise SystemExit("no ptxas: pip install --no-deps --target <plugin dir> nvidia-cuda-nvcc-cu12==12.9.86")
    print(f"# GPU kernel registers (sm_90a)  {datetime.date.today()}  {versions(ptxas)}"
          f"{'  forward, every mask-feature subset' if args.sweep else ''}")
    for row in table(feature_sweep() if args.sweep else VARIANTS, backward=not args.sweep):
        print(row, flush=True)


if __name__ == "__main__":
    main()
