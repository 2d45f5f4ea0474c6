"""Optax optimizers and learning-rate schedules from `OptimizerConfig`."""
from __future__ import annotations

import re
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from tfm.train.config import OptimizerConfig


def make_schedule(cfg: OptimizerConfig, num_train_steps: int) -> optax.Schedule:
    """constant | noam (inverse sqrt after linear warmup) | linear | cosine (after warmup) |
    bert_linear (after warmup, peak * (1 - step / decay_steps): the decay counts from step 0)."""
    peak, warmup = cfg.learning_rate, cfg.warmup_steps
    if cfg.schedule == "bert_linear":
        total = cfg.decay_steps or num_train_steps

        def bert_linear(step):
            s = jnp.asarray(step, jnp.float32)
            done = jnp.minimum(s, total) / total
            decayed = peak * ((1.0 - cfg.end_lr_factor) * (1.0 - done) + cfg.end_lr_factor)
            return jnp.where(s < warmup, peak * s / max(warmup, 1), decayed)
        return bert_linear
    if cfg.schedule == "noam":
        # Vaswani et al.: d^-0.5 * min(s^-0.5, s * w^-1.5); without d, scaled to peak at s=w.
        scale = peak * (cfg.noam_d_model ** -0.5 if cfg.noam_d_model else warmup ** 0.5)

        def noam(step):
            s = jnp.maximum(step + 1, 1).astype(jnp.float32)
            return scale * jnp.minimum(s ** -0.5, s * warmup ** -1.5)
        return noam
    if cfg.schedule == "constant":
        main = optax.constant_schedule(peak)
    else:
        decay = max((cfg.decay_steps or num_train_steps) - warmup, 1)
        if cfg.schedule == "linear":
            main = optax.linear_schedule(peak, peak * cfg.end_lr_factor, decay)
        else:
            main = optax.cosine_decay_schedule(peak, decay, alpha=cfg.end_lr_factor)
    if warmup:
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), main], [warmup])
    return main


NO_DECAY = ("bias", "scale")  # parameter names that never decay under decay_mask="kernels"


def _decays(path, p) -> bool:
    """A weight matrix or embedding (ndim >= 2), not a bias or a norm's scale: attention
    biases are [N, H], so the shape alone does not tell (BERT excludes every bias)."""
    name = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
    return jnp.ndim(p) >= 2 and name not in NO_DECAY


def _decay_mask(cfg: OptimizerConfig):
    if cfg.decay_mask == "all":
        return None
    return lambda params: jax.tree_util.tree_map_with_path(_decays, params)


def scale_by_uncorrected_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam's direction without bias correction, m / (sqrt(v) + eps) with m, v the plain
    exponential averages (BERT's AdamWeightDecayOptimizer). State as optax's Adam keeps it."""

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

    def update(grads, state, params=None):
        del params
        mu = jax.tree.map(lambda g, m: b1 * m + (1 - b1) * g, grads, state.mu)
        nu = jax.tree.map(lambda g, v: b2 * v + (1 - b2) * g * g, grads, state.nu)
        direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return direction, optax.ScaleByAdamState(count=state.count + 1, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


BALANCED = "score_bias"  # MoE routers' balancing biases (tfm.layers.feedforward.balance_signal)


def balancing_step(rate: float) -> optax.GradientTransformation:
    """DeepSeek-V3's auxiliary-loss-free balancing: -rate * sign(g), g the expert's excess load."""
    return optax.chain(optax.scale_by_sign(), optax.scale(-rate))


def make_optimizer(cfg: OptimizerConfig, num_train_steps: int, balance_rate: Optional[float] = None):
    """(optax transformation with global-norm clipping, schedule). With balance_rate, parameters
    named BALANCED take `balancing_step(balance_rate)` instead (no clipping, decay or moments);
    parameters cfg.frozen matches are never updated and hold no optimizer state."""
    lr = make_schedule(cfg, num_train_steps)
    if not cfg.bias_correction:
        decay = [optax.add_decayed_weights(cfg.weight_decay, _decay_mask(cfg))] if cfg.name == "adamw" else []
        opt = optax.chain(scale_by_uncorrected_adam(cfg.b1, cfg.b2, cfg.eps), *decay,
                          optax.scale_by_learning_rate(lr))
    elif cfg.name == "adam":
        opt = optax.adam(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)
    elif cfg.name == "adamw":
        opt = optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                          weight_decay=cfg.weight_decay, mask=_decay_mask(cfg))
    elif cfg.name == "lamb":
        opt = optax.lamb(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                         weight_decay=cfg.weight_decay, mask=_decay_mask(cfg))
    elif cfg.name == "adafactor":
        opt = optax.adafactor(lr, weight_decay_rate=cfg.weight_decay or None,
                              weight_decay_mask=_decay_mask(cfg))
    else:
        opt = optax.sgd(lr)
    if cfg.clip_grad_norm:
        opt = optax.chain(optax.clip_by_global_norm(cfg.clip_grad_norm), opt)
    branches = {"learn": opt}
    if balance_rate is not None:
        branches["balance"] = balancing_step(balance_rate)
    if cfg.frozen:
        branches["frozen"] = optax.set_to_zero()
    if len(branches) > 1:
        opt = optax.multi_transform(branches, _labeller(cfg.frozen, balance_rate is not None))
    return opt, lr


def learned_norm(cfg: OptimizerConfig, balance_rate: Optional[float] = None):
    """grads -> the global norm of the gradients `make_optimizer(cfg, balance_rate=...)` learns from, the one its
    clipping sees: without the balancing biases' load signals and the frozen parameters' gradients."""
    if not cfg.frozen and balance_rate is None:
        return optax.tree.norm
    labels = _labeller(cfg.frozen, balance_rate is not None)

    def norm(grads):
        learned = [g for g, label in zip(jax.tree.leaves(grads), jax.tree.leaves(labels(grads))) if label == "learn"]
        return optax.tree.norm(learned)
    return norm


def _key(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def param_path(path) -> str:
    """"text/decoder/layer_0/ffn/wo/kernel" for a jax key path (dict, dataclass or list entries)."""
    return "/".join(map(_key, path))


def _labeller(frozen: Optional[str], balance: bool):
    """params -> the tree of multi_transform labels: "frozen" where `frozen` matches the start of
    the parameter's path, "balance" for BALANCED leaves (with balancing on), else "learn"."""
    pattern = re.compile(frozen) if frozen else None

    def label(path, _):
        if pattern is not None and pattern.match(param_path(path)):
            return "frozen"
        return "balance" if balance and getattr(path[-1], "key", None) == BALANCED else "learn"

    def labels(params):
        tree = jax.tree_util.tree_map_with_path(label, params)
        names = jax.tree.leaves(tree)
        if pattern is not None and names.count("frozen") in (0, len(names)):
            example = param_path(jax.tree_util.tree_flatten_with_path(params)[0][0][0])
            raise ValueError(f"OptimizerConfig.frozen={frozen!r} matches {'no' if 'frozen' not in names else 'every'} "
                             f"parameter; it is matched at the start of paths such as {example!r}")
        return tree
    return labels
