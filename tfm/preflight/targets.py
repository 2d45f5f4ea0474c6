"""Compile-only accelerators: TPU slices and H100/H200 hosts by name, without the hardware.

A target names a slice as Google does (`v5p-512`: v4 and v5p count TensorCores, two per chip,
so 256 chips; `v5e-256` and `v6e-256` count chips) or by topology (`v5p:4x8x8`), or NVIDIA
GPUs (`h100-8`: one host of 8; `h100-32`: four hosts of 8). `Target.devices()` gives JAX
compile-only devices of it: libtpu compiles for TPU and the CUDA PJRT plugin for a GPU
described by its `GpuTargetConfig` (below), both on a CPU host with JAX_PLATFORMS=cpu.

The plugins need not be importable by every process: `make test` installs them into
`.venv/compile-only`, which `use_plugins()` puts on the path (before JAX starts its backends),
so that plain CPU runs never load them.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import itertools
import math
import os
import sys

import jax

GiB = 1 << 30
LIBTPU_FOR_JAX = {"0.10.2": "0.0.42.1"}  # libtpu release built with each jax release
PTXAS = "nvidia-cuda-nvcc-cu12==12.9.86"  # register and spill figures of the GPU kernels


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip: HBM, dense bf16 peak (data sheets) and how slices are named."""
    name: str
    platform: str           # "tpu" or "gpu"
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float     # bytes/s
    cores_per_chip: int = 1  # slice names count cores (v4, v5p: 2 per chip)
    topology_dims: int = 3   # TPU torus dimensions
    gpu_description: str = ""


def _gpu_description(name: str, *, sms: int, memory: int, bandwidth: float, clock_ghz: float) -> str:
    """XLA's GpuTargetConfig (text proto) for a Hopper GPU (sm_90: 228 KiB shared memory per SM,
    227 KiB of it opt-in per block, 64 Ki registers per SM and per block)."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(bandwidth)}
  l2_cache_size: 52428800
  clock_rate_ghz: {clock_ghz}
  device_memory_size: {memory}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{name}"
"""


_H100_MEMORY, _H200_MEMORY = 84_978_434_048, 150_754_820_096  # bytes the driver reports
CHIPS = {
    "v4": Chip("TPU v4", "tpu", 32 * GiB, 275e12, 1.2e12, cores_per_chip=2),
    "v5p": Chip("TPU v5p", "tpu", 95 * GiB, 459e12, 2.765e12, cores_per_chip=2),
    "v5e": Chip("TPU v5e", "tpu", 16 * GiB, 197e12, 0.819e12, topology_dims=2),
    "v6e": Chip("TPU v6e", "tpu", 32 * GiB, 918e12, 1.64e12, topology_dims=2),
    "h100": Chip("NVIDIA H100 80GB HBM3", "gpu", _H100_MEMORY, 989e12, 3.35e12, gpu_description=_gpu_description(
        "NVIDIA H100 80GB HBM3", sms=132, memory=_H100_MEMORY, bandwidth=3.35e12, clock_ghz=1.98)),
    "h200": Chip("NVIDIA H200", "gpu", _H200_MEMORY, 989e12, 4.8e12, gpu_description=_gpu_description(
        "NVIDIA H200", sms=132, memory=_H200_MEMORY, bandwidth=4.8e12, clock_ghz=1.98)),
}
_TORUS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
             256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_TORUS_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
GPUS_PER_HOST = 8


def _c_environment() -> set[str]:
    """Names in the process's C environment (what child processes inherit), which a library's
    setenv changes without `os.environ` knowing."""
    names, entries = set(), ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    for i in itertools.count():
        if entries[i] is None:
            return names
        names.add(entries[i].split(b"=", 1)[0].decode(errors="replace"))


@contextlib.contextmanager
def _no_new_environment_variables():
    """libtpu writes its guesses of a TPU pod (CLOUD_TPU_TASK_ID, TPU_WORKER_ID, ...) into the
    environment when it starts; a child process (a training command) would then think it runs
    on a pod and try to join one. Removes what appeared."""
    before = _c_environment() | set(os.environ)
    try:
        yield
    finally:
        for name in _c_environment() - before - set(os.environ):
            os.unsetenv(name)


@dataclasses.dataclass(frozen=True)
class Target:
    """`chips` chips of `chip` in `num_slices` slices (TPU) or hosts (GPU, within `topology`)."""
    name: str
    chip: Chip
    topology: str   # TPU: "AxBxC" / "AxB" per slice; GPU: "slices x hosts x gpus_per_host"
    chips: int
    num_slices: int = 1

    def devices(self) -> list:
        """Compile-only devices of the whole target (all slices)."""
        from jax.experimental import topologies
        require_plugin(self.chip.platform)
        if self.chip.platform == "tpu":
            # libtpu locks /tmp/libtpu_lockfile for the process that owns the chips; compile-only
            # processes own none, so several (a test run's workers) may load it at once.
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            kwargs = {"chip_config_name": "megacore"} if self.chip.name == "TPU v4" else {}
            kwargs["wrap"] = self.wraparound()
            if self.num_slices > 1:
                kwargs["num_slices"] = self.num_slices
            generation = self.name.split(":")[0].split("-")[0]
            with _no_new_environment_variables():
                return list(topologies.get_topology_desc(f"{generation}:{self.topology}", "tpu", **kwargs).devices)
        return list(topologies.get_topology_desc(platform="cuda", topology=self.topology,
                                                 target_config=self.chip.gpu_description).devices)

    def wraparound(self) -> tuple[bool, bool, bool]:
        """Which dimensions of a TPU slice close into a ring: v4/v5p slices built of whole 4x4x4 cubes
        are tori in all three (smaller ones are open meshes); a v5e/v6e dimension wraps when it spans
        the pod's 16 chips. libtpu's compile-only topology is an open mesh unless told, and on one the
        compiler writes a whole-slice all-gather as an all-reduce of the shard laid into zeros."""
        dims = [int(d) for d in self.topology.split("x")]
        if self.chip.topology_dims == 3:
            return (all(d % 4 == 0 for d in dims),) * 3
        return tuple(d == 16 for d in dims) + (False,)

    def describe(self) -> str:
        slices = f", {self.num_slices} slices" if self.num_slices > 1 and self.chip.platform == "tpu" else ""
        links = ""
        if self.chip.platform == "tpu":
            wrapped = sum(self.wraparound())
            links = (" (a torus)" if wrapped == self.chip.topology_dims else
                     f" (wraparound on {wrapped} of its {self.chip.topology_dims} dims)" if wrapped else "")
        return (f"{self.name}: {self.chips} x {self.chip.name} ({self.chip.hbm_bytes / GiB:.1f} GiB HBM, "
                f"{self.chip.peak_flops / 1e12:.0f} TFLOP/s bf16 each), topology {self.topology}{links}{slices}")


def valid_targets() -> str:
    tpu = [f"{g}-{n * CHIPS[g].cores_per_chip}" for g in ("v4", "v5p") for n in (4, 64, 256)]
    tpu += [f"{g}-{n}" for g in ("v5e", "v6e") for n in (4, 64, 256)]
    return (f"TPU slices such as {', '.join(tpu)} (v4/v5p count cores, 2 per chip; sizes "
            f"{sorted(_TORUS_3D)} chips, or 2-D {sorted(_TORUS_2D)} for v5e/v6e), a topology such as "
            f"v5p:4x8x8, or GPUs h100-N / h200-N (N = 1..8 on one host, or a multiple of {GPUS_PER_HOST})")


def parse_target(name: str, num_slices: int = 1) -> Target:
    """A Target from its name (module doc); ValueError listing the valid ones otherwise."""
    if num_slices < 1:
        raise ValueError(f"--num_slices must be >= 1, got {num_slices}")
    text = name.strip().lower().replace("v5litepod", "v5e")
    generation, _, size = text.replace(":", "-", 1).partition("-")
    chip = CHIPS.get(generation)
    if chip is None or not size:
        raise ValueError(f"unknown target {name!r}; valid: {valid_targets()}")
    if ":" in text:  # an explicit topology
        dims = size.split("x")
        if len(dims) != chip.topology_dims or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"target {name!r}: {generation} topologies have {chip.topology_dims} "
                             f"dimensions, e.g. {'4x8x8' if chip.topology_dims == 3 else '8x8'}")
        chips = math.prod(int(d) for d in dims)
        return Target(text, chip, size, chips * num_slices, num_slices)
    if not size.isdigit() or int(size) % chip.cores_per_chip:
        raise ValueError(f"unknown target {name!r}; valid: {valid_targets()}")
    chips = int(size) // chip.cores_per_chip
    if chip.platform == "gpu":
        if not (1 <= chips <= GPUS_PER_HOST or chips % GPUS_PER_HOST == 0):
            raise ValueError(f"target {name!r}: {chips} GPUs is neither 1..{GPUS_PER_HOST} on one host nor "
                             f"whole hosts of {GPUS_PER_HOST}")
        hosts, per_host = max(1, chips // GPUS_PER_HOST), min(chips, GPUS_PER_HOST)
        return Target(text, chip, f"1x{hosts * num_slices}x{per_host}", chips * num_slices, num_slices)
    table = _TORUS_3D if chip.topology_dims == 3 else _TORUS_2D
    if chips not in table:
        raise ValueError(f"target {name!r}: no {generation} slice of {chips} chips; sizes: "
                         f"{[n * chip.cores_per_chip for n in sorted(table)]}; valid: {valid_targets()}")
    return Target(text, chip, table[chips], chips * num_slices, num_slices)


def plugin_dir() -> str:
    """Where `make test` installs libtpu and the CUDA plugin apart from the environment
    (TFM_COMPILE_PLUGINS overrides)."""
    return os.environ.get("TFM_COMPILE_PLUGINS", os.path.join(sys.prefix, "compile-only"))


def use_plugins() -> None:
    """Puts plugin_dir() on the import path; call before JAX initialises its backends."""
    path = plugin_dir()
    if os.path.isdir(path) and path not in sys.path:
        sys.path.append(path)


def require_plugin(platform: str) -> None:
    """ValueError with the pip command when the compiler for `platform` is not installed."""
    module, index = {"tpu": ("libtpu", 0), "gpu": ("jax_plugins.xla_cuda12", 1)}[platform]
    found = importlib.util.find_spec(module.split(".")[0]) is not None and (
        module == "libtpu" or importlib.util.find_spec(module) is not None)
    if not found:
        package = plugin_requirements()[index]
        raise ValueError(f"compiling for {platform.upper()} needs {package.split('==')[0]}: "
                         f"pip install --no-deps --target {plugin_dir()} {package} (or make compile-plugins)")
    if jax.config.jax_platforms != "cpu":
        raise ValueError("compile-only targets need JAX_PLATFORMS=cpu (set before JAX starts)")


def plugin_requirements() -> list[str]:
    """The pip requirements of the compile-only plugins for the installed jaxlib."""
    import jaxlib
    if jaxlib.__version__ not in LIBTPU_FOR_JAX:
        raise ValueError(f"no libtpu release is known for jaxlib {jaxlib.__version__}; "
                         f"add it to LIBTPU_FOR_JAX (known: {sorted(LIBTPU_FOR_JAX)})")
    return [f"libtpu=={LIBTPU_FOR_JAX[jaxlib.__version__]}", f"jax-cuda12-pjrt=={jaxlib.__version__}", PTXAS]
