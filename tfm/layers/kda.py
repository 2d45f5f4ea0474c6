"""Kimi Delta Attention (Kimi Linear, 2025): `KimiDeltaAttention` (kind "kda"), the gated delta rule with a decay
per key channel."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm import capabilities
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init
from tfm.layers.deltanet import STATE_AXES, a_log_init, l2_normalise
from tfm.layers.inputs import BlockInputs
from tfm.layers.recurrent import GatedRmsNorm, ShortConv, decode_states
from tfm.layers.slot import TokenMixer, register_mixer
from tfm.ops.delta_rule import gated_delta_rule


class KimiDeltaAttention(TokenMixer):
    """x [B, T, D] -> [B, T, D] (config.kda). With N = heads of H = head_dim: q, k, v [B, T, N, H] are
    projections of x (`query`, `key`, `value`), each through a short causal convolution and SiLU; q and k are
    L2-normalised and q scaled by H**-0.5. The per-channel log decay g [B, T, N, H] = -exp(A_log) softplus(f +
    dt_bias) with f = `decay_up`(`decay_down` x) (rank H); beta [B, T, N] = sigmoid(`beta` x). The gated delta
    rule's output (tfm.ops.delta_rule, state [N, H, H]) is RMS-normalised per head (`norm`, weight [H]) and times
    sigmoid(`gate_up`(`gate_down` x)), then `out` projects back to D. segment_ids [B, T] (0 = padding) reset the
    state and the convolution windows; in decode mode the cache holds `recurrent_state` [B, N, H, H] and each
    convolution's window."""

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        cfg, m = self.config, self.config.kda
        B, T, D = x.shape
        N, H = m.heads, m.head_dim
        dtype = compute_dtype(cfg)
        proj = lambda name, u, spec, shape, axes: Einsum(spec, shape, axes, dtype=dtype, name=name)(u)
        heads = lambda name: proj(name, x, "BTD,DNH->BTNH", (D, N, H), ("embed", "heads", "head_dim"))
        low_rank = lambda name: proj(f"{name}_up", proj(f"{name}_down", x, "BTD,DR->BTR", (D, H), ("embed", None)),
                                     "BTR,RNH->BTNH", (H, N, H), (None, "heads", "head_dim"))  # [B, T, N, H]
        conv = lambda name, u: ShortConv(cfg, m.conv_kernel, "heads", use_bias=False, name=name)(
            u.reshape(B, T, -1), inputs.segment_ids, decode).reshape(u.shape)
        q, k, v = (conv(f"conv_{n[0]}", heads(n)) for n in ("query", "key", "value"))
        v = constrain(v, ("batch", "length", "heads", "head_dim"))
        q = l2_normalise(q.astype(jnp.float32)) * H ** -0.5
        k = l2_normalise(k.astype(jnp.float32))
        dt_bias = self.param("dt_bias", param_init(nn.initializers.ones_init(), ("heads", "head_dim")), (N, H),
                             jnp.float32)
        a_log = self.param("A_log", param_init(a_log_init, ("heads",)), (N,), jnp.float32)
        g = -jnp.exp(a_log)[:, None] * jax.nn.softplus(low_rank("decay").astype(jnp.float32) + dt_bias)
        beta = jax.nn.sigmoid(proj("beta", x, "BTD,DN->BTN", (D, N), ("embed", "heads")).astype(jnp.float32))
        state, write = decode_states(self, decode, {"recurrent_state": ((B, N, H, H), STATE_AXES)})
        y, final = gated_delta_rule(q, k, v, g, beta, segment_ids=inputs.segment_ids,
                                    initial_state=None if state is None else state["recurrent_state"],
                                    impl=capabilities.mixer_impl(cfg.execution.mixer_impl, T),
                                    chunk_size=cfg.execution.mixer_chunk_size)
        write({"recurrent_state": final})
        y = GatedRmsNorm(cfg, gate_first=False, axes=("head_dim",), activation=jax.nn.sigmoid, name="norm")(
            y, low_rank("gate"))
        return Einsum("BTNH,NHD->BTD", (N, H, D), ("heads", "head_dim", "embed"), dtype=dtype, name="out")(y)


register_mixer("kda", KimiDeltaAttention)
