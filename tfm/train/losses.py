"""Token cross-entropy with label smoothing, padding weights and z-loss.

`cross_entropy` takes logits [..., V] (the reference). `fused_cross_entropy` takes the
hidden states and the output projection instead and computes the same sums one vocabulary
chunk at a time, forward and backward, so the fp32 logits [B, T, V] and their gradient are
never held whole.
"""
from __future__ import annotations

import functools
from typing import Optional

from flax import struct
import jax
import jax.numpy as jnp


@struct.dataclass
class LossTerm:
    """One loss term's weighted sums over a (micro)batch, all fp32 scalars: ce (the loss: cross-
    entropy, or squared error for regression), z (z_loss * sum of logsumexp^2; 0 without one),
    weight (sum of the weights: what the sums are divided by), correct (weighted count of right
    predictions; None where a prediction cannot be right or wrong, e.g. regression)."""

    ce: jnp.ndarray
    z: jnp.ndarray
    weight: jnp.ndarray
    correct: Optional[jnp.ndarray] = None


def _smoothing(vocab: int, label_smoothing: float):
    """(confidence, low, entropy): mass on the target, mass on each other class, and the
    entropy of that smoothed target (subtracted so a perfect prediction scores 0)."""
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1) if vocab > 1 else 0.0
    entropy = confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20)
    return confidence, low, entropy


def _smoothed_ce(target_logit, log_z, total, vocab: int, label_smoothing: float):
    """Per-token smoothed cross-entropy, shifted so a perfect prediction scores 0, from the target's
    logit, log Z and the sum of all logits (total; read only with label smoothing), each [...]."""
    confidence, low, entropy = _smoothing(vocab, label_smoothing)
    target_lp = target_logit - log_z
    ce = -confidence * target_lp
    if label_smoothing:
        ce -= low * (total - vocab * log_z - target_lp)
        ce += entropy
    return ce


def _sums(ce, log_z, correct, weights, z_loss):
    """Per-token ce, log Z, correct [...] -> the `LossTerm` of weighted sums both losses return."""
    return LossTerm(ce=jnp.sum(ce * weights), z=z_loss * jnp.sum(log_z ** 2 * weights),
                    correct=jnp.sum(correct * weights), weight=jnp.sum(weights))


def _weights(targets, weights):
    return jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)


@functools.partial(jax.named_call, name="cross_entropy")  # the scope names its ops in compiled HLO
def cross_entropy(logits, targets, weights=None, *, label_smoothing: float = 0.0,
                  z_loss: float = 0.0):
    """Summed losses over tokens.

    logits [..., V] (any float dtype; computed in fp32), targets int [...], weights [...]
    (0 for padding; default 1). Returns a `LossTerm` of scalars: ce (sum of weighted smoothed
    cross-entropy, shifted so a perfect prediction scores 0), z (sum of z_loss *
    logsumexp^2), correct (weighted count of argmax hits), weight (sum of weights).
    """
    ce, log_z = _token_terms(label_smoothing, logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return _sums(ce, log_z, correct, _weights(targets, weights), z_loss)


def _logit_gradient(logits, log_z, hit, g_ce, g_log_z, vocab: int, label_smoothing: float):
    """d/d logit_v = g_ce · (p_v (conf + (V-1) low) - low - (conf - low) [v = t]) + g_logZ · p_v
    for fp32 logits [..., C] (all of V, or one chunk of it), hit [..., C] = [v = t], and log Z,
    g_ce, g_logZ [...]."""
    confidence, low, _ = _smoothing(vocab, label_smoothing)
    p = jnp.exp(logits - log_z[..., None])
    return (g_ce[..., None] * (p * (confidence + (vocab - 1) * low) - low - (confidence - low) * hit)
            + g_log_z[..., None] * p)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _token_terms(label_smoothing, logits, targets):
    """Per-token (smoothed ce, log Z), each [...], of logits [..., V]. Its gradient is one
    elementwise pass over the logits (softmax minus the smoothed target), in the logits' dtype:
    differentiating the gather of the target logit would scatter into a zeroed fp32 [..., V]."""
    return _token_forward(label_smoothing, logits, targets)[0]


def _token_forward(label_smoothing, logits, targets):
    x = logits.astype(jnp.float32)
    vocab = x.shape[-1]
    log_z = jax.nn.logsumexp(x, axis=-1)                                            # [...]
    target_logit = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    total = jnp.sum(x, axis=-1) if label_smoothing else None
    return (_smoothed_ce(target_logit, log_z, total, vocab, label_smoothing), log_z), (logits, targets, log_z)


def _token_backward(label_smoothing, residuals, cotangents):
    logits, targets, log_z = residuals
    g_ce, g_log_z = cotangents
    vocab = logits.shape[-1]
    hit = (jnp.arange(vocab, dtype=targets.dtype) == targets[..., None]).astype(jnp.float32)
    d_logits = _logit_gradient(logits.astype(jnp.float32), log_z, hit, g_ce, g_log_z, vocab, label_smoothing)
    return d_logits.astype(logits.dtype), None


_token_terms.defvjp(_token_forward, _token_backward)


@functools.partial(jax.named_call, name="cross_entropy")
def fused_cross_entropy(hidden, kernel, targets, weights=None, *, bias=None,
                        dtype=jnp.float32, vocab_chunk: int, label_smoothing: float = 0.0,
                        z_loss: float = 0.0):
    """`cross_entropy(logits, ...)` for logits = fp32(hidden · kernelᵀ computed in `dtype`)
    + bias — how tfm's output layers make them — without holding the logits [B, T, V].

    hidden [B, T, D], kernel [V, D], bias [V] or None, targets int [B, T], weights [B, T]
    (any leading dims in place of B, T). The vocabulary is cut into n = ceil(V / vocab_chunk)
    chunks of C = ceil(V / n) <= vocab_chunk columns, strided (chunk j holds v = c·n + j), so
    a kernel split over devices on V (vocab-parallel) leaves every device a slice of each
    chunk. The forward keeps a running max, sum of exponentials, target logit, sum of logits
    and first argmax per token; the backward recomputes each chunk's logits from log Z. At
    most one chunk of logits [B, T, C] (and its gradient) is live at a time.
    """
    vocab = kernel.shape[0]
    num_chunks = -(-vocab // vocab_chunk)
    ce, log_z, argmax = _fused_token_terms(num_chunks, dtype, label_smoothing,
                                           hidden, kernel, bias, targets)
    correct = (argmax == targets).astype(jnp.float32)
    return _sums(ce, log_z, correct, _weights(targets, weights), z_loss)


def _chunked(x, num_chunks: int):
    """[V, ...] -> [n, C, ...], chunk j = rows c·n + j (zero rows pad V up to C·n)."""
    vocab = x.shape[0]
    size = -(-vocab // num_chunks)
    x = jnp.pad(x, [(0, size * num_chunks - vocab)] + [(0, 0)] * (x.ndim - 1))
    return jnp.swapaxes(x.reshape((size, num_chunks) + x.shape[1:]), 0, 1)


def _unchunked(x, vocab: int):
    """[n, C, ...] -> [V, ...], the inverse of `_chunked`."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((-1,) + x.shape[2:])[:vocab]


def _chunk_inputs(kernel, bias, num_chunks: int):
    """Scan inputs: vocab ids [n, C] (>= V on padding), kernel chunks [n, C, D], bias
    chunks [n, C] or None."""
    size = -(-kernel.shape[0] // num_chunks)
    ids = jnp.arange(size, dtype=jnp.int32)[None, :] * num_chunks + jnp.arange(num_chunks)[:, None]
    return ids, _chunked(kernel, num_chunks), None if bias is None else _chunked(bias, num_chunks)


def _chunk_logits(hidden, kernel, bias, ids, vocab: int, dtype):
    """hidden [B, T, D], kernel chunk [C, D], bias chunk [C] -> fp32 logits [B, T, C],
    -inf on padding."""
    logits = jnp.einsum("...D,CD->...C", hidden.astype(dtype), kernel.astype(dtype))
    logits = logits.astype(jnp.float32)
    if bias is not None:
        logits = logits + bias
    return jnp.where(ids < vocab, logits, -jnp.inf)


def _online_update(carry, logits, ids, targets, vocab: int):
    """Folds one chunk's logits [B, T, C] into the running per-token statistics
    (max, sum of exp(logit - max), target logit, sum of logits, first argmax), each [B, T]."""
    m, s, target_logit, total, argmax = carry
    chunk_max = jnp.max(logits, axis=-1)
    chunk_first = jnp.min(jnp.where(logits == chunk_max[..., None], ids, jnp.iinfo(jnp.int32).max), axis=-1)
    new_m = jnp.maximum(m, chunk_max)
    s = s * jnp.exp(m - new_m) + jnp.sum(jnp.exp(logits - new_m[..., None]), axis=-1)
    argmax = jnp.where(chunk_max > m, chunk_first,
                       jnp.where(chunk_max == m, jnp.minimum(argmax, chunk_first), argmax))
    target_logit += jnp.sum(jnp.where(ids == targets[..., None], logits, 0.0), axis=-1)
    total += jnp.sum(jnp.where(ids < vocab, logits, 0.0), axis=-1)
    return new_m, s, target_logit, total, argmax


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused_token_terms(num_chunks, dtype, label_smoothing, hidden, kernel, bias, targets):
    """Per-token (smoothed ce, log Z, argmax), each [B, T]."""
    return _fused_forward(num_chunks, dtype, label_smoothing, hidden, kernel, bias, targets)[0]


def _fused_forward(num_chunks, dtype, label_smoothing, hidden, kernel, bias, targets):
    """(ce, log Z, argmax), each [B, T], and the residuals the backward needs (log Z, not logits)."""
    vocab = kernel.shape[0]
    ids, kernels, biases = _chunk_inputs(kernel, bias, num_chunks)

    def body(carry, xs):
        chunk_ids, w, b = xs
        logits = _chunk_logits(hidden, w, b, chunk_ids, vocab, dtype)
        return _online_update(carry, logits, chunk_ids, targets, vocab), None

    shape = targets.shape
    init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros(shape), jnp.zeros(shape),
            jnp.zeros(shape, jnp.int32))
    (m, s, target_logit, total, argmax), _ = jax.lax.scan(body, init, (ids, kernels, biases))
    log_z = m + jnp.log(s)
    ce = _smoothed_ce(target_logit, log_z, total, vocab, label_smoothing)
    return (ce, log_z, argmax), (hidden, kernel, bias, targets, log_z)


def _fused_backward(num_chunks, dtype, label_smoothing, residuals, cotangents):
    """`_logit_gradient` one chunk at a time; returns the gradients of hidden, kernel and bias."""
    hidden, kernel, bias, targets, log_z = residuals
    g_ce, g_log_z, _ = cotangents
    vocab = kernel.shape[0]
    ids, kernels, biases = _chunk_inputs(kernel, bias, num_chunks)

    def body(d_hidden, xs):
        chunk_ids, w, b = xs
        logits = _chunk_logits(hidden, w, b, chunk_ids, vocab, dtype)
        hit = (chunk_ids == targets[..., None]).astype(jnp.float32)
        d_logits = _logit_gradient(logits, log_z, hit, g_ce, g_log_z, vocab, label_smoothing)  # [B, T, C]
        d_logits = jnp.where(chunk_ids < vocab, d_logits, 0.0)
        d_cast = d_logits.astype(dtype)
        d_hidden += jnp.einsum("...C,CD->...D", d_cast, w.astype(dtype), preferred_element_type=jnp.float32)
        d_w = jnp.einsum("...C,...D->CD", d_cast, hidden.astype(dtype), preferred_element_type=jnp.float32)
        d_b = None if b is None else jnp.sum(d_logits.reshape(-1, d_logits.shape[-1]), axis=0)
        return d_hidden, (d_w, d_b)

    d_hidden, (d_kernels, d_biases) = jax.lax.scan(
        body, jnp.zeros(hidden.shape, jnp.float32), (ids, kernels, biases))
    d_bias = None if bias is None else _unchunked(d_biases, vocab).astype(bias.dtype)
    return (d_hidden.astype(hidden.dtype), _unchunked(d_kernels, vocab).astype(kernel.dtype), d_bias, None)


_fused_token_terms.defvjp(_fused_forward, _fused_backward)
