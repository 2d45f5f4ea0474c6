"""Segment ids as the linear-time scans read them (tfm.ops.ssd, delta_rule, wkv, linear_scan).

segment_ids [B, T] int, 0 = padding. A padding token is an identity step of every scan (no input, no
decay). A real token whose id differs from the previous token's starts a sequence: the state carried
into it is dropped. t = 0 never starts one (it continues from the scan's initial state, so a prompt
continued from a cache equals the whole prompt). So a packed row computes each sequence as if run
alone, padding on either side changes no state, and a right-padded row ends with its last sequence's
state.
"""
from __future__ import annotations

import jax.numpy as jnp


def sequence_starts(segment_ids):
    """segment_ids [B, T] -> (real [B, T] bool: not padding; starts [B, T] bool: a sequence starts here)."""
    real = segment_ids != 0
    changed = jnp.pad(segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)))
    return real, changed & real
