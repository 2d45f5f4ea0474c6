"""Small shared pieces: dtypes, initializers with logical axis names, projections."""
from __future__ import annotations

from typing import Sequence, Tuple

import flax.linen as nn
import jax.numpy as jnp

from tfm.config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def compute_dtype(config: ModelConfig):
    return DTYPES[config.execution.dtype]


def scaled(y, m: float):
    """y times the constant m (in y's dtype); y itself when m is 1, so that an unset multiplier adds no op."""
    return y if m == 1.0 else y * jnp.asarray(m, y.dtype)


def param_init(init, axes: Tuple[str, ...]):
    """An initializer whose parameter carries logical axis names (for the sharding rules)."""
    return nn.with_logical_partitioning(init, axes)


def constrain(x, axes: Tuple[str, ...]):
    """Activation sharding hint by logical names; a no-op outside a mesh with rules."""
    return nn.with_logical_constraint(x, axes)


class Einsum(nn.Module):
    """y = einsum(spec, x, W) (+ b): a projection whose weight has a named shape.

    `shape` and `axes` describe W; `bias_shape`/`bias_axes` the optional bias (the output's
    trailing dims).
    """

    spec: str
    shape: Sequence[int]
    axes: Tuple[str, ...]
    bias_axes: Tuple[str, ...] = ()
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    init_scale: float = 1.0

    @nn.compact
    def __call__(self, x):
        fan_in = self._fan_in()
        init = nn.initializers.normal(stddev=self.init_scale * fan_in ** -0.5)
        w = self.param("kernel", param_init(init, self.axes), tuple(self.shape), jnp.float32)
        y = jnp.einsum(self.spec, x.astype(self.dtype), w.astype(self.dtype))
        if self.use_bias:
            bias_shape = tuple(self.shape[-len(self.bias_axes):])
            b = self.param("bias", param_init(nn.initializers.zeros_init(), self.bias_axes), bias_shape,
                           jnp.float32)
            y = y + b.astype(self.dtype)
        return y

    def _fan_in(self) -> int:
        """Product of the kernel dims contracted against x."""
        x_letters, w_letters = self.spec.split("->")[0].split(",")
        fan_in = 1
        for letter, size in zip(w_letters, self.shape):
            if letter in x_letters:
                fan_in *= size
        return fan_in
