"""Two generated causal recall tasks, as `LMTask` batches {"inputs", "targets", "weights"}: the loss
and the accuracy count only the answers (weights 1 there, 0 everywhere else).

- **Multi-query associative recall** (MQAR; Arora et al. 2023, "Zoology"): a row of `length` + 1
  tokens opens with `pairs` key-value pairs k_1 v_1 ... k_n v_n (keys distinct, from KEYS; values
  distinct, from VALUES), then asks every key once in a random order, each query key followed by
  its value, then PAD to the end. The answers are the query values: a model must look each query
  key up among the pairs. Needs 4 * pairs <= length + 1.
- **Needle asked at the end**: `length` + 1 tokens of uniform FILLER, except a needle pair
  (MARKER, value) whose value lies `distance` tokens before the last input token, where MARKER
  appears again; the answer (the last target) is the needle's value. With inputs = row[:-1] of
  length T: the query MARKER is input T - 1, the needle's value input T - 1 - distance and its
  MARKER the one before, 1 <= distance <= T - 2. A causal layer that sees keys at distance < w moves
  the value to the query in one step iff distance < w; n such layers iff distance <= n (w - 1).

Every row is a pure function of (seed, split, index, its shape); train and test draw from disjoint
random streams, and the two tasks from different ones.
"""
from __future__ import annotations

import dataclasses

import numpy as np

PAD = 0
KEYS = range(1, 65)
VALUES = range(65, 129)     # MQAR's values and the needles' values
MARKER = 129                # the needle's key, asked again at the end
FILLER = range(130, 256)    # the needle task's haystack
VOCAB_SIZE = 256
SPLITS = ("train", "test")
TASKS = ("mqar", "needle")


@dataclasses.dataclass(frozen=True)
class Row:
    tokens: np.ndarray   # int32 [length + 1]: inputs are tokens[:-1], targets tokens[1:]
    weights: np.ndarray  # float32 [length]: 1 where the target is an answer


def _rng(seed: int, split: str, task: str, *shape) -> np.random.Generator:
    if split not in SPLITS:
        raise ValueError(f"split {split!r} unknown; choose from {SPLITS}")
    return np.random.default_rng([seed, SPLITS.index(split), TASKS.index(task), *shape])


def mqar(seed: int, split: str, index: int, length: int, pairs: int) -> Row:
    """MQAR row `index` with `pairs` key-value pairs, every key asked once (the module docstring)."""
    if not 1 <= pairs <= min(len(KEYS), len(VALUES)) or 4 * pairs > length + 1:
        raise ValueError(f"mqar: pairs={pairs} must be in 1 .. {min(len(KEYS), len(VALUES))} with "
                         f"4 * pairs <= length + 1 = {length + 1}")
    rng = _rng(seed, split, "mqar", length, pairs, index)
    keys = rng.choice(np.array(KEYS), pairs, replace=False)
    values = rng.choice(np.array(VALUES), pairs, replace=False)
    asked = rng.permutation(pairs)
    tokens = np.full(length + 1, PAD, np.int32)
    tokens[0:2 * pairs:2], tokens[1:2 * pairs:2] = keys, values
    tokens[2 * pairs:4 * pairs:2], tokens[2 * pairs + 1:4 * pairs:2] = keys[asked], values[asked]
    weights = np.zeros(length, np.float32)
    weights[2 * pairs:4 * pairs:2] = 1.0  # target t is token t + 1: the query values
    return Row(tokens, weights)


def needle(seed: int, split: str, index: int, length: int, distances: range) -> Row:
    """Needle row `index`, its distance drawn uniformly from `distances` (within 1 .. length - 2)."""
    if not distances or distances.start < 1 or distances.stop - 1 > length - 2:
        raise ValueError(f"needle: distances={distances} must be a non-empty range within 1 .. {length - 2} "
                         f"(length={length})")
    rng = _rng(seed, split, "needle", length, distances.start, distances.stop, index)
    tokens = rng.integers(FILLER.start, FILLER.stop, length + 1).astype(np.int32)
    distance, value = int(rng.integers(distances.start, distances.stop)), int(rng.integers(VALUES.start, VALUES.stop))
    at = length - 1 - distance
    tokens[at - 1], tokens[at], tokens[length - 1], tokens[length] = MARKER, value, MARKER, value
    weights = np.zeros(length, np.float32)
    weights[length - 1] = 1.0
    return Row(tokens, weights)


def batch(rows) -> dict:
    """The LMTask batch of `rows`: inputs, targets [B, length] int32, weights [B, length] float32."""
    tokens = np.stack([r.tokens for r in rows])
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": np.stack([r.weights for r in rows])}


def distance_buckets(length: int, layers: int, window: int) -> dict:
    """Needle distances (1 .. length - 2) split where a causal stack of `layers` layers with a sliding
    window of `window` (each query sees keys at distance < window) stops reaching: {"lo-hi": range},
    in order [1, window), [window, layers (window - 1)], beyond; empty buckets left out."""
    reach, end = layers * (window - 1), length - 1
    edges = (range(1, min(window, end)), range(window, min(reach + 1, end)), range(reach + 1, end))
    return {f"{r.start}-{r.stop - 1}": r for r in edges if r}
