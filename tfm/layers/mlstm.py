"""The mLSTM block's token mixer (xLSTM; xLSTM-7B): `MLstm` (kind "mlstm")."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm import capabilities
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init
from tfm.layers.inputs import BlockInputs
from tfm.layers.recurrent import decode_states
from tfm.layers.slot import TokenMixer, register_mixer
from tfm.ops.mlstm import mlstm

STATE_AXES = {"cell": ("cache_batch", "cache_heads", None, None), "normalizer": ("cache_batch", "cache_heads", None),
              "max": ("cache_batch", "cache_heads")}


class MLstm(TokenMixer):
    """x [B, T, D] -> [B, T, D] (config.mlstm). With N heads, Hk = qk_dim / N and Hv = v_dim / N: q, k [B, T, N, Hk]
    and v [B, T, N, Hv] are projections of x (`query`, `key`, `value`), the input and forget gates' preactivations
    [B, T, N] (`input_gate`, `forget_gate`, with biases) pass the soft cap; the memory (tfm.ops.mlstm) gives
    h [B, T, N, Hv], layer-normalised per head (no bias; `norm`, weight [N Hv]), times sigmoid(`output_gate` x)
    per channel, projected back by `out`. segment_ids [B, T] (0 = padding) start each sequence from zeros; in
    decode mode the cache holds the memory's `cell` [B, N, Hk, Hv], `normalizer` [B, N, Hk] and `max` [B, N]."""

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        cfg, m = self.config, self.config.mlstm
        B, T, D = x.shape
        (QK, VD), N = m.widths(D), m.heads
        Hk, Hv = QK // N, VD // N
        dtype = compute_dtype(cfg)
        proj = lambda name, spec, shape, axes, bias=False: Einsum(spec, shape, axes, axes[-1:] if bias else (),
                                                                  use_bias=bias, dtype=dtype, name=name)(x)
        q = proj("query", "BTD,DNH->BTNH", (D, N, Hk), ("embed", "heads", "head_dim"))
        k = proj("key", "BTD,DNH->BTNH", (D, N, Hk), ("embed", "heads", "head_dim"))
        v = constrain(proj("value", "BTD,DNH->BTNH", (D, N, Hv), ("embed", "heads", "head_dim")),
                      ("batch", "length", "heads", "head_dim"))
        cap = (lambda g: g) if m.gate_soft_cap is None else (lambda g: m.gate_soft_cap * jnp.tanh(g / m.gate_soft_cap))
        i, f = (cap(proj(n, "BTD,DN->BTN", (D, N), ("embed", "heads"), bias=True).astype(jnp.float32))
                for n in ("input_gate", "forget_gate"))
        shapes = {"cell": (B, N, Hk, Hv), "normalizer": (B, N, Hk), "max": (B, N)}
        state, write = decode_states(self, decode, {name: (shape, STATE_AXES[name]) for name, shape in shapes.items()})
        h, final = mlstm(q, k, v, i, f, segment_ids=inputs.segment_ids,
                         initial_state=None if state is None else tuple(state[n] for n in shapes),
                         impl=capabilities.mixer_impl(cfg.execution.mixer_impl, T),
                         chunk_size=cfg.execution.mixer_chunk_size, eps=m.eps)
        write(dict(zip(shapes, final)))
        h = h.astype(jnp.float32)
        h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + cfg.norm_eps)
        weight = self.param("norm", param_init(nn.initializers.ones_init(), ("heads",)), (N * Hv,), jnp.float32)
        gate = jax.nn.sigmoid(proj("output_gate", "BTD,DE->BTE", (D, N * Hv), ("embed", "heads")).astype(jnp.float32))
        y = (gate * h.reshape(B, T, N * Hv) * weight).astype(dtype)
        return Einsum("BTE,ED->BTD", (N * Hv, D), ("heads", "embed"), dtype=dtype, name="out")(y)


register_mixer("mlstm", MLstm)
