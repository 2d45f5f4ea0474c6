"""Shardings derived from logical axis names and a rule set.

A logical spec (a tuple of names, one per array dim) resolves to a `PartitionSpec`: each
name takes the mesh axes its rule gives, skipping axes already used by an earlier dim and
axes whose size does not divide the dim (those dims stay replicated, e.g. 2 kv heads on
tensor=4). Optimizer-state leaves take the sharding of the parameter they mirror.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tfm.parallel.rules import Rules


def unmapped_axes(mesh) -> tuple[str, ...]:
    """The mesh's axes not yet mapped by an enclosing `shard_map` (all of them outside one)."""
    return tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)


def restrict(rules: Rules, axes) -> Rules:
    """`rules` with each name's mesh axes limited to `axes` (e.g. the unmapped ones)."""
    return tuple((name, tuple(a for a in named if a in axes)) for name, named in rules)


def logical_to_spec(names, shape, mesh: jax.sharding.Mesh, rules: Rules) -> P:
    """PartitionSpec for an array of `shape` whose dims are named `names` (None = unnamed)."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape):
        axes = []
        for axis in table.get(name, ()) if name is not None else ():
            size = mesh.shape[axis]
            if axis in used or size == 1:
                continue
            if dim % (math.prod(mesh.shape[a] for a in axes) * size) == 0:
                axes.append(axis)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned)


def logical_specs(boxed_tree) -> Any:
    """Tree of logical name tuples (None for unannotated leaves) from a boxed param tree."""
    return jax.tree.map(lambda x: tuple(x.names) if _is_box(x) else None, boxed_tree,
                        is_leaf=_is_box)


def param_shardings(boxed_tree, mesh: jax.sharding.Mesh, rules: Rules) -> Any:
    """NamedSharding tree (matching the unboxed tree) for a boxed abstract param tree."""
    def one(x):
        if _is_box(x):
            value = x.value
            return NamedSharding(mesh, logical_to_spec(x.names, value.shape, mesh, rules))
        return NamedSharding(mesh, P())
    return jax.tree.map(one, boxed_tree, is_leaf=_is_box)


def mirror_shardings(abstract_tree, params_abstract, params_shardings, mesh) -> Any:
    """Shardings for a tree (optimizer state) whose leaves mirror params: a leaf whose key
    path ends with a param's path and has that param's shape gets its sharding; any other
    leaf (step counts, factored second moments) is replicated."""
    table = {}
    for (path, a), s in zip(jax.tree_util.tree_flatten_with_path(params_abstract)[0],
                            jax.tree.leaves(params_shardings)):
        table[tuple(map(str, path))] = (a.shape, s)
    replicated = NamedSharding(mesh, P())

    def one(path, leaf):
        keys = tuple(map(str, path))
        for i in range(len(keys)):
            hit = table.get(keys[i:])
            if hit is not None and hit[0] == np.shape(leaf):
                return hit[1]
        return replicated
    return jax.tree_util.tree_map_with_path(one, abstract_tree)


def batch_spec(rules: Rules) -> P:
    """PartitionSpec of a batch array: dim 0 over the "batch" rule's axes."""
    axes = dict(rules).get("batch", ())
    return P(axes if len(axes) > 1 else (axes[0] if axes else None))


def batch_sharding(mesh: jax.sharding.Mesh, rules: Rules) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(rules))


def global_batch(local_batch: dict, sharding: NamedSharding) -> dict:
    """Process-local numpy batch (this host's rows) -> global jax arrays sharded on dim 0.

    Each host passes only its part: rows [i*B/P, (i+1)*B/P) of the global batch of B rows
    for process i of P (the rows its devices hold under a batch-major mesh)."""
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in local_batch.items()}
