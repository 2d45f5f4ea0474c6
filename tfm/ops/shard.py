"""Opaque attention kernels meet the mesh: `shard_map` over the batch and head axes.

XLA's SPMD partitioner cannot split a Pallas or cuDNN call: inside a sharded `jit` it would
gather q, k and v and run the whole attention on every device. `per_device` maps the kernel
over the mesh axes that the active logical rules give "batch" and "heads", so each device
runs it on its own [B/b, T, N/n, H] shard. The sequence axes T and S stay whole on every
device, except for a kernel that exchanges keys itself (`split_length`, context parallelism:
T and S split over the `context` axis when the rules give it "length"; `context_size`).
`per_device_heads` splits another kernel's arrays the same way (the linear-time mixers' kernels).

The mesh is the one `jax.set_mesh` makes current and the rules those of
`flax.linen.logical_axis_rules`; the trainer holds both while it traces the model
(`Trainer.context`). Under a mesh but without rules, tfm's own rule sets split B and N (or,
on a mesh whose axes are not tfm's, a one-line error says what to set). With no mesh, a
one-device mesh, or no rule that splits B or N, the kernel is called directly.
"""
from __future__ import annotations

import math
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tfm.parallel.mesh import AXES, CONTEXT
from tfm.parallel.rules import from_flax_rules, make_rules
from tfm.parallel.sharding import logical_to_spec, restrict, unmapped_axes


def _axes_size(mesh, axes) -> int:
    """Devices along a PartitionSpec entry (None, one axis name or a tuple of them)."""
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def _repeat_kv(x, shards: int):
    """k or v [B, S, K, H] with each kv head repeated so that `shards` divides the heads.

    K -> K * r with r = shards / gcd(K, shards); r divides G whenever `shards` divides N, and
    query head n still meets its kv head (n // (G / r) in the repeated heads is a copy of
    n // G). The gradient of the repeat sums the copies back.
    """
    K = x.shape[2]
    if K % shards == 0:
        return x
    return jnp.repeat(x, shards // math.gcd(K, shards), axis=2)


# Without active logical rules (a plain `jit` under `jax.set_mesh`): batch over every batch-like
# axis of tfm's mesh, heads over `tensor`, as the Trainer's rules would split them.
# The sequence over `context` (when the mesh has one).
_DEFAULT_RULES = make_rules("data", "fsdp", "expert", "context", "tensor", activations=True)


def _rules(mesh, free_axes):
    """The active rules (tfm's defaults when none are active), restricted to unmapped mesh axes."""
    active = from_flax_rules(nn.get_logical_axis_rules())
    if not active and not set(free_axes) & set(AXES):
        raise ValueError(f"an opaque attention kernel under a mesh with axes {tuple(mesh.axis_names)} needs "
                         "rules saying which split the batch and the heads: trace it inside "
                         "flax.linen.logical_axis_rules(...) giving 'batch' and 'heads' mesh axes, or name "
                         f"the mesh axes as tfm does {AXES}")
    return restrict(active or _DEFAULT_RULES, free_axes)


def context_size() -> int:
    """Devices the current mesh and rules split a sequence over: the size of the `context` axis
    when it is unmapped and the rules give it "length", else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    free_axes = () if mesh.empty else unmapped_axes(mesh)
    if CONTEXT not in free_axes or mesh.shape[CONTEXT] == 1:
        return 1
    return mesh.shape[CONTEXT] if CONTEXT in dict(_rules(mesh, free_axes)).get("length", ()) else 1


def _axes(q_shape, mesh, free_axes, split_length):
    """PartitionSpec entries for B, T and N of q [B, T, N, H] under the active rules (axes that
    do not divide a dim are left out, as for every other activation); T only over `context`."""
    rules = _rules(mesh, free_axes)
    length = "length" if split_length else None
    spec = tuple(logical_to_spec(("batch", length, "heads"), q_shape[:3], mesh, rules)) + (None,) * 3
    return spec[0], (CONTEXT if split_length and context_size() > 1 else None), spec[2]


def _offset(axes, size: int):
    """Inside shard_map: the global index of this shard's first element along a dim split over `axes`
    (None, one mesh axis or a tuple of them, major first) into shards of `size`; int32 []."""
    return jnp.int32(0) if axes is None else (jax.lax.axis_index(axes) * size).astype(jnp.int32)


def per_device(kernel: Callable, q, k, v, q_segment_ids=None, kv_segment_ids=None, alibi_slopes=None, *,
               split_length: bool = False, offsets: bool = False):
    """kernel(q, k, v, q_segment_ids, kv_segment_ids, alibi_slopes) -> o, run on each device's shard.

    q [B, T, N, H]; k, v [B, S, K, H]; segment ids [B, T] / [B, S] or None; alibi_slopes [N] or
    None; o [B, T, N, H]. The kernel gets [B/b, T, N/n, H], [B/b, S, K', H] with K' = K/n, or,
    when n does not divide K (GQA with fewer kv heads than the head axis), each kv head
    repeated just enough that it does; segment ids [B/b, .] and slopes [N/n]. With split_length
    T and S are split too (T/c, S/c over the `context` axis, which the kernel names). With offsets the
    kernel also gets offsets=(b0, n0), int32 []: the global index of its shard's first batch row and query
    head ((0, 0) when it is called directly).
    """
    mesh = jax.sharding.get_abstract_mesh()
    free_axes = () if mesh.empty else unmapped_axes(mesh)
    batch = length = heads = None
    if _axes_size(mesh, free_axes) > 1:
        batch, length, heads = _axes(q.shape, mesh, free_axes, split_length)
    extra = dict(offsets=(jnp.int32(0), jnp.int32(0))) if offsets else {}
    if batch is None and length is None and heads is None:
        return kernel(q, k, v, q_segment_ids, kv_segment_ids, alibi_slopes, **extra)
    shards = _axes_size(mesh, heads)
    operands = (q, _repeat_kv(k, shards), _repeat_kv(v, shards), q_segment_ids, kv_segment_ids, alibi_slopes)
    heads_spec = P(batch, length, heads)
    specs = (heads_spec, heads_spec, heads_spec, P(batch, length), P(batch, length), P(heads))
    present = [i for i, x in enumerate(operands) if x is not None]

    def body(*shards):
        local = [None] * len(operands)
        for i, x in zip(present, shards):
            local[i] = x
        if offsets:
            extra["offsets"] = (_offset(batch, local[0].shape[0]), _offset(heads, local[0].shape[2]))
        return kernel(*local, **extra)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs[i] for i in present),
                           out_specs=heads_spec, axis_names=frozenset(free_axes), check_vma=False)
    return mapped(*(operands[i] for i in present))


def per_device_heads(kernel: Callable, arrays, heads_dims, out_heads_dims, grouped=()):
    """kernel(*arrays) -> outputs, run on each device's share of the batch and the heads, as `per_device`
    splits attention's: the batch is dim 0 of every array and output; arrays[i]'s heads are its dim
    heads_dims[i] (None: not split), the outputs' out_heads_dims[i]; arrays[0] is [B, T, N, ...] and its
    split (by the active rules, T whole) is everyone's. The arrays named by index in `grouped` hold groups
    of heads there (Mamba-2's B and C, as K/V heads to query heads), repeated just enough that the heads'
    shard count divides them. Called directly where nothing splits B or N."""
    mesh = jax.sharding.get_abstract_mesh()
    free_axes = () if mesh.empty else unmapped_axes(mesh)
    batch = heads = None
    if _axes_size(mesh, free_axes) > 1:
        batch, _, heads = _axes(arrays[0].shape, mesh, free_axes, False)
    if batch is None and heads is None:
        return kernel(*arrays)
    shards = _axes_size(mesh, heads)
    arrays = [_repeat_kv(x, shards) if i in grouped else x for i, x in enumerate(arrays)]

    def spec(ndim, heads_dim):
        entries = [batch] + [None] * (ndim - 1)
        if heads_dim is not None:
            entries[heads_dim] = heads
        return P(*entries)

    out_shapes = jax.eval_shape(kernel, *arrays)
    mapped = jax.shard_map(kernel, mesh=mesh, in_specs=tuple(spec(x.ndim, d) for x, d in zip(arrays, heads_dims)),
                           out_specs=tuple(spec(len(o.shape), d) for o, d in zip(out_shapes, out_heads_dims)),
                           axis_names=frozenset(free_axes), check_vma=False)
    return mapped(*arrays)
