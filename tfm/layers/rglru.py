"""Griffin's recurrent block (De et al. 2024; RecurrentGemma, transformers' RecurrentGemmaRecurrentBlock): the
RG-LRU between a short causal convolution and a GeLU-gated branch (`RecurrentBlock`, mixer kind "rglru")."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm import capabilities
from tfm.layers.inputs import BlockInputs
from tfm.layers.slot import TokenMixer, register_mixer
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init
from tfm.layers.recurrent import ShortConv, decode_states
from tfm.ops.context_scan import with_previous
from tfm.ops.linear_scan import linear_scan

RNN_STATE_AXES = ("cache_batch", "cache_heads", None)  # [B, N, P]: the RG-LRU's state
LAST_SEGMENT_AXES = ("cache_batch",)  # [B]: the segment id of the last token seen (0 = none yet)
SQRT_MAX_GRADIENT = 1000.0  # Griffin clips d sqrt(x) / dx here (the normaliser near a = 1)


@jax.custom_jvp
def _sqrt_clipped_grad(x):
    """sqrt(x), whose derivative is capped at SQRT_MAX_GRADIENT (Griffin's training-stability clip)."""
    return jnp.sqrt(x)


@_sqrt_clipped_grad.defjvp
def _sqrt_clipped_grad_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return jnp.sqrt(x), dx / jnp.sqrt(jnp.maximum(4.0 * x, SQRT_MAX_GRADIENT ** -2))


def recurrent_param_init(a_min: float = 0.9, a_max: float = 0.999):
    """Griffin's init of `a_param`: the base decay sigmoid(-a_param) = a with a^2 uniform in [a_min^2, a_max^2]."""
    def init(key, shape, dtype=jnp.float32):
        a = jnp.sqrt(jax.random.uniform(key, shape, jnp.float32, a_min ** 2, a_max ** 2))
        return jnp.log(jnp.expm1(-jnp.log(a))).astype(dtype)  # softplus^-1(-log a)
    return init


class BlockDiagonal(nn.Module):
    """x [B, T, N, P] -> x[:, :, n] @ kernel[n] + bias[n] [B, T, N, P] in float32: one P x P matrix per head
    (the RG-LRU's gate projections). Parameters: `kernel` [N, P, P], `bias` [N, P]."""

    @nn.compact
    def __call__(self, x):
        N, P = x.shape[-2:]
        kernel = self.param("kernel", param_init(nn.initializers.normal(P ** -0.5), ("heads", None, None)), (N, P, P),
                            jnp.float32)
        bias = self.param("bias", param_init(nn.initializers.zeros_init(), ("heads", None)), (N, P), jnp.float32)
        return jnp.einsum("BTNI,NIJ->BTNJ", x.astype(jnp.float32), kernel) + bias


class RecurrentBlock(TokenMixer):
    """Griffin's recurrent block (config.rglru): x [B, T, D] -> [B, T, D].

    Two projections of x to W = rglru.width channels in N = config.num_heads heads of P = W / N: the gate
    branch gelu_tanh(`gate` x), and the recurrent branch `x` x through a short causal convolution (`conv`,
    kernel rglru.conv_kernel, with bias, no activation) and the RG-LRU:

        i_t = sigmoid(`input_gate` x_t), r_t = sigmoid(`a_gate` x_t)   (block-diagonal over the heads)
        log a_t = -c * r_t * softplus(`a_param`)                       (a_t = sigmoid(-a_param)^(c r_t))
        h_t = a_t * h_{t-1} + sqrt(1 - a_t^2) * (i_t * x_t)

    where a sequence's first token (segment id changing; at t = 0, from the cached last id, 0 before any)
    starts from h = 0 and its input is not normalised (transformers' position-0 rule). `out` projects
    h * gate back to D; every projection has a bias. segment_ids [B, T] (0 = padding) separate packed
    sequences; in decode mode the cache holds `rnn_state` [B, N, P], `last_segment_id` [B] and the
    convolution's window.
    """

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        segment_ids = inputs.segment_ids
        cfg, r = self.config, self.config.rglru
        Bsz, T, D = x.shape
        N = cfg.num_heads
        W = r.width or D
        P = W // N
        dtype = compute_dtype(cfg)
        proj = lambda name: Einsum("BTD,DNP->BTNP", (D, N, P), ("embed", "heads", None), ("heads", None),
                                   use_bias=True, dtype=dtype, name=name)(x)
        gate = jax.nn.gelu(proj("gate"), approximate=True)  # [B, T, N, P]
        conv = ShortConv(cfg, r.conv_kernel, "heads", use_bias=True, activation=None, name="conv")
        xs = conv(proj("x").reshape(Bsz, T, W), segment_ids, decode).reshape(Bsz, T, N, P)
        xs = constrain(xs, ("batch", "length", "heads", None)).astype(jnp.float32)
        input_gate = jax.nn.sigmoid(BlockDiagonal(name="input_gate")(xs))
        a_gate = jax.nn.sigmoid(BlockDiagonal(name="a_gate")(xs))
        a_param = self.param("a_param", param_init(recurrent_param_init(), ("heads", None)), (N, P), jnp.float32)
        log_a = -r.c * a_gate * jax.nn.softplus(a_param)  # [B, T, N, P]

        seg = jnp.ones((Bsz, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        state, write = decode_states(self, decode, {"rnn_state": ((Bsz, N, P), RNN_STATE_AXES),
                                                    "last_segment_id": ((Bsz,), LAST_SEGMENT_AXES)})
        before = (jnp.zeros((Bsz, 1), jnp.int32) if state is None
                  else state["last_segment_id"][:, None].astype(jnp.int32))
        # [B, T, 1, 1]: the token's id differs from the one before (on the previous device for a device's first
        # token, under context parallelism: tfm.ops.context_scan)
        first = with_previous(lambda s: s[:, 1:] != s[:, :-1], 1, (before,), (seg,))[:, :, None, None]
        norm = jnp.where(first, 1.0, _sqrt_clipped_grad(-jnp.expm1(2.0 * log_a)))
        h0 = None if state is None else jnp.where(first[:, 0], 0.0, state["rnn_state"])
        h, final = linear_scan(jnp.exp(log_a), xs * input_gate * norm, segment_ids=segment_ids, initial_state=h0,
                               impl=capabilities.mixer_impl(cfg.execution.mixer_impl, T),
                               chunk_size=cfg.execution.mixer_chunk_size)
        write({"rnn_state": final, "last_segment_id": seg[:, -1]})
        y = constrain(h.astype(dtype) * gate, ("batch", "length", "heads", None))
        return Einsum("BTNP,NPD->BTD", (N, P, D), ("heads", None, "embed"), ("embed",), use_bias=True, dtype=dtype,
                      name="out")(y)


register_mixer("rglru", RecurrentBlock)
