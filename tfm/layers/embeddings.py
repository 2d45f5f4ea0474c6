"""Token embedding tables: `Embed` (token and token-type ids -> vectors, also the tied
unembedding), the row lookup that refuses an id outside the table, and the lookup that keeps
a sharded table sharded (`sharded_lookup`, ExecutionConfig.embedding_impl).

Under FSDP the table [V, D] is split on D over the axes that also split the batch. Left to
XLA's partitioner, a lookup may gather the whole table on every device and sum its whole
gradient (a 163840 x 7168 table: 4.38 GiB in fp32). `sharded_lookup` never does: inside
`shard_map` each device gathers the token ids of its D group (int32, small), reads its D slice
of every row they name, and an all-to-all returns each device its own tokens' whole rows
([tokens, D] per device, the size of the activations). Where the rules also split V
(`tensor`: the tokens are the same on every device of the group), each device reads the rows
in its vocabulary range and a sum over the group completes them (Megatron's vocab-parallel
embedding). The backward is the transpose: an all-to-all of the rows' cotangents and a
scatter-add into each device's own table shard, in fp32 (benchmarks/RESULTS.md: the gradient's
accuracy by dtype).
"""
from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tfm.config import EMBEDDING_IMPLS
from tfm.layers.common import param_init
from tfm.parallel.rules import active_param_rules, from_flax_rules
from tfm.parallel.sharding import logical_to_spec, restrict, unmapped_axes


def check_token_ids(tokens, vocab_size: int, name: str = "token ids"):
    """Clear error for ids outside [0, V) when the ids are concrete (outside jit)."""
    try:
        ids = np.asarray(tokens)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced inside jit: `Embed` turns out-of-range ids into NaN rows instead
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} must lie in [0, {vocab_size}); got values in [{lo}, {hi}]")


def take_rows(table, rows):
    """table [R, D] read at int rows [...] -> [..., D]; a row outside [0, R) gives NaN.

    jnp.take wraps negative rows to the end of the table (numpy indexing) and fills rows >= R
    with NaN; moving negatives past the end too makes every out-of-range row NaN, never another row.
    """
    rows = jnp.where(rows < 0, table.shape[0], rows)
    return jnp.take(table, rows, axis=0, mode="fill", fill_value=jnp.nan)


def _entry_axes(entry) -> tuple:
    """A PartitionSpec entry (None, one mesh axis or a tuple) as a tuple of mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _lookup_plan(table_shape, ids_shape, axes, lookup: str) -> Optional[tuple]:
    """(mesh, free axes, ids spec, table spec, V's mesh axes, D's mesh axes) when `lookup` says to keep
    the table sharded under the current mesh and rules; None when the plain lookup serves (no mesh, no
    parameter rules, a table whole on every device, "xla", or "auto" with fewer table rows than a
    device's tokens)."""
    mesh = jax.sharding.get_abstract_mesh()
    params = active_param_rules()
    if lookup == "xla" or mesh.empty or params is None or len(ids_shape) != 2:
        return None
    free = unmapped_axes(mesh)
    table_spec = tuple(logical_to_spec(axes, table_shape, mesh, restrict(params, free))) + (None, None)
    ids_spec = tuple(logical_to_spec(("batch", "length"), ids_shape, mesh,
                                     restrict(from_flax_rules(nn.get_logical_axis_rules()), free))) + (None, None)
    vocab, embed = (_entry_axes(e) for e in table_spec[:2])
    token_axes = {a for e in ids_spec[:2] for a in _entry_axes(e)}
    if not vocab and not embed or set(vocab) & token_axes or not set(embed) <= token_axes:
        return None  # whole on every device, or split on V over devices holding different tokens
        # (or on D over devices holding the same ones): no tfm rule set does either
    tokens = math.prod(ids_shape) // math.prod(mesh.shape[a] for a in token_axes)
    if lookup == "auto" and table_shape[0] <= tokens:
        return None  # a small table (token types, bytes): gathering it moves less than the rows
    return mesh, free, P(*ids_spec[:2]), P(*table_spec[:2]), vocab, embed


def sharded_lookup(table, ids, *, axes=("vocab", "embed"), dtype=jnp.float32, lookup: str = "auto"):
    """table [V, D] (sharded by the parameter rules on `axes`) read at int ids [B, T] -> [B, T, D]
    in `dtype`, without gathering the table (module docstring); an id outside [0, V) gives NaN.

    lookup: "sharded" keeps the table sharded whenever the rules split it; "auto" too when it has
    more rows than a device has tokens; "xla" (or no mesh / no parameter rules, as outside the
    Trainer) reads it with `take_rows` and leaves the layout to XLA's partitioner."""
    if lookup not in EMBEDDING_IMPLS:
        raise ValueError(f"embedding lookup {lookup!r} is not one of {EMBEDDING_IMPLS}")
    plan = _lookup_plan(table.shape, ids.shape, axes, lookup)
    if plan is None:
        return take_rows(table, ids).astype(dtype)
    mesh, free, ids_spec, table_spec, vocab, embed = plan

    def body(table, ids):  # table [V/v, D/d], ids [b, t]
        for axis in reversed(embed):  # ids of the whole D group: [d1, d2, ..., b, t]
            ids = jax.lax.all_gather(ids, axis, axis=0)
        if vocab:
            first = jax.lax.axis_index(vocab) * table.shape[0]
            local = ids - first
            mine = (local >= 0) & (local < table.shape[0])
            rows = jnp.where(mine[..., None], jnp.take(table, jnp.where(mine, local, 0), axis=0), 0)
            rows = jax.lax.psum(rows.astype(dtype), vocab)  # one device holds each row: exact in dtype
            full = table.shape[0] * math.prod(mesh.shape[a] for a in vocab)
            rows = jnp.where(((ids >= 0) & (ids < full))[..., None], rows, jnp.nan)
        else:
            rows = take_rows(table, ids).astype(dtype)
        for i in reversed(range(len(embed))):  # D slices back to the devices whose tokens they are:
            # [d1..di, b, t, d(i+1).., D/d] -> [d1..d(i-1), b, t, di.., D/d], the slices' axis kept apart
            # (not concatenated into D), so neither direction transposes a [b, t, D] array
            rows = jax.lax.all_to_all(jnp.expand_dims(rows, i + 3), embed[i], split_axis=i, concat_axis=i + 3,
                                      tiled=True).squeeze(i)
        return rows.reshape(rows.shape[:2] + (-1,))

    return jax.shard_map(body, mesh=mesh, in_specs=(table_spec, ids_spec), out_specs=P(*ids_spec, None),
                         axis_names=frozenset(free))(table, ids)


class Embed(nn.Module):
    """Lookup [B, T] -> [B, T, D]; tied output layers read `embedding` [V, D] (tfm.models.embedding).

    lookup: how a sharded table is read (`sharded_lookup`; ExecutionConfig.embedding_impl)."""

    num_embeddings: int
    features: int
    dtype: jnp.dtype = jnp.float32
    axes: tuple = ("vocab", "embed")
    stddev: float = 1.0
    lookup: str = "xla"

    def setup(self):
        self.embedding = self.param(
            "embedding", param_init(nn.initializers.normal(self.stddev), self.axes),
            (self.num_embeddings, self.features), jnp.float32)

    def __call__(self, ids):
        # an id outside [0, V) embeds as NaN
        return sharded_lookup(self.embedding, ids, axes=self.axes, dtype=self.dtype, lookup=self.lookup)
