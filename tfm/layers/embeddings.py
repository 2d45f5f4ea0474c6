"""Token embedding tables: `Embed` (token and token-type ids -> vectors, also the tied
unembedding) and the row lookup that refuses an id outside the table."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfm.layers.common import param_init


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


class Embed(nn.Module):
    """Lookup [B, T] -> [B, T, D]; tied output layers read `embedding` [V, D] (tfm.models.embedding)."""

    num_embeddings: int
    features: int
    dtype: jnp.dtype = jnp.float32
    axes: tuple = ("vocab", "embed")
    stddev: float = 1.0

    def setup(self):
        self.embedding = self.param(
            "embedding", param_init(nn.initializers.normal(self.stddev), self.axes),
            (self.num_embeddings, self.features), jnp.float32)

    def __call__(self, ids):
        return take_rows(self.embedding, ids).astype(self.dtype)  # an id outside [0, V) embeds as NaN
