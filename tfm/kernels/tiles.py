"""The flash kernels' tile sizes and dtypes: what a caller (ModelConfig, the attention entry point,
`auto`) may name without importing the kernels themselves."""
from __future__ import annotations

import dataclasses
from typing import Optional

GPU_DTYPES = ("bfloat16", "float16")  # Triton: the tensor-core dtypes; float32 is refused


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes: forward (block_q, block_kv) and backward (block_q_bwd, block_kv_bwd).

    All are powers of two >= 8 (the Triton lowering needs powers of two). Backward sizes
    default to the forward ones. TPU also needs block_kv, block_q_bwd and block_kv_bwd to be
    multiples of 128 (they become lane dimensions); `check_backend` says so.
    """
    block_q: int = 128
    block_kv: int = 128
    block_q_bwd: Optional[int] = None
    block_kv_bwd: Optional[int] = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.name.endswith("_bwd"):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"BlockSizes.{field.name} must be an int, got {value!r}")
            if value < 8 or value & (value - 1):
                raise ValueError(f"BlockSizes.{field.name} must be a power of two >= 8, got {value}")

    @property
    def backward(self) -> tuple[int, int]:
        """(block_q, block_kv) for the backward kernels."""
        return (self.block_q_bwd or self.block_q, self.block_kv_bwd or self.block_kv)

    def check_backend(self, backend: str) -> None:
        """Raises ValueError if these sizes cannot lower on `backend`."""
        if backend == "tpu":
            for name, value in (("block_kv", self.block_kv), ("block_kv_bwd", self.backward[1]),
                                ("block_q_bwd", self.backward[0])):
                if value % 128:
                    raise ValueError(f"on TPU BlockSizes.{name} must be a multiple of 128, got {value}")
        if backend == "gpu" and min(self.block_q, self.block_kv, *self.backward) < 16:
            raise ValueError(f"on GPU every block size must be >= 16 (Triton dot); got {self}")

    @classmethod
    def default(cls, backend: str, head_dim: int) -> "BlockSizes":
        """Per-backend defaults (not yet timed on hardware; on GPU they leave every kernel
        register headroom with GPU_NUM_WARPS: benchmarks/RESULTS.md)."""
        if backend == "tpu":
            return cls(block_q=512, block_kv=512, block_q_bwd=256, block_kv_bwd=256)
        if backend == "gpu":
            return cls(block_q=128, block_kv=64 if head_dim <= 64 else 32,
                       block_q_bwd=64, block_kv_bwd=64 if head_dim <= 64 else 32)
        return cls(block_q=128, block_kv=128)
