"""Device mesh over the named axes (data, fsdp, expert, context, tensor), with Auto axis types.

The mesh shape comes from `MeshConfig`; one axis may be -1 and is inferred from the device
count. `context` splits sequences (context parallelism, `tfm.ops.context`), next to `tensor`,
the innermost (fastest-varying) axis: tensor-parallel groups, then the context ring, sit on
neighbouring devices (same host / ICI ring). Across TPU slices or GPU nodes (DCN) one axis
is multiplied by `num_slices` as the outermost factor: `dcn_axis="data"` is pure data
parallelism between slices (the usual choice), `dcn_axis="fsdp"` is hybrid-sharded FSDP.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.experimental import mesh_utils

AXES = ("data", "fsdp", "expert", "context", "tensor")
CONTEXT = "context"  # the axis sequences are split over


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Per-slice (ICI) axis sizes; -1 on at most one axis means "all remaining devices"."""

    data: int = -1  # data-parallel replicas
    fsdp: int = 1  # devices splitting the parameters and optimizer state (FSDP)
    expert: int = 1  # devices splitting the MoE experts
    context: int = 1  # devices splitting each sequence (context parallelism)
    tensor: int = 1  # devices splitting each layer's matmuls (tensor parallelism)
    num_slices: int = 1  # TPU slices / GPU nodes joined over DCN
    dcn_axis: str = "data"  # the axis split over the slices
    CHOICES = dict(dcn_axis=AXES)  # checked below

    def __post_init__(self):
        sizes = self.ici_sizes()
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError(f"MeshConfig: at most one axis may be -1, got {dict(zip(AXES, sizes))}")
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"MeshConfig: axis sizes must be positive or -1, got {dict(zip(AXES, sizes))}")
        if self.dcn_axis not in AXES:
            raise ValueError(f"MeshConfig.dcn_axis must be one of {AXES}, got {self.dcn_axis!r}")
        if self.num_slices < 1:
            raise ValueError(f"MeshConfig.num_slices must be >= 1, got {self.num_slices}")

    def ici_sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def resolve(self, num_devices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ici_shape, dcn_shape) over AXES for `num_devices` devices, -1 inferred."""
        if num_devices % self.num_slices:
            raise ValueError(f"{num_devices} devices do not split into {self.num_slices} slices")
        per_slice = num_devices // self.num_slices
        sizes = list(self.ici_sizes())
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if per_slice % known:
                raise ValueError(
                    f"mesh {dict(zip(AXES, sizes))}: {per_slice} devices per slice are not "
                    f"divisible by the fixed axes' product {known}")
            sizes[sizes.index(-1)] = per_slice // known
        elif known != per_slice:
            raise ValueError(
                f"mesh {dict(zip(AXES, sizes))} needs {known} devices per slice, "
                f"but there are {per_slice} ({num_devices} devices / {self.num_slices} slices)")
        dcn = tuple(self.num_slices if a == self.dcn_axis else 1 for a in AXES)
        return tuple(sizes), dcn


def current_platform() -> str:
    """"tpu", "gpu" or "cpu": the platform of the devices of the mesh that `jax.set_mesh` made
    current (inside `jit` and `shard_map` too), else JAX's default backend. A CPU host compiling
    for compile-only TPU or GPU devices (tfm.preflight) gets the mesh's platform."""
    mesh = jax.sharding.get_abstract_mesh()
    name = jax.default_backend() if mesh.empty else mesh.abstract_device.platform
    return {"cuda": "gpu", "rocm": "gpu"}.get(name, name)


def current_device_kind() -> str:
    """The `device_kind` of the current mesh's devices (e.g. "NVIDIA H100 80GB HBM3"), else of
    JAX's first device; compile-only devices have theirs too."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.devices()[0].device_kind if mesh.empty else mesh.abstract_device.device_kind


def make_mesh(config: MeshConfig = MeshConfig(), devices=None) -> jax.sharding.Mesh:
    """A `Mesh` over AXES with Auto axis types (for jit with in/out shardings)."""
    devices = list(jax.devices() if devices is None else devices)
    ici, dcn = config.resolve(len(devices))
    if config.num_slices > 1:
        # Slices are TPU slices (devices know their slice), else processes (GPU nodes).
        by_process = devices[0].platform != "tpu"
        array = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=by_process, allow_split_physical_axes=True)
    else:
        try:
            array = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
        except (AssertionError, NotImplementedError, ValueError):
            array = np.asarray(devices).reshape(ici)
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.sharding.Mesh(array, AXES, axis_types=auto)
