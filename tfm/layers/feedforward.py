"""Position-wise feed-forward: dense (plain or gated) and a top-k mixture of experts."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.config import GATED_ACTIVATIONS, ModelConfig
from tfm.layers.common import Einsum, compute_dtype, constrain, param_init, scaled
from tfm.parallel.experts import grouped_experts

_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # squared ReLU (Primer; Nemotron-H)
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


def activation_fn(name: str):
    return _ACTIVATIONS[name]


def hidden_activation(config: ModelConfig, up):
    """act(up("wi")), or gate(up("wi_gate")) * up("wi_up") for SwiGLU/GeGLU (gpt-oss's clamped form for
    swiglu_clamped); `up(name)` projects D -> F."""
    if config.activation == "swiglu_clamped":
        limit = config.swiglu_limit
        gate, lin = jnp.minimum(up("wi_gate"), limit), jnp.clip(up("wi_up"), -limit, limit)
        return gate * jax.nn.sigmoid(config.swiglu_alpha * gate) * (lin + 1)
    if config.activation in GATED_ACTIVATIONS:
        return _ACTIVATIONS[GATED_ACTIVATIONS[config.activation]](up("wi_gate")) * up("wi_up")
    return activation_fn(config.activation)(up("wi"))


class Mlp(nn.Module):
    """[B, T, D] -> [B, T, D]: wo(act(wi x)), or wo(act(wi_gate x) * wi_up x) for SwiGLU/GeGLU (the gate
    projection times config.ffn_multipliers' gate; the Block scales the output)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        cfg = self.config
        D, F = cfg.d_model, cfg.d_ff
        gate_scale = cfg.ffn_multipliers[0]
        kw = dict(use_bias=cfg.ffn_bias, dtype=compute_dtype(cfg))

        def up(name):
            y = Einsum("BTD,DF->BTF", (D, F), ("embed", "mlp"), ("mlp",), name=name, **kw)(x)
            return y if name == "wi_up" else scaled(y, gate_scale)
        h = constrain(hidden_activation(cfg, up), ("batch", "length", "mlp"))  # [B, T, F]
        return Einsum("BTF,FD->BTD", (F, D), ("mlp", "embed"), ("embed",), name="wo", **kw)(h)


def expert_capacity(tokens_per_group: int, config: ModelConfig) -> int:
    """Slots per expert per group (moe_impl="einsum"): ceil(capacity_factor * T * k / E); all T when None."""
    if config.execution.capacity_factor is None:
        return tokens_per_group
    c = math.ceil(config.execution.capacity_factor * tokens_per_group * config.experts_per_token / config.num_experts)
    return max(1, min(c, tokens_per_group))


def top_k_gates(logits, config: ModelConfig, score_bias=None):
    """logits [..., E] (fp32) -> gates [..., k], experts [..., k] (int32), aux_loss.

    Scores are the router's softmax (or, router_score="sigmoid", per-expert sigmoid). The k best
    experts are chosen by score + score_bias [E] (DeepSeek-V3's balancing bias; None = 0), among
    the router_group_top best of router_groups groups when grouped; the gates are their scores
    (bias excluded), renormalised to sum to 1 when k > 1 and router_norm_topk, times router_scale.
    aux_loss is the Switch/Mixtral load-balancing loss E * sum_e fraction_routed_e * mean_score_e.
    """
    E, k = config.num_experts, config.experts_per_token
    scores = router_scores(logits, config)
    choice = scores if score_bias is None else scores + jax.lax.stop_gradient(score_bias)
    if config.router_groups > 1:
        choice = _best_groups_only(choice, config.router_groups, config.router_group_top)
    _, experts = jax.lax.top_k(choice, k)
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if k > 1 and config.router_norm_topk:
        gates = gates / (gates.sum(-1, keepdims=True) + 1e-20)
    gates = gates * config.router_scale
    lead = tuple(range(logits.ndim - 1))
    fraction = jax.nn.one_hot(experts, E, dtype=jnp.float32).mean(axis=lead)  # [k, E]
    aux_loss = E * jnp.sum(fraction * scores.mean(axis=lead)[None, :])
    return gates, experts.astype(jnp.int32), aux_loss


def router_scores(logits, config: ModelConfig):
    """logits [..., E] -> the router's scores [..., E]: softmax, or per-expert sigmoid (router_score)."""
    return jax.nn.softmax(logits, axis=-1) if config.router_score == "softmax" else jax.nn.sigmoid(logits)


def sequence_balance_loss(logits, experts, config: ModelConfig):
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20) without its coefficient: logits [B, T, E]
    (fp32), experts [B, T, k] -> the mean over the B sequences (batch rows, padding and packed documents
    included, as the batch-wise loss counts them) of sum_e f_e P_e, where f_e = E / (k T) * the tokens of
    the sequence that chose e, and P_e = the sequence's mean of the normalised scores s_e / sum_j s_j."""
    E, k, T = config.num_experts, experts.shape[-1], experts.shape[-2]
    scores = router_scores(logits, config)
    normalised = scores / scores.sum(-1, keepdims=True)  # [B, T, E]
    chosen = jax.nn.one_hot(experts, E, dtype=jnp.float32).sum(axis=(-3, -2))  # [B, E] tokens per expert
    fraction = chosen * (E / (k * T))
    return jnp.mean(jnp.sum(fraction * normalised.mean(axis=-2), axis=-1))


def _best_groups_only(choice, groups: int, top: int):
    """choice [..., E] with the experts outside each token's `top` best groups (ranked by the sum of a
    group's two best scores) set to -inf."""
    grouped = choice.reshape(choice.shape[:-1] + (groups, -1))  # [..., groups, E / groups]
    rank = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [..., groups]
    _, best = jax.lax.top_k(rank, top)
    keep = jnp.sum(jax.nn.one_hot(best, groups, dtype=jnp.bool_), axis=-2)  # [..., groups]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


@jax.custom_vjp
def balance_signal(score_bias, load):
    """0.0, whose gradient with respect to score_bias [E] is each expert's excess load over the mean
    (load: tokens per expert [E]): added to the objective, it hands the optimizer the excesses, which
    `tfm.train.optim` turns into DeepSeek-V3's auxiliary-loss-free update score_bias -= rate * sign(excess).
    The excess is (E * load - total) / E, not `load - load.mean()`: XLA may compute the mean with a
    multiplication by 1/E, whose rounding moved an expert at exactly the mean load; the difference of the
    integer-valued counts is exact, and scaling it by 1/E keeps its sign and its zeros."""
    del score_bias, load
    return jnp.zeros((), jnp.float32)


def _balance_signal_fwd(score_bias, load):
    return balance_signal(score_bias, load), (load * load.shape[-1] - load.sum()) / load.shape[-1]


def _balance_signal_bwd(excess, g):
    return excess * g, jnp.zeros_like(excess)


balance_signal.defvjp(_balance_signal_fwd, _balance_signal_bwd)


def route(logits, config: ModelConfig, capacity: int, score_bias=None):
    """Top-k token-choice routing within each group (batch row), as one-hot dispatch (moe_impl="einsum").

    logits [B, T, E] (fp32) -> dispatch [B, T, E, C] (0/1), combine [B, T, E, C] (gate weights),
    aux_loss (see `top_k_gates`). Earlier choices (k = 0 first) take capacity before later ones;
    overflow is dropped.
    """
    gates, experts, aux_loss = top_k_gates(logits, config, score_bias)
    return (*dispatch_slots(gates, experts, config.num_experts, capacity), aux_loss)


def dispatch_slots(gates, experts, num_experts: int, capacity: int):
    """gates, experts [B, T, k] -> dispatch (0/1), combine (gate weights) [B, T, E, C] (see `route`)."""
    E, k = num_experts, experts.shape[-1]
    choice = jax.nn.one_hot(experts, E, dtype=jnp.int32)  # [B, T, k, E]
    B, T = experts.shape[:2]
    priority = jnp.swapaxes(choice, 1, 2).reshape(B, k * T, E)  # k-major order
    slot = (jnp.cumsum(priority, axis=1) - 1).reshape(B, k, T, E).swapaxes(1, 2)  # [B, T, k, E]
    kept = choice * (slot < capacity)
    slot_onehot = jax.nn.one_hot(jnp.where(kept > 0, slot, -1), capacity, dtype=jnp.float32)
    dispatch = jnp.sum(kept[..., None] * slot_onehot, axis=2)  # [B, T, E, C]
    combine = jnp.sum((gates[..., None, None] * kept[..., None]) * slot_onehot, axis=2)
    return dispatch, combine


class MoeMlp(nn.Module):
    """Mixture of gated/plain feed-forward experts: [B, T, D] -> [B, T, D].

    moe_impl="ragged" (default, dropless): the B*T*k (token, choice) pairs are sorted by expert and
    each expert runs on its own contiguous rows (`jax.lax.ragged_dot`, group sizes = tokens per
    expert); memory and FLOPs grow linearly in tokens; under rules that split "expert" over a mesh
    axis, tokens travel to their experts' devices by all-to-all (`tfm.parallel.experts`).
    moe_impl="einsum": one-hot dispatch into [B, E, C, D] expert slots per batch row
    (Switch/GShard capacity_factor; None = C = T, dropless).
    shared_expert_d_ff > 0 adds an always-on Mlp of that width, under a per-token sigmoid gate
    (Qwen2-MoE) or ungated (shared_expert_gate=False: DeepSeek-V3). Routing: `top_k_gates`. Sows the
    load-balancing loss (times router_aux_loss_coef) into `losses/moe_aux_loss`, with
    router_seq_aux_loss_coef > 0 the `sequence_balance_loss` (times it) into `losses/moe_seq_aux_loss`,
    and with router_bias the `balance_signal` of the experts' loads into `losses/router_balance`.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        cfg = self.config
        D, F, E = cfg.d_model, cfg.d_ff, cfg.num_experts
        router = Einsum("BTD,DE->BTE", (D, E), ("embed", None), (None,), use_bias=cfg.router_logit_bias, name="router",
                        dtype=jnp.float32)
        logits = router(x)  # [B, T, E]

        def weight(name, shape, axes):
            init = nn.initializers.normal(stddev=shape[1] ** -0.5)
            return self.param(name, param_init(init, axes), shape, jnp.float32).astype(compute_dtype(cfg))

        up_names = ("wi_gate", "wi_up") if cfg.activation in GATED_ACTIVATIONS else ("wi",)
        weights = {name: weight(name, (E, D, F), ("expert", "embed", "mlp")) for name in up_names}
        weights["wo"] = weight("wo", (E, F, D), ("expert", "mlp", "embed"))
        if cfg.ffn_bias:  # each expert's biases, [E, F] on its up projections and [E, D] on wo (gpt-oss)
            for name in up_names + ("wo",):
                width, axis = (D, "embed") if name == "wo" else (F, "mlp")
                init = param_init(nn.initializers.zeros_init(), ("expert", axis))
                weights[f"{name}_bias"] = self.param(f"{name}_bias", init, (E, width), jnp.float32).astype(
                    compute_dtype(cfg))
        bias = None
        if cfg.router_bias:
            bias = self.param("score_bias", param_init(nn.initializers.zeros_init(), ("expert",)), (E,), jnp.float32)
        gates, experts, aux = top_k_gates(logits, cfg, bias)  # [B, T, k]
        if bias is not None:
            load = jax.nn.one_hot(experts, E, dtype=jnp.float32).sum(axis=(0, 1, 2))  # [E] tokens per expert
            self.sow("losses", "router_balance", balance_signal(bias, load))
        routed = x
        if cfg.router_gate_input:  # the one expert's input times its gate, its output as it is (Llama 4)
            routed, gates = x * gates.astype(x.dtype), jnp.ones_like(gates)
        if cfg.execution.moe_impl == "ragged":
            y = grouped_experts(self._grouped_ffn, routed.astype(compute_dtype(cfg)), gates, experts, weights, E,
                                chunks=cfg.execution.moe_chunks)
        else:
            y = self._einsum(routed, gates, experts, weights)
        self.sow("losses", "moe_aux_loss", cfg.router_aux_loss_coef * aux)
        if cfg.router_seq_aux_loss_coef:
            seq_aux = sequence_balance_loss(logits, experts, cfg)
            self.sow("losses", "moe_seq_aux_loss", cfg.router_seq_aux_loss_coef * seq_aux)
        if cfg.shared_expert_d_ff:
            shared = Mlp(cfg.replace(d_ff=cfg.shared_expert_d_ff), name="shared_expert")(x)  # [B, T, D]
            if cfg.shared_expert_gate:
                gate = Einsum("BTD,D->BT", (D,), ("embed",), name="shared_expert_gate", dtype=compute_dtype(cfg))(x)
                shared = jax.nn.sigmoid(gate)[..., None] * shared
            y = y + shared
        return y

    def _grouped_ffn(self, rows, group_sizes, weights):
        """rows [R, D] sorted by expert -> [R, D]: each expert's feed-forward on its rows (+ its biases, each row's
        expert's as a ragged product of a ones column: no gather by row, and no scatter in the backward)."""
        ones = jnp.ones((rows.shape[0], 1), rows.dtype)
        bias = lambda name: jax.lax.ragged_dot(ones, weights[f"{name}_bias"][:, None], group_sizes)  # [R, out]
        project = lambda x, name: jax.lax.ragged_dot(x, weights[name], group_sizes) + (
            bias(name) if f"{name}_bias" in weights else 0)
        return project(hidden_activation(self.config, lambda name: project(rows, name)), "wo")

    def _einsum(self, x, gates, experts, weights):
        cfg = self.config
        dt = compute_dtype(cfg)
        dispatch, combine = dispatch_slots(gates, experts, cfg.num_experts, expert_capacity(x.shape[1], cfg))
        xe = jnp.einsum("BTEC,BTD->BECD", dispatch.astype(dt), x.astype(dt))  # [B, E, C, D]
        xe = constrain(xe, ("expert_batch", "expert", None, "embed"))
        bias = lambda name: weights[f"{name}_bias"][None, :, None] if f"{name}_bias" in weights else 0
        up = lambda name: jnp.einsum("BECD,EDF->BECF", xe, weights[name]) + bias(name)
        h = hidden_activation(cfg, up)  # [B, E, C, F]
        ye = jnp.einsum("BECF,EFD->BECD", h, weights["wo"]) + bias("wo")
        ye = constrain(ye, ("expert_batch", "expert", None, "embed"))
        return jnp.einsum("BTEC,BECD->BTD", combine.astype(dt), ye)
