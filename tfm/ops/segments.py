"""Segment ids as the linear-time scans read them (tfm.ops.ssd, delta_rule, wkv, linear_scan).

segment_ids [B, T] int, 0 = padding. A padding token is an identity step of every scan (no input, no
decay). A real token whose id differs from the previous token's starts a sequence: the state carried
into it is dropped. t = 0 never starts one (it continues from the scan's initial state, so a prompt
continued from a cache equals the whole prompt; under context parallelism a device's t = 0 reads
the previous device's last id). So a packed row computes each sequence as if run
alone, padding on either side changes no state, and a right-padded row ends with its last sequence's
state.
"""
from __future__ import annotations

import jax.numpy as jnp


def sequence_starts(segment_ids, before=None):
    """segment_ids [B, T] -> (real [B, T] bool: not padding; starts [B, T] bool: a sequence starts here).

    before [B]: the id of the token before t = 0 (the previous device's last, under context parallelism,
    tfm.ops.context_scan), so t = 0 starts a sequence when its id differs, as any token does; None: t = 0
    never starts one."""
    real = segment_ids != 0
    prev = segment_ids[:, :1] if before is None else before[:, None].astype(segment_ids.dtype)
    changed = segment_ids != jnp.concatenate([prev, segment_ids[:, :-1]], axis=1)
    return real, changed & real
