"""Replica agreement: the data-parallel copies of each parameter block must hold the same bits.

A core that computes wrong without failing ("silent data corruption") leaves its replica's
parameters drifting from the others' while every step reports normal losses. The ReplicaCheck
hook (tfm.train.hooks; TrainConfig.replica_check_every) sums the bits of every device's block of every parameter on
the device, gathers the sums (a [devices, parameters] uint32 table, the only transfer) and
compares the devices that hold the same block; a device whose sum differs from the most common
one stops the run, naming its data-parallel replica and the step, before the next checkpoint.
"""
from __future__ import annotations

import collections
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tfm.train.optim import param_path

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16}  # wider dtypes are read as uint32 words


class ReplicaMismatchError(FloatingPointError):
    """Copies of a parameter that should be bitwise equal across replicas are not."""


def block_checksum(x: jax.Array) -> jax.Array:
    """[] uint32: the wrapping sum of the bits of `x` (any shape, any dtype); one flipped bit changes it."""
    bits = jax.lax.bitcast_convert_type(x, _UNSIGNED.get(x.dtype.itemsize, jnp.uint32))
    return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)


def _axes(spec: P) -> list[str]:
    """The mesh axes a PartitionSpec splits an array over."""
    return [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]


class ReplicaChecksums:
    """`table(params)` -> [D, L] uint32 numpy array, on every process: row d holds device
    `mesh.devices.flat[d]`'s checksums of its blocks of the L parameter leaves; `disagreements`
    names the devices whose block differs from the other holders of the same block."""

    def __init__(self, mesh: jax.sharding.Mesh, param_shardings):
        self.mesh = mesh
        flat = jax.tree_util.tree_flatten_with_path(param_shardings)[0]
        self.paths = [param_path(p) for p, _ in flat]
        self.specs = [s.spec for _, s in flat]
        names = tuple(mesh.axis_names)

        def local(params):  # one device's blocks -> every device's checksums, replicated
            sums = jnp.stack([block_checksum(x) for x in jax.tree.leaves(params)])
            return jax.lax.all_gather(sums, names)

        specs = jax.tree.map(lambda s: s.spec, param_shardings)
        # the gathered table is the same on every device, which the varying-axes check cannot infer
        self._table = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=P(), check_vma=False))

    def table(self, params) -> np.ndarray:
        out = self._table(params)
        return np.asarray(out.addressable_data(0)).reshape(self.mesh.devices.size, len(self.paths))

    def disagreements(self, table: np.ndarray) -> list[tuple[int, int]]:
        """(device row, leaf) for each block whose checksum differs from the most common one among
        the devices holding that block (a tie goes to the lowest device's value)."""
        names = list(self.mesh.axis_names)
        coords = np.stack(np.unravel_index(np.arange(table.shape[0]), self.mesh.devices.shape), 1)
        bad = []
        for leaf, spec in enumerate(self.specs):
            split = [names.index(a) for a in _axes(spec)]
            groups = collections.defaultdict(list)
            for row in range(table.shape[0]):
                groups[tuple(coords[row, split])].append(row)
            for rows in groups.values():
                common = collections.Counter(table[rows, leaf].tolist()).most_common(1)[0][0]
                bad += [(row, leaf) for row in rows if table[row, leaf] != common]
        return sorted(bad)

    def replica(self, row: int) -> int:
        """The data-parallel replica (position along the mesh's "data" axis) of device row `row`."""
        coords = np.unravel_index(row, self.mesh.devices.shape)
        return int(coords[list(self.mesh.axis_names).index("data")])

    def describe(self, bad: list[tuple[int, int]]) -> str:
        """"replica 3 of 8 (device 3 on process 0) ...: 5 of 12 parameter arrays, first <path>" for `bad`."""
        devices = list(self.mesh.devices.flat)
        rows = sorted({row for row, _ in bad})
        replicas = sorted({self.replica(row) for row in rows})
        named = f"replica {replicas[0]}" if len(replicas) == 1 else "replicas " + ", ".join(map(str, replicas))
        where = ", ".join(f"device {devices[r].id} on process {devices[r].process_index}" for r in rows)
        return (f"{named} of {self.mesh.shape['data']} ({where}) holds parameters that differ from the other "
                f"replicas': {len({leaf for _, leaf in bad})} of {len(self.paths)} parameter arrays, first "
                f"{self.paths[bad[0][1]]}")
