"""Autoregressive decoding on a fixed-shape KV cache: greedy, temperature, top-k, top-p.

Everything here runs inside `jit`: the cache has a fixed length, generation is a
`lax.while_loop`, and a step is `(cache, tokens [B, T]) -> (logits [B, T, V], cache)`.
Prompts in one batch share a length (pad on the left with segment id 0 is not supported).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.models import DecoderLM, EncoderDecoder

StepFn = Callable[[dict, jax.Array], Tuple[jax.Array, dict]]


def init_cache(model: nn.Module, params, batch_size: int, cache_len: int, encoded=None,
               inputs_segment_ids=None) -> dict:
    """An empty cache of `cache_len` positions; for EncoderDecoder it also holds the cross-attention
    keys/values projected once from `encoded` [B, S, D]."""
    dummy = jnp.zeros((batch_size, cache_len), jnp.int32)
    if isinstance(model, EncoderDecoder):
        if encoded is None:
            raise ValueError("init_cache for an EncoderDecoder needs the encoder output `encoded`")
        _, state = model.apply({"params": params}, dummy, encoded, inputs_segment_ids, decode=True,
                               mutable=["cache"], method=EncoderDecoder.decode)
    else:
        _, state = model.apply({"params": params}, dummy, decode=True, mutable=["cache"])
    return state["cache"]


def step_fn(model: nn.Module, params) -> StepFn:
    """One cached decoding step for either autoregressive family."""
    def step(cache, tokens):
        variables = {"params": params, "cache": cache}
        if isinstance(model, EncoderDecoder):
            logits, state = model.apply(variables, tokens, None, decode=True, mutable=["cache"],
                                        method=EncoderDecoder.decode)
        else:
            logits, state = model.apply(variables, tokens, decode=True, mutable=["cache"])
        return logits, state["cache"]
    return step


def filter_logits(logits, *, temperature: float = 1.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None):
    """logits [B, V] -> scaled logits with tokens outside top-k / the top-p nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature} (use greedy=True for argmax)")
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly better tokens
        cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def choose(logits, rng, *, greedy: bool, temperature: float, top_k, top_p):
    """Next token [B] from logits [B, V]."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)


def generate(step: StepFn, cache: dict, prompt: jax.Array, max_new_tokens: int, rng: jax.Array, *,
             greedy: bool = False, temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_id: Optional[int] = None, pad_id: int = 0) -> jax.Array:
    """Extends prompt [B, P] by max_new_tokens -> new tokens [B, max_new_tokens].

    The prompt is run through the cache in one step, then one token per loop iteration; a row
    that produced eos_id is padded with pad_id afterwards, and the loop stops when all rows have.
    """
    B = prompt.shape[0]
    pick = lambda logits, key: choose(logits, key, greedy=greedy, temperature=temperature, top_k=top_k,
                                      top_p=top_p)
    logits, cache = step(cache, prompt)
    rng, key = jax.random.split(rng)
    first = pick(logits[:, -1], key)
    out = jnp.full((B, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    done = jnp.zeros((B,), bool) if eos_id is None else first == eos_id

    def cond(state):
        i, _, _, _, done = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(state):
        i, out, cache, rng, done = state
        logits, cache = step(cache, out[:, i - 1][:, None])
        rng, key = jax.random.split(rng)
        token = jnp.where(done, pad_id, pick(logits[:, -1], key))
        out = out.at[:, i].set(token)
        if eos_id is not None:
            done = done | (token == eos_id)
        return i + 1, out, cache, rng, done

    _, out, _, _, _ = jax.lax.while_loop(cond, body, (jnp.asarray(1), out, cache, rng, done))
    return out


def sample_lm(model: DecoderLM, params, prompt, max_new_tokens: int, rng, **kwargs) -> jax.Array:
    """DecoderLM continuation of prompt [B, P] -> [B, max_new_tokens]; kwargs as in `generate`."""
    cache = init_cache(model, params, prompt.shape[0], prompt.shape[1] + max_new_tokens)
    return generate(step_fn(model, params), cache, prompt, max_new_tokens, rng, **kwargs)


def translate_greedy(model: EncoderDecoder, params, inputs, max_new_tokens: int, *, bos_id: int, eos_id: int,
                     inputs_segment_ids=None, pad_id: int = 0) -> jax.Array:
    """Greedy EncoderDecoder output for inputs [B, S] -> [B, max_new_tokens]."""
    encoded = model.apply({"params": params}, inputs, inputs_segment_ids, method=EncoderDecoder.encode)
    cache = init_cache(model, params, inputs.shape[0], max_new_tokens, encoded, inputs_segment_ids)
    bos = jnp.full((inputs.shape[0], 1), bos_id, jnp.int32)
    return generate(step_fn(model, params), cache, bos, max_new_tokens, jax.random.PRNGKey(0), greedy=True,
                    eos_id=eos_id, pad_id=pad_id)
