"""Generated long documents with one needle: the label is which needle, wherever it lies.

A document is `length` tokens: CLS at position 0, then filler tokens drawn uniformly from
FILLER, except for exactly one needle token (NEEDLES[label]) at a position drawn uniformly from
1 .. length - 1. The classifier reads the CLS state, so it must carry the needle's identity from
anywhere in the document to position 0. Everything is a pure function of (seed, split, index).

Why the attention variants differ here: in a bidirectional encoder whose every layer sees only
keys at distance < w (a sliding window), the CLS state after n layers depends on positions
0 .. reach(n, w) = n (w - 1) alone, so a needle beyond that cannot change the prediction: such a
model is at chance (1/2) on those documents. Patterns with a global CLS row (Longformer, BigBird)
or a length projection (Linformer) can reach every position in one layer.
"""
from __future__ import annotations

import dataclasses

import numpy as np

PAD, CLS = 0, 1
NEEDLES = (2, 3)              # label 0, label 1
FILLER = range(4, 64)         # every other token
VOCAB_SIZE = 64
SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Document:
    tokens: np.ndarray  # int32 [length]
    label: int          # 0 or 1: which of NEEDLES the document holds
    needle: int         # its position, 1 .. length - 1


def make(seed: int, split: str, index: int, length: int) -> Document:
    """Document `index` of `split` (train and test draw from disjoint random streams)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} unknown; choose from {SPLITS}")
    if length < 2:
        raise ValueError(f"a document needs length >= 2 (CLS and a needle), got {length}")
    rng = np.random.default_rng([seed, SPLITS.index(split), index])
    tokens = rng.integers(FILLER.start, FILLER.stop, length).astype(np.int32)
    label, needle = int(rng.integers(2)), int(rng.integers(1, length))
    tokens[0], tokens[needle] = CLS, NEEDLES[label]
    return Document(tokens, label, needle)


def batch(seed: int, split: str, indices, length: int) -> dict:
    """The ClassificationTask batch of documents `indices`: input_ids [B, length], label [B]."""
    docs = [make(seed, split, int(i), length) for i in indices]
    return {"input_ids": np.stack([d.tokens for d in docs]), "label": np.array([d.label for d in docs], np.int32)}


def reach(num_layers: int, window: int) -> int:
    """The last position whose token can reach position 0 through num_layers layers that each see
    keys at distance < window: n (w - 1)."""
    return num_layers * (window - 1)
