"""Gated DeltaNet (Yang et al. 2024), Qwen3-Next's linear attention: `GatedDeltaNet`."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm import capabilities
from tfm.layers.inputs import BlockInputs
from tfm.layers.slot import TokenMixer, register_mixer
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init
from tfm.layers.recurrent import GatedRmsNorm, ShortConv, decode_states
from tfm.ops.delta_rule import gated_delta_rule

STATE_AXES = ("cache_batch", "cache_heads", None, None)  # [B, Nv, Hk, Hv]
L2_EPS = 1e-6  # q and k are divided by sqrt(|x|^2 + L2_EPS) (the FLA kernels' and HF's form)


def l2_normalise(x):
    """x [..., H] float32 -> x / sqrt(sum(x^2) + L2_EPS) over the last axis."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + L2_EPS)


def a_log_init(key, shape, dtype=jnp.float32):
    """log of decay rates A drawn uniformly from [1, 16] (g = -A * softplus(...))."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


class GatedDeltaNet(TokenMixer):
    """Gated DeltaNet (config.deltanet): x [B, T, D] -> [B, T, D].

    With Nk = key_heads of Hk = key_head_dim and Nv = value_heads of Hv = value_head_dim: q, k
    [B, T, Nk, Hk], v and the gate z [B, T, Nv, Hv], and per value head b and a [B, T, Nv] are
    projections of x. q, k and v pass a short causal convolution and SiLU; q and k are L2-normalised
    and q scaled by Hk**-0.5; each key head serves Nv / Nk consecutive value heads. The gated delta
    rule (tfm.ops.delta_rule) runs with write strength beta = sigmoid(b) and log decay
    g = -exp(A_log) * softplus(a + dt_bias); its output is RMS-normalised per value head (`norm`,
    weight [Hv]) and multiplied by silu(z), then `out` projects back to D. segment_ids [B, T] (0 =
    padding) reset the state and the convolution windows at each sequence; in decode mode the cache
    holds `recurrent_state` [B, Nv, Hk, Hv] and each convolution's window.
    """

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        segment_ids = inputs.segment_ids
        cfg, m = self.config, self.config.deltanet
        B, T, D = x.shape
        Nk, Hk, Nv, Hv = m.key_heads, m.key_head_dim, m.value_heads, m.value_head_dim
        dtype = compute_dtype(cfg)
        proj = lambda spec, name, shape, axes: Einsum(spec, shape, axes, dtype=dtype, name=name)(x)
        q = proj("BTD,DNH->BTNH", "query", (D, Nk, Hk), ("embed", "kv_heads", "head_dim"))
        k = proj("BTD,DNH->BTNH", "key", (D, Nk, Hk), ("embed", "kv_heads", "head_dim"))
        v = proj("BTD,DNH->BTNH", "value", (D, Nv, Hv), ("embed", "heads", "head_dim"))
        z = proj("BTD,DNH->BTNH", "gate", (D, Nv, Hv), ("embed", "heads", "head_dim"))
        b = proj("BTD,DN->BTN", "beta", (D, Nv), ("embed", "heads"))
        a = proj("BTD,DN->BTN", "alpha", (D, Nv), ("embed", "heads"))
        conv = lambda name, u, axis: ShortConv(cfg, m.conv_kernel, axis, use_bias=False, name=name)(
            u.reshape(B, T, -1), segment_ids, decode).reshape(u.shape)
        q, k = conv("conv_q", q, "kv_heads"), conv("conv_k", k, "kv_heads")
        v = constrain(conv("conv_v", v, "heads"), ("batch", "length", "heads", "head_dim"))
        q = l2_normalise(q.astype(jnp.float32)) * Hk ** -0.5
        k = l2_normalise(k.astype(jnp.float32))
        q, k = (jnp.repeat(u, Nv // Nk, axis=2) for u in (q, k))  # [B, T, Nv, Hk]
        dt_bias = self.param("dt_bias", param_init(nn.initializers.ones_init(), ("heads",)), (Nv,), jnp.float32)
        a_log = self.param("A_log", param_init(a_log_init, ("heads",)), (Nv,), jnp.float32)
        g = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)  # [B, T, Nv]
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        state, write = decode_states(self, decode, {"recurrent_state": ((B, Nv, Hk, Hv), STATE_AXES)})
        y, final = gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids,
                                    initial_state=None if state is None else state["recurrent_state"],
                                    impl=capabilities.mixer_impl(cfg.execution.mixer_impl, T),
                                    chunk_size=cfg.execution.mixer_chunk_size)
        write({"recurrent_state": final})
        y = GatedRmsNorm(cfg, gate_first=False, axes=("head_dim",), name="norm")(y, z)  # [B, T, Nv, Hv]
        out = Einsum("BTNH,NHD->BTD", (Nv, Hv, D), ("heads", "head_dim", "embed"), dtype=dtype, name="out")
        return out(y)


register_mixer("gated_deltanet", GatedDeltaNet)
