"""LFM2's gated short convolution (kind "short_conv"): `GatedShortConv`."""
from __future__ import annotations

import flax.linen as nn

from tfm.layers.common import Einsum, compute_dtype, constrain
from tfm.layers.inputs import BlockInputs
from tfm.layers.recurrent import ShortConv
from tfm.layers.slot import TokenMixer, register_mixer


class GatedShortConv(TokenMixer):
    """x [B, T, D] -> [B, T, D] (config.short_conv): b, c, h = the projections `b`, `c`, `h` of x [B, T, D];
    y = c * conv(b * h), the causal depthwise convolution `conv` of config.short_conv.kernel taps (no
    activation); `out` projects y back. segment_ids [B, T] (0 = padding) keep the convolution within each
    sequence; in decode mode the cache holds its window (recurrent.ShortConv), the mixer's whole state."""

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        cfg, m = self.config, self.config.short_conv
        D = x.shape[-1]
        dtype = compute_dtype(cfg)
        proj = lambda name: Einsum("BTD,DC->BTC", (D, D), ("embed", "mlp"), ("mlp",), use_bias=m.bias, dtype=dtype,
                                   name=name)(x)
        b, c, h = proj("b"), proj("c"), proj("h")
        y = ShortConv(cfg, m.kernel, "mlp", m.bias, activation=None, name="conv")(b * h, inputs.segment_ids, decode)
        y = constrain(c * y, ("batch", "length", "mlp"))
        return Einsum("BTC,CD->BTD", (D, D), ("mlp", "embed"), ("embed",), use_bias=m.bias, dtype=dtype, name="out")(y)


register_mixer("short_conv", GatedShortConv)
