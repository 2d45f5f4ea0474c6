"""The flash kernels' tile sizes, GPU launch parameters and dtypes: what a caller (ModelConfig, the
attention entry point, `auto`) may name without importing the kernels themselves."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax

GPU_DTYPES = ("bfloat16", "float16")  # Triton: the tensor-core dtypes; float32 is refused


@dataclasses.dataclass(frozen=True)
class Launch:
    """Triton launch parameters of one GPU kernel: warps per program and software-pipeline stages.

    The defaults, 8 warps and 2 stages: with 4 warps the forward kernel used all 255 registers a
    thread has at the default blocks; 8 warps (two warpgroups of 64 rows of the 128-row query
    tile) halve each thread's share of the fp32 tiles and keep the tiles, so the K/V traffic per
    query is unchanged (benchmarks/gpu_registers.py, benchmarks/RESULTS.md). Measured choices per
    GPU come from `python -m benchmarks.triton_sweep`. Other backends take none.
    """
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        for name, value, ok in (("num_warps", self.num_warps, lambda n: n in (1, 2, 4, 8, 16, 32)),
                                ("num_stages", self.num_stages, lambda n: n >= 1)):
            if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
                raise ValueError(f"Launch.{name} must be " + ("a power of two from 1 to 32" if name == "num_warps"
                                                              else "an int >= 1") + f", got {value!r}")

    @classmethod
    def coerce(cls, value, name: str) -> "Launch":
        """A Launch from a Launch, a (num_warps, num_stages) pair or a dict of its fields (configs)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(*value)
        if isinstance(value, dict) and set(value) <= {"num_warps", "num_stages"}:
            return cls(**value)
        raise ValueError(f"BlockSizes.{name} must be a Launch, a (num_warps, num_stages) pair or a dict of "
                         f"them, got {value!r}")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes per kernel and, on GPU, their Triton launch parameters.

    Tiles: forward (block_q, block_kv); backward (block_q_bwd, block_kv_bwd), the dQ kernel's and,
    unless block_q_dkv / block_kv_dkv name their own, the dK/dV kernel's. All are powers of two
    >= 8 (the Triton lowering needs powers of two); backward sizes default to the forward ones.
    TPU also needs every size but block_q to be a multiple of 128 (they become lane dimensions);
    `check_backend` says so.

    Launch parameters (`Launch`, GPU only): `launch` the forward kernel's, `launch_bwd` the dQ
    kernel's and, unless `launch_dkv` is given, the dK/dV kernel's; the backward ones default to
    the forward's. A pair (num_warps, num_stages) or a dict is taken for a Launch.
    """
    block_q: int = 128
    block_kv: int = 128
    block_q_bwd: Optional[int] = None
    block_kv_bwd: Optional[int] = None
    block_q_dkv: Optional[int] = None
    block_kv_dkv: Optional[int] = None
    launch: Launch = Launch()
    launch_bwd: Optional[Launch] = None
    launch_dkv: Optional[Launch] = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name not in ("block_q", "block_kv", "launch"):
                continue
            if field.name.startswith("launch"):
                object.__setattr__(self, field.name, Launch.coerce(value, field.name))
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"BlockSizes.{field.name} must be an int, got {value!r}")
            if value < 8 or value & (value - 1):
                raise ValueError(f"BlockSizes.{field.name} must be a power of two >= 8, got {value}")

    @property
    def backward(self) -> tuple[int, int]:
        """(block_q, block_kv) for the dQ kernel."""
        return (self.block_q_bwd or self.block_q, self.block_kv_bwd or self.block_kv)

    @property
    def dkv(self) -> tuple[int, int]:
        """(block_q, block_kv) for the dK/dV kernel."""
        block_q, block_kv = self.backward
        return (self.block_q_dkv or block_q, self.block_kv_dkv or block_kv)

    @property
    def launches(self) -> tuple[Launch, Launch, Launch]:
        """The Launch of the forward, dQ and dK/dV kernels."""
        dq = self.launch_bwd or self.launch
        return self.launch, dq, self.launch_dkv or dq

    def check_backend(self, backend: str) -> None:
        """Raises ValueError if these sizes cannot lower on `backend`."""
        if backend == "tpu":
            for name, value in (("block_kv", self.block_kv), ("block_kv_bwd", self.backward[1]),
                                ("block_q_bwd", self.backward[0]), ("block_q_dkv", self.dkv[0]),
                                ("block_kv_dkv", self.dkv[1])):
                if value % 128:
                    raise ValueError(f"on TPU BlockSizes.{name} must be a multiple of 128, got {value}")
            if set(self.launches) != {Launch()}:
                raise ValueError(f"BlockSizes.launch* are Triton's (GPU) launch parameters; TPU takes none, "
                                 f"got {self.launches}")
        if backend == "gpu" and min(self.block_q, self.block_kv, *self.backward, *self.dkv) < 16:
            raise ValueError(f"on GPU every block size must be >= 16 (Triton dot); got {self}")

    @classmethod
    def default(cls, backend: str, head_dim: int) -> "BlockSizes":
        """Per-backend defaults (not yet timed on hardware; on GPU they leave every kernel
        register headroom with Launch's 8 warps: benchmarks/RESULTS.md)."""
        if backend == "tpu":
            return cls(block_q=512, block_kv=512, block_q_bwd=256, block_kv_bwd=256)
        if backend == "gpu":
            return cls(block_q=128, block_kv=64 if head_dim <= 64 else 32,
                       block_q_bwd=64, block_kv_bwd=64 if head_dim <= 64 else 32)
        return cls(block_q=128, block_kv=128)


KERNEL_BACKENDS = ("tpu", "gpu", "cpu")  # Mosaic TPU, Triton / Mosaic GPU, the CPU interpreter


def kernel_backend(backend: Optional[str], kernel: str) -> str:
    """"tpu", "gpu" or "cpu" for a backend name (None: JAX's default); `kernel` names the caller in the error."""
    name = backend or jax.default_backend()
    name = {"cuda": "gpu", "rocm": "gpu"}.get(name, name)
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"{kernel} backend must be one of {KERNEL_BACKENDS}, got {name!r}")
    return name
