"""Context parallelism for the linear-time scans: the sequence split over `context`, states passed on.

Under a mesh whose rules split "length" over `context` (c devices, `tfm.ops.shard.context_size`), device
i holds tokens [i T/c, (i + 1) T/c) of every row. Every scan of tfm.ops (ssd, selective_scan,
gated_delta_rule, wkv, linear_scan) is a recurrence whose state after a stretch of tokens is an affine
function of the state before it: h_out = M(h_in) + b. `scan` runs one inside `shard_map` over `context`:

  1. each device reduces its share to that map: its contribution b (the share run from the empty
     state) and its transfer M (a decay per state entry for the diagonal recurrences, `DIAGONAL`; a
     [K, K] matrix per head for the delta rule, `MATRIX`, found by running the share on an identity
     state; RWKV's log decay and whether it survives, tfm.ops.wkv). A sequence starting inside the share
     (or at its first token: the previous device's last segment id differs) makes M zero;
  2. the maps are composed across devices by a log-depth prefix (Hillis-Steele: ceil(log2 c) rounds of
     `ppermute`, each passing one map, state-sized), and each device is handed the state entering its
     share (`initial_state` on the first);
  3. each device reruns its share from that state: outputs exact, at about twice the scan's work (three
     times the delta rule's, whose map comes from a run with K more value columns).

Nothing sequence-sized crosses devices: the collectives carry maps and states [B, ...] and one
segment id per row. The short convolutions and token shifts that precede the scans read across the
device boundary too (`with_previous`: the previous device's last k - 1 positions by one `ppermute`).
Without a split (no mesh, no `context` rule, or a length c does not divide) both run on the whole
sequence as they are. Gradients are JAX's own through `shard_map` (ppermute transposes to the reverse
ppermute).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tfm.ops.segments import sequence_starts
from tfm.ops.shard import context_size
from tfm.parallel.mesh import CONTEXT

SPLIT, WHOLE = P(None, CONTEXT), P()  # a [B, T, ...] array split along T; one whole on every device


@dataclasses.dataclass(frozen=True)
class Algebra:
    """How a scan's maps h -> apply(transfer, h) + contribution combine: `apply(transfer, state)`,
    `add(state, state)`, `compose(earlier, later)` (the transfer of `earlier` then `later`). States and
    transfers are pytrees of arrays with a leading batch axis."""

    apply: Callable
    add: Callable
    compose: Callable


_plus = lambda a, b: jax.tree.map(jnp.add, a, b)
# h [B, ...] and a decay broadcasting against it, entry by entry (SSD, the selective scan, RG-LRU).
DIAGONAL = Algebra(apply=lambda a, h: a * h, add=_plus, compose=lambda a1, a2: a1 * a2)
# S [B, H, K, V] and A [B, H, K, K]: S -> A S (the delta rule's products of alpha (I - beta k k^T)), in
# float32 on every chip (TPU's default precision would round the maps to bf16; they are state-sized).
_matmul = lambda spec, a, b: jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)
MATRIX = Algebra(apply=lambda a, s: _matmul("bhij,bhjv->bhiv", a, s), add=_plus,
                 compose=lambda a1, a2: _matmul("bhij,bhjk->bhik", a2, a1))


def splits(length: int) -> int:
    """The devices a sequence of `length` tokens is split over: context_size() when it divides
    `length`, else 1 (the activations' rules leave such a sequence whole)."""
    c = context_size()
    return c if c > 1 and length % c == 0 else 1


def _where(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _over_context(fn, split, whole, out_specs):
    """fn(split, whole, index) on each device inside shard_map over `context` alone (the other mesh axes
    stay XLA's): each array of the pytree `split` [B, T, ...] split along T, `whole` passed whole, index
    the device's place along `context` (int32 []: an operand, since XLA's partitioner refuses the
    partition id that `axis_index` reads where other axes stay automatic)."""
    mesh = jax.sharding.get_abstract_mesh()
    index = jnp.arange(mesh.shape[CONTEXT], dtype=jnp.int32)
    return jax.shard_map(lambda split, whole, index: fn(split, whole, index[0]), mesh=mesh,
                         in_specs=(SPLIT, WHOLE, P(CONTEXT)), out_specs=out_specs, axis_names=frozenset({CONTEXT}),
                         check_vma=False)(split, whole, index)


def previous(x, first, index):
    """Inside `_over_context`: the pytree `x` of the device before this one, `first` on the first
    device (index 0; one ppermute per array)."""
    c = jax.lax.axis_size(CONTEXT)
    got = jax.tree.map(lambda a: jax.lax.ppermute(a, CONTEXT, [(i, i + 1) for i in range(c - 1)]), x)
    return _where(index == 0, first, got)


def _entering(algebra: Algebra, transfer, contribution, initial, i):
    """Inside `_over_context` (device i): the state entering this device's share, given each share's map
    (h -> apply(transfer, h) + contribution), by a log-depth inclusive prefix over the devices."""
    c = jax.lax.axis_size(CONTEXT)
    # The first device starts from `initial`: its map is constant, so every prefix from it is too.
    contribution = _where(i == 0, algebra.add(algebra.apply(transfer, initial), contribution), contribution)
    acc, d = (transfer, contribution), 1
    while d < c:  # acc on device i: the composed map of devices max(0, i - 2d + 1) .. i
        t, b = jax.tree.map(lambda a: jax.lax.ppermute(a, CONTEXT, [(j, j + d) for j in range(c - d)]), acc)
        composed = (algebra.compose(t, acc[0]), algebra.add(algebra.apply(acc[0], b), acc[1]))
        acc, d = _where(i >= d, composed, acc), 2 * d
    return previous(acc[1], initial, i)


def _last(x, index):
    """Inside `_over_context`: the last device's pytree `x` on every device (one psum per array)."""
    last = index == jax.lax.axis_size(CONTEXT) - 1
    return jax.tree.map(lambda a: jax.lax.psum(jnp.where(last, a, jnp.zeros_like(a)), CONTEXT), x)


def scan(run: Callable, chunk_map: Callable, algebra: Algebra, sequences, params, segment_ids, initial):
    """A scan over [B, T, ...] `sequences`, split over `context` when the mesh splits T.

    run(sequences, params, real, starts, h) -> (y [B, T', ...], final state): the scan of T' tokens from
    state h, with real / starts [B, T'] bool as tfm.ops.segments reads segment ids (a start at t = 0
    drops h too). chunk_map(sequences, params, real, starts) -> (transfer, contribution): the same
    tokens as a map of the entering state (`algebra`). params: a pytree every device takes whole;
    segment_ids [B, T] or None; initial: the state entering t = 0. Returns run's (y, final state) for the
    whole sequence."""
    B, T = jax.tree.leaves(sequences)[0].shape[:2]
    c = splits(T)
    if c == 1:
        real, starts = (jnp.ones((B, T), bool), jnp.zeros((B, T), bool)) if segment_ids is None \
            else sequence_starts(segment_ids)
        return run(sequences, params, real, starts, initial)

    def per_device(split, whole, index):
        sequences, segment_ids = split
        params, initial = whole
        if segment_ids is None:
            real, starts = jnp.ones((B, T // c), bool), jnp.zeros((B, T // c), bool)
        else:
            real, starts = sequence_starts(segment_ids, previous(segment_ids[:, -1], segment_ids[:, 0], index))
        transfer, contribution = chunk_map(sequences, params, real, starts)
        y, final = run(sequences, params, real, starts, _entering(algebra, transfer, contribution, initial, index))
        return y, _last(final, index)

    return _over_context(per_device, (sequences, segment_ids), (params, initial), (SPLIT, WHOLE))


def with_previous(fn: Callable, width: int, first, sequences, params=()):
    """fn(*extended, *params) -> [B, T, ...]: a causal window over [B, T, ...] `sequences`, each extended
    to [B, width + T, ...] by the `width` positions before it: the arrays of `first` [B, width, ...]
    before t = 0 (zeros, or a decode cache's window), and, where the mesh splits T over `context`, the
    previous device's last `width` positions before every other device's share."""
    T = sequences[0].shape[1]
    extend = lambda before, seqs: [jnp.concatenate([b.astype(s.dtype), s], axis=1) for b, s in zip(before, seqs)]
    c = splits(T)
    if c == 1:
        return fn(*extend(first, sequences), *params)
    if width > T // c:
        raise ValueError(f"a window of {width} earlier tokens needs at least {width} tokens per 'context' device; "
                         f"got {T} tokens over {c} devices: shorten the convolution or split over fewer devices")

    def per_device(sequences, whole, index):
        first, params = whole
        tail = [s[:, s.shape[1] - width:] for s in sequences]
        return fn(*extend(previous(tail, list(first), index), sequences), *params)

    return _over_context(per_device, list(sequences), (list(first), tuple(params)), SPLIT)
