"""Lightning attention (MiniMax-01), decayed linear attention: `LightningAttention` (kind "lightning").

Its scan is Mamba-2's (tfm.ops.ssd) with one group per head, dt = 1, A = -slope, B = k, C = q and x = v: the
state S [N, H, H] decays by exp(-slope) a token and gains v_t k_t^T, and o_t = S_t q_t. The chunked, Pallas and
recurrent forms, segment resets, decode and context parallelism are the SSD scan's.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfm import capabilities
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init
from tfm.layers.inputs import BlockInputs
from tfm.layers.mamba import SSM_STATE_AXES
from tfm.layers.recurrent import decode_states
from tfm.layers.slot import TokenMixer, register_mixer
from tfm.ops.ssd import ssd


def slopes(num_heads: int, layer: int, num_layers: int) -> np.ndarray:
    """MiniMax's decay rates [N]: ALiBi's (2^(-8/N))^(n+1), times 1 - layer / (num_layers - 1) (+1e-5 each)."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** (np.arange(num_heads) + 1) * factor).astype(np.float32)


class LightningAttention(TokenMixer):
    """x [B, T, D] -> [B, T, D] (config.lightning). q, k, v [B, T, N, H] = silu(`query`, `key`, `value` of x);
    the decayed scan above with the fixed rates `slope` [N] (a parameter initialised to `slopes` of the
    layer's index, held by stop_gradient: import reads it, training leaves it); `norm` (RMSNorm [N * H]) of
    the heads' outputs times sigmoid(`gate` x); `out` projects back. segment_ids [B, T] (0 = padding) reset
    the state; in decode mode the cache holds `ssm_state` [B, N, H, H]. In a scanned stack layer_index is
    the place in the pattern's period: import sets each layer's slopes."""

    @nn.compact
    def __call__(self, x, inputs: BlockInputs, deterministic: bool = True, decode: bool = False):
        cfg = self.config
        Bsz, T, D = x.shape
        N, H = cfg.num_heads, cfg.head_dim
        dtype = compute_dtype(cfg)
        heads = lambda name: Einsum("BTD,DNH->BTNH", (D, N, H), ("embed", "heads", "head_dim"), dtype=dtype,
                                    name=name)(x)
        q, k, v = (jax.nn.silu(heads(n).astype(jnp.float32)) for n in ("query", "key", "value"))
        v = constrain(v, ("batch", "length", "heads", "head_dim"))
        init = lambda key, shape, dtype: jnp.asarray(slopes(N, self.layer_index, cfg.num_layers), dtype)
        slope = jax.lax.stop_gradient(self.param("slope", param_init(init, ("heads",)), (N,), jnp.float32))
        state, write = decode_states(self, decode, {"ssm_state": ((Bsz, N, H, H), SSM_STATE_AXES)})
        y, final = ssd(v, jnp.ones((Bsz, T, N), jnp.float32), -slope, k, q, segment_ids=inputs.segment_ids,
                       initial_state=None if state is None else state["ssm_state"],
                       impl=capabilities.mixer_impl(cfg.execution.mixer_impl, T),
                       chunk_size=cfg.execution.mixer_chunk_size)
        write({"ssm_state": final})
        y = y.astype(jnp.float32).reshape(Bsz, T, N * H)
        weight = self.param("norm", param_init(nn.initializers.ones_init(), ("heads",)), (N * H,), jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + cfg.lightning.output_norm_eps) * weight
        gate = Einsum("BTD,DE->BTE", (D, N * H), ("embed", "heads"), dtype=dtype, name="gate")(x)
        y = (jax.nn.sigmoid(gate.astype(jnp.float32)) * y).astype(dtype).reshape(Bsz, T, N, H)
        return Einsum("BTNH,NHD->BTD", (N, H, D), ("heads", "head_dim", "embed"), dtype=dtype, name="out")(y)


register_mixer("lightning", LightningAttention)
