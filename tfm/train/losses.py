"""Token cross-entropy with label smoothing, padding weights and z-loss."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits, targets, weights=None, *, label_smoothing: float = 0.0,
                  z_loss: float = 0.0):
    """Summed losses over tokens.

    logits [..., V] (any float dtype; computed in fp32), targets int [...], weights [...]
    (0 for padding; default 1). Returns dict of scalars: "ce" (sum of weighted smoothed
    cross-entropy, shifted so a perfect prediction scores 0), "z" (sum of z_loss *
    logsumexp^2), "correct" (weighted count of argmax hits), "weight" (sum of weights).
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    weights = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)                        # [...]
    log_p = logits - log_z[..., None]                                 # [..., V]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1) if vocab > 1 else 0.0
    target_lp = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
    ce = -confidence * target_lp
    if label_smoothing:
        ce -= low * (jnp.sum(log_p, axis=-1) - target_lp)
        # Entropy of the smoothed target: subtracted so the minimum loss is 0.
        ce += confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {"ce": jnp.sum(ce * weights), "z": z_loss * jnp.sum(log_z ** 2 * weights),
            "correct": jnp.sum(correct * weights), "weight": jnp.sum(weights)}
