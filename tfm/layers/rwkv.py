"""RWKV-4's layers (Peng et al. 2023; transformers' RwkvModel): the time mix (`RwkvTimeMix`, mixer kind
"rwkv") and the channel mix (`RwkvChannelMix`, ffn kind "rwkv").

Both start with a token shift: each token is mixed, per channel, with the token before it in its own
sequence (`token_shift`; a sequence's first token with zeros). In decode mode each module's cache holds
the last token it saw (`shift` [B, D], with its segment id), and the time mix also holds its WKV state
(`num`, `den`, `max`, each [B, C]: tfm.ops.wkv's stable form), so a continued prompt equals the whole.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm import capabilities
from tfm.config import ModelConfig
from tfm.layers.inputs import BlockInputs
from tfm.layers.slot import TokenMixer, register_ffn, register_mixer
from tfm.layers.common import Einsum, compute_dtype, param_init
from tfm.layers.recurrent import decode_states
from tfm.ops.context_scan import with_previous
from tfm.ops.wkv import EMPTY_MAX, wkv

SHIFT_AXES = ("cache_batch", None)  # [B, D]: the last token's input
SHIFT_SEGMENT_AXES = ("cache_batch",)  # [B]: its segment id
WKV_STATE_AXES = ("cache_batch", "cache_heads")  # [B, C]: num, den and max of the WKV state


def token_shift(module: nn.Module, x, segment_ids, decode: bool):
    """x [B, T, D] -> the previous token of each token's own sequence [B, T, D]: zeros where the token
    before belongs to another segment (segment_ids [B, T], 0 = padding; None = one sequence). In decode
    mode the first token's predecessor is the cache's `shift` (if its `shift_segment_ids` matches), and
    the call's last token is written back."""
    B, T, D = x.shape
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    past, write = decode_states(module, decode, {"shift": ((B, D), SHIFT_AXES),
                                                 "shift_segment_ids": ((B,), SHIFT_SEGMENT_AXES)})
    if past is None:
        past = {"shift": jnp.zeros((B, D), x.dtype), "shift_segment_ids": jnp.zeros((B,), jnp.int32)}
    write({"shift": x[:, -1], "shift_segment_ids": seg[:, -1]})
    # xs, segs [B, 1 + T', ...]: each token and the one before it (on the previous device for a device's
    # first token, under context parallelism: tfm.ops.context_scan)
    shift = lambda xs, segs: jnp.where((segs[:, :-1] == segs[:, 1:])[..., None], xs[:, :-1], 0)
    first = (past["shift"].astype(x.dtype)[:, None], past["shift_segment_ids"].astype(jnp.int32)[:, None])
    return with_previous(shift, 1, first, (x, seg))


def _ramp(power: float, offset: float = 0.0):
    """An initializer of a [n] vector: offset + (i / n) ** power (RWKV-4's time-mix ramps)."""
    def init(key, shape, dtype=jnp.float32):
        return (offset + (jnp.arange(shape[0], dtype=dtype) / shape[0]) ** power).astype(dtype)
    return init


def _mix(module: nn.Module, name: str, x, prev):
    """x * mu + prev * (1 - mu) with the parameter `name` = mu [D]."""
    mu = module.param(name, param_init(_ramp(0.5), ("embed",)), (x.shape[-1],), jnp.float32).astype(x.dtype)
    return x * mu + prev * (1 - mu)


def _decay_init(key, shape, dtype=jnp.float32):
    """time_decay (log of the decay rate) from -5 to 3 over the channels (RWKV-4's middle-layer curve)."""
    return (-5.0 + 8.0 * jnp.linspace(0.0, 1.0, shape[0], dtype=dtype) ** 1.35).astype(dtype)


def _bonus_init(key, shape, dtype=jnp.float32):
    """time_first: log(0.3) with RWKV-4's zigzag of +-0.5 over the channels."""
    zigzag = 0.5 * ((jnp.arange(shape[0]) + 1) % 3 - 1)
    return (math.log(0.3) + zigzag).astype(dtype)


class RwkvTimeMix(TokenMixer):
    """RWKV-4's time mix (config.rwkv): x [B, T, D] -> [B, T, D].

    With C = attention_width channels: k, v, r [B, T, C] are projections (`key`, `value`, `receptance`,
    no bias) of x token-shifted by `time_mix_key`, `time_mix_value`, `time_mix_receptance` [D]; the WKV
    (tfm.ops.wkv) with decay rate w = exp(`time_decay` [C]) and bonus u = `time_first` [C]; then
    `output` projects sigmoid(r) * wkv back to D. segment_ids [B, T] (0 = padding) reset the token shift
    and the WKV state at each sequence.
    """

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        segment_ids = inputs.segment_ids
        cfg = self.config
        B, T, D = x.shape
        C = cfg.rwkv.attention_width or D
        dtype = compute_dtype(cfg)
        x = x.astype(dtype)
        prev = token_shift(self, x, segment_ids, decode)
        proj = lambda name, h: Einsum("BTD,DC->BTC", (D, C), ("embed", "heads"), dtype=dtype, name=name)(h)
        k = proj("key", _mix(self, "time_mix_key", x, prev))
        v = proj("value", _mix(self, "time_mix_value", x, prev))
        r = proj("receptance", _mix(self, "time_mix_receptance", x, prev))
        decay = self.param("time_decay", param_init(_decay_init, ("heads",)), (C,), jnp.float32)
        bonus = self.param("time_first", param_init(_bonus_init, ("heads",)), (C,), jnp.float32)
        state, write = self._wkv_state(decode, B, C)
        y, final = wkv(jnp.exp(decay), bonus, k, v, segment_ids=segment_ids, initial_state=state,
                       impl=capabilities.mixer_impl(cfg.execution.mixer_impl, T),
                       chunk_size=cfg.execution.mixer_chunk_size)
        write(final)
        out = Einsum("BTC,CD->BTD", (C, D), ("heads", "embed"), dtype=dtype, name="output")
        return out(jax.nn.sigmoid(r) * y.astype(dtype))

    def _wkv_state(self, decode: bool, B: int, C: int):
        """The cached WKV state (num, den, max) [B, C] each, or None outside decode mode or on the creating
        call (where it is made empty: zeros, max EMPTY_MAX); and a function that writes a new one back."""
        names = ("num", "den", "max")
        state, write = decode_states(self, decode, {name: ((B, C), WKV_STATE_AXES, fill)
                                                    for name, fill in zip(names, (0.0, 0.0, EMPTY_MAX))})
        return (None if state is None else tuple(state[name] for name in names),
                lambda new: write(dict(zip(names, new))))


class RwkvChannelMix(nn.Module):
    """RWKV-4's channel mix (its feed-forward): x [B, T, D] -> [B, T, D].

    k = relu(`key`(x'))^2 [B, T, F] with F = config.d_ff, then sigmoid(`receptance`(x'')) * `value`(k),
    where x', x'' are x token-shifted by `time_mix_key`, `time_mix_receptance` [D]; no biases.
    segment_ids [B, T] (0 = padding) reset the token shift at each sequence.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids=None, decode: bool = False):
        cfg = self.config
        D, F = x.shape[-1], cfg.d_ff
        dtype = compute_dtype(cfg)
        x = x.astype(dtype)
        prev = token_shift(self, x, segment_ids, decode)
        k = Einsum("BTD,DF->BTF", (D, F), ("embed", "mlp"), dtype=dtype, name="key")(
            _mix(self, "time_mix_key", x, prev))
        v = Einsum("BTF,FD->BTD", (F, D), ("mlp", "embed"), dtype=dtype, name="value")(jnp.square(jax.nn.relu(k)))
        r = Einsum("BTD,DR->BTR", (D, D), ("embed", None), dtype=dtype, name="receptance")(
            _mix(self, "time_mix_receptance", x, prev))
        return jax.nn.sigmoid(r) * v


register_mixer("rwkv", RwkvTimeMix)
register_ffn("rwkv", RwkvChannelMix)
