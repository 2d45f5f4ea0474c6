"""The Mamba family's token mixers: Mamba-1's selective scan layer (`Mamba`) and Mamba-2's SSD layer (`Mamba2`)."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm import capabilities
from tfm.layers.inputs import BlockInputs
from tfm.layers.slot import TokenMixer, register_mixer
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init, scaled
from tfm.layers.recurrent import GatedRmsNorm, ShortConv, decode_states
from tfm.layers.norms import Norm
from tfm.ops.ssd import selective_scan, ssd

SSM_STATE_AXES = ("cache_batch", "cache_heads", None, None)  # [B, N, P, S]
SELECTIVE_STATE_AXES = ("cache_batch", "cache_heads", None)  # [B, E, S]: the channels shard as "mlp" does


def dt_bias_init(dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4):
    """An initializer for a step-size bias: softplus^-1 of steps log-uniform in [dt_min, dt_max] (Mamba's)."""
    def init(key, shape, dtype=jnp.float32):
        dt = jnp.exp(jax.random.uniform(key, shape) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = jnp.maximum(dt, floor)
        return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)
    return init


def _weightless_rms(x, eps: float):
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32, back in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype)


class Mamba(TokenMixer):
    """Mamba-1 (config.mamba): x [B, T, D] -> [B, T, D].

    With E = expand * D channels: x' and the gate z [B, T, E] are projections of x; x' passes a short
    causal convolution and SiLU; from x' come dt' [B, T, R] (R = dt_rank), B and C [B, T, S]
    (inner_norms: each through config.norm, as Jamba, or with inner_norm_weights=False a weightless
    RMSNorm, as FalconMamba); dt = softplus(dt' W_dt + dt_bias) [B, T, E]; the
    selective scan (tfm.ops.ssd.selective_scan) with A = -exp(A_log) [E, S] gives y, plus the skip
    D * x'; y * silu(z) is projected back to D by `out`. segment_ids [B, T] (0 = padding) reset the
    state and the convolution window at each sequence; in decode mode the cache holds the state
    `ssm_state` [B, E, S] and the convolution's window.
    """

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        segment_ids = inputs.segment_ids
        cfg, m = self.config, self.config.mamba
        Bsz, T, D = x.shape
        E, S = m.expand * D, m.state_size
        R = m.dt_rank or math.ceil(D / 16)
        dtype = compute_dtype(cfg)
        proj = lambda spec, name, v, shape, axes, bias=False: Einsum(spec, shape, axes, axes[1:], use_bias=bias,
                                                                     dtype=dtype, name=name)(v)
        z = proj("BTD,DE->BTE", "gate", x, (D, E), ("embed", "mlp"), m.proj_bias)
        xs = proj("BTD,DE->BTE", "x", x, (D, E), ("embed", "mlp"), m.proj_bias)
        xs = ShortConv(cfg, m.conv_kernel, "mlp", m.conv_bias, name="conv")(xs, segment_ids, decode)
        xs = constrain(xs, ("batch", "length", "mlp"))
        dt = proj("BTE,ER->BTR", "dt_in", xs, (E, R), ("mlp", None))
        b = proj("BTE,ES->BTS", "B", xs, (E, S), ("mlp", None))
        c = proj("BTE,ES->BTS", "C", xs, (E, S), ("mlp", None))
        if m.inner_norms:
            norm_cfg = cfg if m.inner_norm_eps is None else cfg.replace(norm_eps=m.inner_norm_eps)
            if m.inner_norm_weights:
                dt, b, c = (Norm(norm_cfg, axis=None, name=f"{name}_norm")(v)
                            for name, v in (("dt", dt), ("B", b), ("C", c)))
            else:
                dt, b, c = (_weightless_rms(v, norm_cfg.norm_eps) for v in (dt, b, c))
        dt = Einsum("BTR,RE->BTE", (R, E), (None, "mlp"), dtype=dtype, name="dt")(dt)
        dt_bias = self.param("dt_bias", param_init(dt_bias_init(), ("mlp",)), (E,), jnp.float32)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias)
        a_log = self.param("A_log", param_init(
            lambda key, shape, dtype: jnp.broadcast_to(jnp.log(jnp.arange(1, S + 1, dtype=dtype)), shape),
            ("mlp", None)), (E, S), jnp.float32)
        state, write = decode_states(self, decode, {"ssm_state": ((Bsz, E, S), SELECTIVE_STATE_AXES)})
        y, final = selective_scan(xs, dt, -jnp.exp(a_log), b, c, segment_ids=segment_ids,
                                  initial_state=None if state is None else state["ssm_state"],
                                  impl=capabilities.mixer_impl(cfg.execution.mixer_impl, T),
                                  chunk_size=cfg.execution.mixer_chunk_size)
        write({"ssm_state": final})
        skip = self.param("D", param_init(nn.initializers.ones_init(), ("mlp",)), (E,), jnp.float32)
        y = (y.astype(jnp.float32) + skip * xs.astype(jnp.float32)) * jax.nn.silu(z.astype(jnp.float32))
        return proj("BTE,ED->BTD", "out", y.astype(dtype), (E, D), ("mlp", "embed"), m.proj_bias)


class Mamba2(TokenMixer):
    """Mamba-2 (config.mamba2): x [B, T, D] -> [B, T, D].

    With E = mamba2.width(D) channels in N = E / P heads of P = head_dim: z (the gate) and x' [B, T, N, P],
    B and C [B, T, G, S] and dt [B, T, N] are projections of x (each times its proj_multipliers); x', B
    and C pass a short causal convolution and SiLU; dt = clamp(softplus(dt + dt_bias), dt_limit); the
    SSD scan (tfm.ops.ssd) with A = -exp(A_log) gives y, plus the skip D * x'; z gates y as gate_norm
    says (a gated RMSNorm, or silu(z) alone), then `out` projects back to D. segment_ids [B, T]
    (0 = padding) reset the state and the convolution window at each sequence; in decode mode the cache
    holds the state `ssm_state` [B, N, P, S] and each convolution's window.
    """

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        segment_ids = inputs.segment_ids
        cfg, m = self.config, self.config.mamba2
        Bsz, T, D = x.shape
        P, G, S = m.head_dim, m.groups, m.state_size
        E = m.width(D)
        N = E // P
        dtype = compute_dtype(cfg)
        scales = dict(zip(m.PROJECTIONS, m.proj_multipliers))

        def proj(spec, name, shape, axes):
            return scaled(Einsum(spec, shape, axes, axes[1:], use_bias=m.proj_bias, dtype=dtype, name=name)(x),
                          scales[name])
        z = proj("BTD,DNP->BTNP", "gate", (D, N, P), ("embed", "heads", "head_dim"))
        xs = proj("BTD,DNP->BTNP", "x", (D, N, P), ("embed", "heads", "head_dim"))
        b = proj("BTD,DGS->BTGS", "B", (D, G, S), ("embed", None, None))
        c = proj("BTD,DGS->BTGS", "C", (D, G, S), ("embed", None, None))
        dt = proj("BTD,DN->BTN", "dt", (D, N), ("embed", "heads"))
        conv = lambda name, v, axis: ShortConv(cfg, m.conv_kernel, axis, m.conv_bias, name=name)(
            v.reshape(Bsz, T, -1), segment_ids, decode).reshape(v.shape)
        xs = constrain(conv("conv_x", xs, "heads"), ("batch", "length", "heads", "head_dim"))
        b, c = conv("conv_B", b, None), conv("conv_C", c, None)
        dt_bias = self.param("dt_bias", param_init(dt_bias_init(), ("heads",)), (N,), jnp.float32)
        dt = jnp.clip(jax.nn.softplus(dt.astype(jnp.float32) + dt_bias), *m.dt_limit)
        a_log = self.param("A_log", param_init(lambda key, shape, dtype: jnp.log(jnp.arange(1, N + 1, dtype=dtype)),
                                               ("heads",)), (N,), jnp.float32)
        state, write = decode_states(self, decode, {"ssm_state": ((Bsz, N, P, S), SSM_STATE_AXES)})
        y, final = ssd(xs, dt, -jnp.exp(a_log), b, c, segment_ids=segment_ids,
                       initial_state=None if state is None else state["ssm_state"],
                       impl=capabilities.mixer_impl(cfg.execution.mixer_impl, T),
                       chunk_size=cfg.execution.mixer_chunk_size)
        write({"ssm_state": final})
        skip = self.param("D", param_init(nn.initializers.ones_init(), ("heads",)), (N,), jnp.float32)
        y = y.astype(jnp.float32) + skip[:, None] * xs.astype(jnp.float32)  # [B, T, N, P]
        if m.gate_norm == "none":
            y = (y * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
        else:
            norm = GatedRmsNorm(cfg, m.norm_groups or G, gate_first=m.gate_norm == "gate_first", axes=("heads",),
                                name="norm")
            y = norm(y.reshape(Bsz, T, E), z.reshape(Bsz, T, E)).reshape(Bsz, T, N, P)
        out = Einsum("BTNP,NPD->BTD", (N, P, D), ("heads", "head_dim", "embed"), ("embed",), use_bias=m.proj_bias,
                     dtype=dtype, name="out")
        return out(y)


register_mixer("mamba", Mamba)
register_mixer("mamba2", Mamba2)
