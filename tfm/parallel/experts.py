"""Dropless experts over sorted tokens, and expert parallelism: tokens travel to their experts' devices.

`grouped_experts(ffn, x, gates, experts, weights)` runs `ffn(rows, group_sizes, weights)` (the experts
as grouped matmuls over rows sorted by expert, e.g. `jax.lax.ragged_dot`) for every (token, choice)
pair and sums each token's k results weighted by its gates.

Without a mesh or active logical rules, all B*T tokens are sorted as one list. Under rules that
split "batch" or "expert", the work runs inside `shard_map` over the axes the rules give "batch", so
each device sorts only its own tokens (a global sort would replicate every token on every device).
Where "expert" has no mesh axis each device then runs every expert on its own tokens. When the
rules split "expert" over mesh axes of n > 1 devices, each device sorts its own pairs by expert,
sends each to the device holding its expert by an all-to-all over the expert axes, runs its E/n
experts on what it received, and sends the results back by a second all-to-all. Sizes are padded:
each device reserves room for all of its N*k pairs on every destination ([n, N*k, D] buffers), so
nothing is dropped whatever the routing. Other mesh axes (tensor, fsdp) are not split inside: the
expert weights arrive whole along them.

With `chunks` > 1 each device takes its N tokens N/chunks at a time (a scan, each chunk under
`jax.checkpoint`), so the buffers above, the sort and the experts' rows are 1/chunks the size in the
forward and in the backward; every token's result is the same, since nothing is dropped.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, PartitionSpec as P

from tfm.parallel.rules import from_flax_rules
from tfm.parallel.sharding import logical_to_spec, restrict, unmapped_axes

# ffn(rows [R, D] sorted by expert, group_sizes [E'] (rows per expert; rows past their sum are
# padding), weights {name: [E', ...]}) -> [R, D]
GroupedFfn = Callable[[jax.Array, jax.Array, dict], jax.Array]


def sort_by_expert(experts, num_experts: int):
    """experts [N, k] -> (order [N*k]: (token, choice) pairs grouped by expert, stable; token [N*k]: the
    token of each sorted pair; group_sizes [E]: pairs per expert, zeros included)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, order // experts.shape[1], group_sizes


def _combine(pair_outputs, order, gates):
    """pair_outputs [N*k, D] in sorted order -> [N, D]: unsorted, weighted by gates [N, k], summed over k."""
    N, k = gates.shape
    unsorted = jnp.zeros_like(pair_outputs).at[order].set(pair_outputs).reshape(N, k, -1)  # [N, k, D]
    return jnp.sum(unsorted * gates[..., None].astype(unsorted.dtype), axis=1)


def local_experts(ffn: GroupedFfn, x, gates, experts, weights: dict, num_experts: int):
    """x [N, D], gates and experts [N, k] -> [N, D], every expert on this device."""
    order, token, group_sizes = sort_by_expert(experts, num_experts)
    return _combine(ffn(x[token], group_sizes, weights), order, gates)


def exchanged_experts(ffn: GroupedFfn, x, gates, experts, weights: dict, num_experts: int, axis, shards: int):
    """Per-device body under shard_map: x [N, D] this device's tokens, gates and experts [N, k], weights
    {name: [E/n, ...]} this device's experts -> [N, D]; pairs travel by all-to-all over `axis` (n shards)."""
    N, k = experts.shape
    local_count, cap = num_experts // shards, N * k
    order, token, _ = sort_by_expert(experts, num_experts)
    expert = experts.reshape(-1)[order]
    dest = expert // local_count  # the shard holding each sorted pair's expert
    per_dest = jnp.bincount(dest, length=shards)
    slot = jnp.arange(N * k) - (jnp.cumsum(per_dest) - per_dest)[dest]  # position within its destination
    send = jnp.zeros((shards, cap, x.shape[-1]), x.dtype).at[dest, slot].set(x[token])
    send_ids = jnp.full((shards, cap), local_count, jnp.int32).at[dest, slot].set(expert % local_count)
    to_experts = lambda a: jax.lax.all_to_all(a, axis, 0, 0)  # [n, cap, ...]: row i from device i
    rows, ids = to_experts(send).reshape(shards * cap, -1), to_experts(send_ids).reshape(-1)
    local_order, _, group_sizes = sort_by_expert(ids[:, None], local_count)  # padding (id E/n) sorts last
    outputs = ffn(rows[local_order], group_sizes, weights)
    outputs = jnp.zeros_like(outputs).at[local_order].set(outputs).reshape(shards, cap, -1)
    return _combine(to_experts(outputs)[dest, slot], order, gates)


def _in_chunks(fn, chunks: int, x, gates, experts):
    """fn(x [n, D], gates [n, k], experts [n, k]) -> [n, D] over `chunks` consecutive slices of the N
    tokens one after another, each rematerialised in the backward: x [N, D] -> [N, D]."""
    if chunks == 1:
        return fn(x, gates, experts)
    N = x.shape[0]
    if N % chunks:
        raise ValueError(f"ModelConfig.moe_chunks={chunks} does not divide the {N} tokens per device of this "
                         f"MoE layer; pick a divisor of {N}")
    split = lambda a: a.reshape(chunks, N // chunks, *a.shape[1:])
    chunk = jax.checkpoint(fn)
    _, y = jax.lax.scan(lambda carry, args: (carry, chunk(*args)), None, (split(x), split(gates), split(experts)))
    return y.reshape(N, -1)


def _expert_plan(batch_size: int, num_experts: int) -> Optional[Tuple[AbstractMesh, tuple, object, object]]:
    """(mesh, free axes, batch spec entry, expert spec entry) when the active rules split the batch or
    the experts over more than one device; None otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = from_flax_rules(nn.get_logical_axis_rules())
    if mesh.empty or not rules:
        return None
    free = unmapped_axes(mesh)
    rules = restrict(rules, free)
    entry = lambda name, size: (tuple(logical_to_spec((name,), (size,), mesh, rules)) + (None,))[0]
    batch, expert = entry("batch", batch_size), entry("expert", num_experts)
    if batch is None and expert is None:
        return None
    return mesh, free, batch, expert


def grouped_experts(ffn: GroupedFfn, x, gates, experts, weights: dict, num_experts: int, chunks: int = 1):
    """x [B, T, D], gates and experts [B, T, k], weights {name: [E, ...]} -> [B, T, D] (see the module doc)."""
    B, T, D = x.shape
    flat = lambda a: a.reshape(-1, a.shape[-1])
    plan = _expert_plan(B, num_experts)
    if plan is None:
        local = lambda x, g, e: local_experts(ffn, x, g, e, weights, num_experts)
        return _in_chunks(local, chunks, flat(x), flat(gates), flat(experts)).reshape(B, T, D)
    mesh, free, batch, expert = plan

    def body(x, gates, experts, weights):
        if expert is None:  # every device holds every expert: its own tokens only, no exchange
            run = lambda x, g, e: local_experts(ffn, x, g, e, weights, num_experts)
        else:
            shards = math.prod(mesh.shape[a] for a in ((expert,) if isinstance(expert, str) else expert))
            run = lambda x, g, e: exchanged_experts(ffn, x, g, e, weights, num_experts, expert, shards)
        return _in_chunks(run, chunks, flat(x), flat(gates), flat(experts)).reshape(x.shape)

    specs = (P(batch), P(batch), P(batch), {name: P(expert) for name in weights})
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(batch), axis_names=frozenset(free),
                         check_vma=False)(x, gates, experts, weights)
