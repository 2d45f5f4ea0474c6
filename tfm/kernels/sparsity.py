"""Sparse attention patterns: who may see whom, described by a few integers, never by an L x L mask.

A pattern is one more term of the mask vocabulary of `tfm.ops.attention` (`sparsity=`): it is
ANDed with causal, window and segment ids. Each pattern answers two questions:

  visible(rows, cols, T, S)   bool, broadcasting int query/key positions: the token-level mask (the
                              xla and chunked backends apply it; the kernels apply `in_tile`).
  tiles(bq, bk, nq, nk, T, S) bool numpy [nq, nk]: which (bq x bk) tiles hold a visible pair; the
                              flash kernels visit those tiles only.

Patterns (positions are absolute, query i and key j):
  Strided(stride)          Sparse Transformer (Child et al. 2019) strided: |i - j| < stride, or
                           stride divides i - j.
  Fixed(stride, summary)   Sparse Transformer fixed: i and j in the same stride-long block, or j
                           among the last `summary` positions of its block.
  BigBird(block, window, globals, random, seed)  Zaheer et al. 2020, on blocks of `block` tokens:
                           query block a sees key block b when |a - b| <= window, when a or b is one
                           of the first `globals` blocks, or b is one of `random` blocks drawn for a
                           (numpy's default_rng(seed), one table shared by every layer, head and
                           batch row). The kernels need tiles dividing `block`.
  Longformer(window, globals)  Beltagy et al. 2020: |i - j| < window, or i or j among the first
                           `globals` tokens of the row (global rows attend everywhere, every row to
                           global columns; packed segments each get none of their own). HF's
                           attention_window w is window = w // 2 + 1.
With causal=True the paper's autoregressive forms follow (the pattern ANDed with j <= i).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax.numpy as jnp
import numpy as np
from jax import lax


def _spans(n: int, size: int):
    """First and last position [n, 1] of each of n tiles of `size`."""
    first = np.arange(n)[:, None] * size
    return first, first + size - 1


def _positive(owner: str, **values):
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}.{name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Strided:
    """Sparse Transformer's strided pattern: |i - j| < stride or (i - j) % stride == 0."""
    stride: int

    def __post_init__(self):
        _positive("Strided", stride=self.stride)

    def visible(self, rows, cols, T=None, S=None):
        d = rows - cols
        return (abs(d) < self.stride) | (lax.rem(d, self.stride) == 0)

    in_tile = visible

    def tiles(self, bq, bk, nq, nk, T, S):
        q_first, q_last = _spans(nq, bq)
        k_first, k_last = _spans(nk, bk)
        lo, hi = (q_first - k_last.T), (q_last - k_first.T)  # every i - j of a tile: [lo, hi]
        local = (hi > -self.stride) & (lo < self.stride)
        return local | (np.floor_divide(hi, self.stride) * self.stride >= lo)


@dataclasses.dataclass(frozen=True)
class Fixed:
    """Sparse Transformer's fixed pattern: i // stride == j // stride or j % stride >= stride - summary."""
    stride: int
    summary: int = 1

    def __post_init__(self):
        _positive("Fixed", stride=self.stride, summary=self.summary)
        if self.summary > self.stride:
            raise ValueError(f"Fixed.summary={self.summary} must be at most stride={self.stride}")

    def visible(self, rows, cols, T=None, S=None):
        same_block = lax.div(rows, self.stride) == lax.div(cols, self.stride)
        return same_block | (lax.rem(cols, self.stride) >= self.stride - self.summary)

    in_tile = visible

    def tiles(self, bq, bk, nq, nk, T, S):
        q_first, q_last = _spans(nq, bq)
        k_first, k_last = _spans(nk, bk)
        l = self.stride
        same_block = np.maximum(q_first // l, (k_first // l).T) <= np.minimum(q_last // l, (k_last // l).T)
        # A key tile holds a summary column iff its last one is, or the one before its last block's start is.
        summary = (k_last % l >= l - self.summary) | ((k_last // l) * l - 1 >= k_first)
        return same_block | summary.T


@dataclasses.dataclass(frozen=True)
class BigBird:
    """BigBird's block pattern: window, global and random blocks of `block` tokens."""
    block: int
    window: int = 1
    globals: int = 1
    random: int = 1
    seed: int = 0

    def __post_init__(self):
        _positive("BigBird", block=self.block)
        for name in ("window", "globals", "random", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"BigBird.{name} must be an int >= 0, got {value!r}")

    @functools.lru_cache(maxsize=32)
    def table(self, q_blocks: int, kv_blocks: int) -> np.ndarray:
        """bool [q_blocks, kv_blocks]: may query block a see key block b. Each non-global query block
        draws `random` key blocks (fewer if fewer are left) among those its window and the globals miss."""
        a, b = np.arange(q_blocks)[:, None], np.arange(kv_blocks)[None, :]
        seen = (np.abs(a - b) <= self.window) | (a < self.globals) | (b < self.globals)
        rng = np.random.default_rng(self.seed)
        for row in range(self.globals, q_blocks):
            unseen = np.flatnonzero(~seen[row])
            seen[row, rng.choice(unseen, min(self.random, unseen.size), replace=False)] = True
        seen.setflags(write=False)
        return seen

    def visible(self, rows, cols, T, S):
        table = self.table(-(-T // self.block), -(-S // self.block))
        return jnp.asarray(table)[rows // self.block, cols // self.block]

    def in_tile(self, rows, cols):
        return None  # the kernels' tiles divide the block: a visited tile is visible throughout

    def check_tiles(self, bq: int, bk: int):
        if self.block % bq or self.block % bk:
            raise ValueError(f"BigBird(block={self.block}) needs kernel tiles that divide it; got block_q={bq}, "
                             f"block_kv={bk} (set BlockSizes)")

    def tiles(self, bq, bk, nq, nk, T, S):
        table = self.table(-(-T // self.block), -(-S // self.block))
        q_block = np.minimum(np.arange(nq) * bq // self.block, table.shape[0] - 1)
        k_block = np.minimum(np.arange(nk) * bk // self.block, table.shape[1] - 1)
        return table[q_block[:, None], k_block[None, :]]


@dataclasses.dataclass(frozen=True)
class Longformer:
    """Longformer: a sliding window |i - j| < window plus the first `globals` tokens as global tokens."""
    window: int
    globals: int = 1

    def __post_init__(self):
        _positive("Longformer", window=self.window)
        if not isinstance(self.globals, int) or self.globals < 0:
            raise ValueError(f"Longformer.globals must be an int >= 0, got {self.globals!r}")

    def visible(self, rows, cols, T=None, S=None):
        return (abs(rows - cols) < self.window) | (rows < self.globals) | (cols < self.globals)

    in_tile = visible

    def tiles(self, bq, bk, nq, nk, T, S):
        q_first, q_last = _spans(nq, bq)
        k_first, k_last = _spans(nk, bk)
        local = (q_last - k_first.T > -self.window) & (q_first - k_last.T < self.window)
        return local | (q_first < self.globals) | (k_first < self.globals).T


Pattern = Union[Strided, Fixed, BigBird, Longformer]
PATTERNS = {"strided": Strided, "fixed": Fixed, "bigbird": BigBird, "longformer": Longformer}


def coerce(value) -> Optional[Pattern]:
    """A pattern, or None, from a pattern or a dict {"kind": name, **fields} (experiment configs)."""
    if value is None or isinstance(value, tuple(PATTERNS.values())):
        return value
    if isinstance(value, dict) and value.get("kind") in PATTERNS:
        fields = {k: v for k, v in value.items() if k != "kind"}
        try:
            return PATTERNS[value["kind"]](**fields)
        except TypeError as e:
            raise ValueError(f"sparsity {value!r}: {e}") from None
    raise ValueError(f"sparsity must be one of {sorted(PATTERNS)} (a pattern or a dict with 'kind'), got {value!r}")
