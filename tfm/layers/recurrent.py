"""What every linear-time token mixer shares: its recurrent state in the decode cache, the short causal
depthwise convolution (with its window of past inputs in the cache) and the gated RMSNorm.

A mixer's cache entries sit beside the attention layers' KV cache and are named the same way: the batch
axis is "cache_batch" (so beam search reorders them as it reorders keys and values), the heads
"cache_heads" (over `tensor` as the layer's heads are). Like the KV cache, the first decode-mode call
creates them (zeros) and leaves them empty; each later call starts from them and writes them back.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.config import ModelConfig
from tfm.layers.common import compute_dtype, constrain, param_init
from tfm.ops.context_scan import with_previous

CONV_WINDOW_AXES = ("cache_batch", None, None)  # [B, K - 1, C]: the last inputs of the convolution
CONV_SEGMENT_AXES = ("cache_batch", None)  # [B, K - 1]: their segment ids


def state_cache(module: nn.Module, name: str, initial, axes: Tuple[Optional[str], ...]):
    """The decode cache's `name` (created as `initial()`, float32 zeros of its shape, boxed with logical `axes`,
    "cache_batch" first), and whether this call created it (then the caller writes nothing back)."""
    creating = not module.has_variable("cache", name)
    var = module.variable("cache", name, param_init(lambda: constrain(initial(), axes), axes))
    return var, creating


def decode_states(module: nn.Module, decode: bool, entries: dict):
    """The recurrent states a mixer starts from: {name: (shape, logical axes[, fill])} -> (a dict of the
    cached values, or None outside decode mode or on the creating call, which makes them float32 filled
    with `fill` (default 0); a function that writes a dict of new values back, doing nothing when there is
    nothing to write)."""
    if not decode:
        return None, lambda new: None
    variables, created = {}, False
    for name, (shape, axes, *fill) in entries.items():
        make = lambda s=shape, f=(fill or [0.0])[0]: jnp.full(s, f, jnp.float32)
        variables[name], creating = state_cache(module, name, make, axes)
        created |= creating
    if created:
        return None, lambda new: None

    def write(new):
        for name, value in new.items():
            variables[name].value = constrain(value.astype(variables[name].value.dtype), entries[name][1])
    return {name: var.value for name, var in variables.items()}, write


class ShortConv(nn.Module):
    """Causal depthwise convolution of `kernel` taps: x [B, T, C] -> act(conv(x) + bias) [B, T, C].

    Output t sums taps over inputs t-kernel+1 .. t of its own sequence only: segment_ids [B, T] (0 =
    padding) hide inputs of another segment, so a packed row equals its sequences run alone. In decode
    mode the cache keeps the last kernel - 1 inputs and their segment ids (`window`, `window_segment_ids`),
    so a continued prompt equals the whole prompt. With the sequence split over `context`, a device's
    window reaches into the previous device's last kernel - 1 inputs. Parameters: `kernel` [kernel, C] (tap kernel-1 reads
    the current input), `bias` [C].
    """

    config: ModelConfig
    kernel: int
    axis: Optional[str] = None  # the logical name of the channels (their weights' sharding)
    use_bias: bool = True
    activation: Optional[Callable] = jax.nn.silu

    @nn.compact
    def __call__(self, x, segment_ids=None, decode: bool = False):
        B, T, C = x.shape
        K = self.kernel
        w = self.param("kernel", param_init(nn.initializers.normal(stddev=K ** -0.5), (None, self.axis)), (K, C),
                       jnp.float32)
        seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        past, write = decode_states(self, decode and K > 1, {
            "window": ((B, K - 1, C), CONV_WINDOW_AXES), "window_segment_ids": ((B, K - 1), CONV_SEGMENT_AXES)})
        if past is None:
            past = {"window": jnp.zeros((B, K - 1, C), x.dtype), "window_segment_ids": jnp.zeros((B, K - 1), jnp.int32)}
        first = (past["window"].astype(x.dtype), past["window_segment_ids"].astype(jnp.int32))
        write({"window": jnp.concatenate([first[0], x], axis=1)[:, T:],
               "window_segment_ids": jnp.concatenate([first[1], seg], axis=1)[:, T:]})

        def taps(xs, segs, w):  # xs [B, K - 1 + T', C] and segs: the inputs with the K - 1 before them
            T = xs.shape[1] - (K - 1)
            y = jnp.zeros((xs.shape[0], T, C), jnp.float32)
            for j in range(K):  # tap j reads the input K-1-j steps back
                same = (segs[:, j:j + T] == segs[:, K - 1:])[..., None]
                y = y + jnp.where(same, xs[:, j:j + T], 0).astype(jnp.float32) * w[j]
            return y

        # under context parallelism each device's window starts on the previous device (tfm.ops.context_scan)
        y = with_previous(taps, K - 1, first, (x, seg), (w,))
        dtype = compute_dtype(self.config)
        if self.use_bias:
            y = y + self.param("bias", param_init(nn.initializers.zeros_init(), (self.axis,)), (C,), jnp.float32)
        y = y.astype(dtype)
        return y if self.activation is None else self.activation(y)


class GatedRmsNorm(nn.Module):
    """RMSNorm over groups of the last axis, gated by activation(z) (silu; KDA's sigmoid): x, z [..., C] ->
    [..., C] in the compute dtype.

    gate_first: normalise x * silu(z) (Mamba-2); else silu(z) * norm(x) (gated DeltaNet). `groups` equal
    runs of C are normalised apart (Mamba-2's norm_groups); `weight` [C] scales the result."""

    config: ModelConfig
    groups: int = 1
    gate_first: bool = True
    axes: Sequence[Optional[str]] = (None,)
    activation: Callable = jax.nn.silu

    @nn.compact
    def __call__(self, x, z):
        cfg = self.config
        C = x.shape[-1]
        x32, gate = x.astype(jnp.float32), self.activation(z.astype(jnp.float32))
        if self.gate_first:
            x32 = x32 * gate
        g = x32.reshape(x32.shape[:-1] + (self.groups, C // self.groups))
        g = g * jax.lax.rsqrt(jnp.mean(g * g, -1, keepdims=True) + cfg.norm_eps)
        y = g.reshape(x32.shape) * self.param("weight", param_init(nn.initializers.ones_init(), tuple(self.axes)),
                                              (C,), jnp.float32)
        if not self.gate_first:
            y = y * gate
        return y.astype(compute_dtype(cfg))
