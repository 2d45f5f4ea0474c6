"""Autoregressive decoding on a fixed-shape KV cache: greedy, temperature, top-k, top-p.

Everything here runs inside `jit`: the cache has a fixed length, generation is a
`lax.while_loop`, and a step is `(cache, tokens [B, T]) -> (logits [B, T, V], cache)`.
Prompts in one batch share a length (pad on the left with segment id 0 is not supported).

The cache is a tree of arrays boxed with logical names (`nn.LogicallyPartitioned`:
"cache_batch", "cache_length", "cache_kv_heads", …). Under a mesh — inside `jax.set_mesh`
and `nn.logical_axis_rules` with the trainer's activation rules (`Trainer.context()`) —
every function here runs sharded: the cache is laid out as those names say (batch over the
batch axes, kv heads over `tensor` when it divides them, length whole), and the tokens equal
single-device decoding.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.models import DecoderLM, EncoderDecoder

StepFn = Callable[[dict, jax.Array], Tuple[jax.Array, dict]]


def init_cache(model: nn.Module, params, batch_size: int, cache_len: int, encoded=None,
               inputs_segment_ids=None, **conditioning) -> dict:
    """An empty cache of `cache_len` positions; for EncoderDecoder it also holds the cross-attention
    keys/values projected once from `encoded` [B, S, D], and for a VisionLanguageModel those of the
    images in `conditioning` (images, aspect_ratio_ids, aspect_ratio_mask: the image encoder runs
    once here, and the decoding steps read only the cache)."""
    dummy = jnp.zeros((batch_size, cache_len), jnp.int32)
    if isinstance(model, EncoderDecoder):
        if encoded is None:
            raise ValueError("init_cache for an EncoderDecoder needs the encoder output `encoded`")
        make = lambda params, encoded, segment_ids: model.apply(
            {"params": params}, dummy, encoded, segment_ids, decode=True, mutable=["cache"],
            method=EncoderDecoder.decode)[1]["cache"]
        return jax.jit(make)(params, encoded, inputs_segment_ids)
    # one compiled program: run op by op, a many-layer model's cache set-up took seconds
    make = lambda params, conditioning: model.apply({"params": params}, dummy, decode=True, mutable=["cache"],
                                                    **conditioning)[1]["cache"]
    return jax.jit(make)(params, conditioning)


def step_fn(model: nn.Module, params) -> StepFn:
    """One cached decoding step for either autoregressive family."""
    def step(cache, tokens):
        variables = {"params": params, "cache": cache}
        if isinstance(model, EncoderDecoder):
            out, state = model.apply(variables, tokens, None, decode=True, mutable=["cache"],
                                     method=EncoderDecoder.decode)
        else:
            out, state = model.apply(variables, tokens, decode=True, mutable=["cache"])
        return out.logits, state["cache"]
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
             top_p: Optional[float] = None, eos_id: Optional[int] = None, pad_id: int = 0,
             max_lengths: Optional[jax.Array] = None) -> jax.Array:
    """Extends prompt [B, P] by max_new_tokens -> new tokens [B, max_new_tokens].

    The prompt is run through the cache in one step, then one token per loop iteration; a row
    that produced eos_id, or max_lengths[b] tokens ([B] ints <= max_new_tokens), is padded with
    pad_id afterwards, and the loop stops when all rows have.
    """
    B = prompt.shape[0]
    pick = lambda logits, key: choose(logits, key, greedy=greedy, temperature=temperature, top_k=top_k,
                                      top_p=top_p)
    logits, cache = step(cache, prompt)
    rng, key = jax.random.split(rng)
    first = pick(logits[:, -1], key)
    out = jnp.full((B, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
    done = jnp.zeros((B,), bool) if eos_id is None else first == eos_id
    limit = jnp.full((B,), max_new_tokens) if max_lengths is None else jnp.minimum(max_lengths, max_new_tokens)
    done = done | (limit <= 1)

    def cond(state):
        i, _, _, _, done = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(state):
        i, out, cache, rng, done = state
        logits, cache = step(cache, out[:, i - 1][:, None])
        rng, key = jax.random.split(rng)
        token = jnp.where(done, pad_id, pick(logits[:, -1], key))
        out = out.at[:, i].set(token)
        done = done | (i + 1 >= limit)
        if eos_id is not None:
            done = done | (token == eos_id)
        return i + 1, out, cache, rng, done

    _, out, _, _, _ = jax.lax.while_loop(cond, body, (jnp.asarray(1), out, cache, rng, done))
    return out


def sample_lm(model: DecoderLM, params, prompt, max_new_tokens: int, rng, conditioning: Optional[dict] = None,
              **kwargs) -> jax.Array:
    """DecoderLM (or VisionLanguageModel) continuation of prompt [B, P] (P >= 1) -> [B, max_new_tokens];
    conditioning: the images the continuation sees (`init_cache`); kwargs as in `generate`.
    max_new_tokens=0 returns the empty continuation [B, 0] without running the model."""
    if not hasattr(max_new_tokens, "__index__") or max_new_tokens < 0:
        raise ValueError(f"sample_lm: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if jnp.ndim(prompt) != 2 or jnp.shape(prompt)[1] == 0:
        raise ValueError(f"sample_lm: prompt must be token ids [batch, length >= 1], got shape {jnp.shape(prompt)}")
    if max_new_tokens == 0:
        return jnp.zeros((jnp.shape(prompt)[0], 0), jnp.int32)
    cache = init_cache(model, params, prompt.shape[0], prompt.shape[1] + max_new_tokens, **(conditioning or {}))
    return generate(step_fn(model, params), cache, prompt, max_new_tokens, rng, **kwargs)


def length_penalty(length, alpha: float):
    """GNMT length normalisation ((5 + length) / 6) ** alpha (Wu et al. 2016; alpha 0.6 in Vaswani et al.)."""
    return ((5.0 + length) / 6.0) ** alpha


def _gather_beams(cache, rows):
    """Reorders the B*W cache rows: rows int [B*W] -> cache rows[i] at row i.

    The batch axis of each cached array is the one its logical names call "cache_batch"
    (wherever layer stacking put it); unnamed leaves (the write index) and cross-attention's
    projected memory ("cache_memory_batch": the same for the W beams of an example, as
    `translate` repeats it) are kept as they are.
    """
    def gather(leaf):
        if not isinstance(leaf, nn.LogicallyPartitioned) or "cache_batch" not in leaf.names:
            return leaf
        return leaf.replace_boxed(jnp.take(leaf.value, rows, axis=leaf.names.index("cache_batch"),
                                           mode="clip"))  # rows are in range: clip, not fill-and-select
    return jax.tree.map(gather, cache, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def beam_search(step: StepFn, cache: dict, bos: jax.Array, max_len: int, *, beam_size: int, eos_id: int,
                alpha: float = 0.6, pad_id: int = 0, max_lengths: Optional[jax.Array] = None
                ) -> Tuple[jax.Array, jax.Array]:
    """Beam search from bos [B] on a cache made for B * beam_size rows (row b * W + w is beam w).

    Keeps W alive and W finished hypotheses per example; a hypothesis finishes when it emits eos_id
    or reaches max_lengths[b] tokens ([B] ints <= max_len; default max_len), and is scored by
    log-probability / length_penalty. The loop stops as soon as, for every example, no alive
    hypothesis can still beat its W finished ones (its best possible score, at its length limit,
    is lower): the result equals running all max_len steps. Returns (tokens [B, W, max_len] best
    first, padded with pad_id after eos; scores [B, W]).
    """
    B, W = bos.shape[0], beam_size
    neg = jnp.asarray(-1e9, jnp.float32)
    limit = jnp.full((B,), max_len) if max_lengths is None else jnp.minimum(max_lengths, max_len)
    seqs = jnp.full((B, W, max_len), pad_id, jnp.int32)
    alive_logp = jnp.where(jnp.arange(W) == 0, 0.0, neg)[None].repeat(B, 0)  # one live beam at start
    done_seqs, done_scores = seqs, jnp.full((B, W), neg)
    last = jnp.broadcast_to(bos[:, None], (B, W))

    def cond(state):
        i, _, alive_logp, _, done_scores, _, _ = state
        best_possible = jnp.where(alive_logp[:, 0] > neg / 2, alive_logp[:, 0] / length_penalty(limit, alpha), -jnp.inf)
        return (i < max_len) & ~jnp.all(done_scores[:, -1] >= best_possible)

    def body(state):
        i, seqs, alive_logp, done_seqs, done_scores, last, cache = state
        logits, cache = step(cache, last.reshape(B * W, 1))
        logits = logits[:, -1].astype(jnp.float32).reshape(B, W, -1)  # [B, W, V]
        # The best 2W extensions (enough to keep W alive after eos) are among each beam's 2W
        # likeliest tokens: rank within beams, then merge those W * 2W by total log-probability.
        per_beam = min(2 * W, logits.shape[-1])
        row_logits, row_tokens = jax.lax.top_k(logits, per_beam)  # [B, W, per_beam]
        offset = alive_logp - jax.nn.logsumexp(logits, axis=-1)  # log p = logit - logsumexp
        top_logp, top = jax.lax.top_k((row_logits + offset[..., None]).reshape(B, W * per_beam), 2 * W)
        beam = top // per_beam
        token = jnp.take_along_axis(row_tokens.reshape(B, W * per_beam), top, axis=1)
        cand_seqs = jnp.take_along_axis(seqs, beam[..., None], axis=1).at[:, :, i].set(token)
        ends = (token == eos_id) | (i + 1 >= limit)[:, None]
        # finished: merge the new ending candidates with those kept so far
        new_done = jnp.where(ends, top_logp / length_penalty(i + 1, alpha), neg)
        scores = jnp.concatenate([done_scores, new_done], 1)
        keep_scores, keep = jax.lax.top_k(scores, W)
        done_seqs = jnp.take_along_axis(jnp.concatenate([done_seqs, cand_seqs], 1), keep[..., None], axis=1)
        # alive: the best W candidates that did not end
        alive_scores, pick = jax.lax.top_k(jnp.where(ends, neg, top_logp), W)
        seqs = jnp.take_along_axis(cand_seqs, pick[..., None], axis=1)
        rows = (jnp.arange(B)[:, None] * W + jnp.take_along_axis(beam, pick, axis=1)).reshape(B * W)
        return (i + 1, seqs, alive_scores, done_seqs, keep_scores, jnp.take_along_axis(token, pick, axis=1),
                _gather_beams(cache, rows))

    state = (jnp.asarray(0), seqs, alive_logp, done_seqs, done_scores, last, cache)
    _, seqs, alive_logp, done_seqs, done_scores, _, _ = jax.lax.while_loop(cond, body, state)
    # hypotheses still alive (only at max_len, or when they can no longer win) compete too
    scores = jnp.concatenate([done_scores, alive_logp / length_penalty(limit, alpha)[:, None]], 1)
    best, order = jax.lax.top_k(scores, W)
    tokens = jnp.take_along_axis(jnp.concatenate([done_seqs, seqs], 1), order[..., None], axis=1)
    return tokens, best


def translate(model: EncoderDecoder, params, inputs, max_new_tokens: int, *, bos_id: int, eos_id: int,
              inputs_segment_ids=None, beam_size: int = 1, alpha: float = 0.6, pad_id: int = 0,
              max_lengths: Optional[jax.Array] = None) -> jax.Array:
    """EncoderDecoder output for inputs [B, S] -> best hypothesis [B, max_new_tokens]:
    greedy when beam_size == 1, else beam search with GNMT length penalty alpha; row b stops
    after max_lengths[b] tokens (e.g. its source length + 50, as Vaswani et al.)."""
    B = inputs.shape[0]
    if inputs_segment_ids is None:
        inputs_segment_ids = jnp.ones(inputs.shape, jnp.int32)
    encoded = model.apply({"params": params}, inputs, inputs_segment_ids, method=EncoderDecoder.encode)
    repeat = lambda x: jnp.repeat(x, beam_size, axis=0)  # one cache row per beam
    cache = init_cache(model, params, B * beam_size, max_new_tokens, repeat(encoded), repeat(inputs_segment_ids))
    step = step_fn(model, params)
    if beam_size == 1:
        bos = jnp.full((B, 1), bos_id, jnp.int32)
        return generate(step, cache, bos, max_new_tokens, jax.random.PRNGKey(0), greedy=True, eos_id=eos_id,
                        pad_id=pad_id, max_lengths=max_lengths)
    tokens, _ = beam_search(step, cache, jnp.full((B,), bos_id, jnp.int32), max_new_tokens, beam_size=beam_size,
                            eos_id=eos_id, alpha=alpha, pad_id=pad_id,
                            max_lengths=max_lengths)
    return tokens[:, 0]
