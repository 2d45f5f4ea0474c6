"""Position-wise feed-forward: dense (plain or gated) and a top-k mixture of experts."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.config import GATED_ACTIVATIONS, ModelConfig
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init

_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}
_GATE_FN = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=True)}


def activation_fn(name: str):
    return _ACTIVATIONS[name]


def hidden_activation(config: ModelConfig, up):
    """act(up("wi")), or gate(up("wi_gate")) * up("wi_up") for SwiGLU/GeGLU; `up(name)` projects D -> F."""
    if config.activation in GATED_ACTIVATIONS:
        return _GATE_FN[GATED_ACTIVATIONS[config.activation]](up("wi_gate")) * up("wi_up")
    return activation_fn(config.activation)(up("wi"))


class Mlp(nn.Module):
    """[B, T, D] -> [B, T, D]: wo(act(wi x)), or wo(act(wi_gate x) * wi_up x) for SwiGLU/GeGLU."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        cfg = self.config
        D, F = cfg.d_model, cfg.d_ff
        kw = dict(use_bias=cfg.ffn_bias, dtype=compute_dtype(cfg))
        up = lambda name: Einsum("BTD,DF->BTF", (D, F), ("embed", "mlp"), ("mlp",), name=name, **kw)(x)
        h = constrain(hidden_activation(cfg, up), ("batch", "length", "mlp"))  # [B, T, F]
        return Einsum("BTF,FD->BTD", (F, D), ("mlp", "embed"), ("embed",), name="wo", **kw)(h)


def expert_capacity(tokens_per_group: int, config: ModelConfig) -> int:
    """Slots per expert per group: ceil(capacity_factor * T * k / E); all T when dropless."""
    if config.capacity_factor is None:
        return tokens_per_group
    c = math.ceil(config.capacity_factor * tokens_per_group * config.experts_per_token / config.num_experts)
    return max(1, min(c, tokens_per_group))


def route(logits, config: ModelConfig, capacity: int):
    """Top-k token-choice routing within each group (batch row).

    logits [B, T, E] (fp32) -> dispatch [B, T, E, C] (0/1), combine [B, T, E, C] (gate weights),
    aux_loss (Switch/Mixtral load balancing: E * sum_e fraction_routed_e * mean_prob_e).
    Earlier choices (k = 0 first) take capacity before later ones; overflow is dropped.
    """
    E, k = config.num_experts, config.experts_per_token
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = jax.lax.top_k(probs, k)  # [B, T, k]
    if k > 1:
        gates = gates / gates.sum(-1, keepdims=True)
    choice = jax.nn.one_hot(experts, E, dtype=jnp.int32)  # [B, T, k, E]
    aux_loss = E * jnp.sum(choice.mean(axis=(0, 1)) * probs.mean(axis=(0, 1))[None, :])
    B, T = logits.shape[:2]
    priority = jnp.swapaxes(choice, 1, 2).reshape(B, k * T, E)  # k-major order
    slot = (jnp.cumsum(priority, axis=1) - 1).reshape(B, k, T, E).swapaxes(1, 2)  # [B, T, k, E]
    kept = choice * (slot < capacity)
    slot_onehot = jax.nn.one_hot(jnp.where(kept > 0, slot, -1), capacity, dtype=jnp.float32)
    dispatch = jnp.sum(kept[..., None] * slot_onehot, axis=2)  # [B, T, E, C]
    combine = jnp.sum((gates[..., None, None] * kept[..., None]) * slot_onehot, axis=2)
    return dispatch, combine, aux_loss


class MoeMlp(nn.Module):
    """Mixture of gated/plain feed-forward experts: [B, T, D] -> [B, T, D].

    Sows the load-balancing loss (times router_aux_loss_coef) into `losses/moe_aux_loss`.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        cfg = self.config
        D, F, E = cfg.d_model, cfg.d_ff, cfg.num_experts
        dt = compute_dtype(cfg)
        router = Einsum("BTD,DE->BTE", (D, E), ("embed", None), name="router", dtype=jnp.float32)
        dispatch, combine, aux = route(router(x), cfg, expert_capacity(x.shape[1], cfg))
        self.sow("losses", "moe_aux_loss", cfg.router_aux_loss_coef * aux)
        xe = jnp.einsum("BTEC,BTD->BECD", dispatch.astype(dt), x.astype(dt))  # [B, E, C, D]
        xe = constrain(xe, ("expert_batch", "expert", None, "embed"))

        def weight(name, shape, axes):
            init = nn.initializers.normal(stddev=shape[1] ** -0.5)
            return self.param(name, param_init(init, axes), shape, jnp.float32).astype(dt)

        up = lambda name: jnp.einsum("BECD,EDF->BECF", xe, weight(name, (E, D, F), ("expert", "embed", "mlp")))
        h = hidden_activation(cfg, up)  # [B, E, C, F]
        ye = jnp.einsum("BECF,EFD->BECD", h, weight("wo", (E, F, D), ("expert", "mlp", "embed")))
        ye = constrain(ye, ("expert_batch", "expert", None, "embed"))
        return jnp.einsum("BTEC,BECD->BTD", combine.astype(dt), ye)
