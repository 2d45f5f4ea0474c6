"""Sampling filters on hand-built distributions, and beam search against brute-force enumeration."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm import decode


def markov_step(table):
    """A step function whose next-token log-probs depend only on the last token: table [V, V]."""
    def step(cache, tokens):
        return jnp.log(table)[tokens[:, -1]][:, None], {"index": cache["index"] + 1}
    return step


def test_top_p_keeps_the_nucleus_and_top_k_the_k_best():
    probs = jnp.array([[0.5, 0.3, 0.1, 0.06, 0.04]])
    logits = jnp.log(probs)
    kept = lambda x: np.isfinite(np.asarray(x))[0].tolist()
    assert kept(decode.filter_logits(logits, top_p=0.75)) == [True, True, False, False, False]
    assert kept(decode.filter_logits(logits, top_p=0.85)) == [True, True, True, False, False]
    assert kept(decode.filter_logits(logits, top_k=2)) == [True, True, False, False, False]
    draws = jax.vmap(lambda k: decode.choose(logits, k, greedy=False, temperature=1.0, top_k=None, top_p=0.75))(
        jax.random.split(jax.random.PRNGKey(0), 2000))
    freq = np.bincount(np.asarray(draws).ravel(), minlength=5) / 2000
    assert freq[2:].sum() == 0.0
    assert abs(freq[0] - 0.5 / 0.8) < 0.03  # renormalised inside the nucleus


def test_top_k_one_equals_greedy_and_temperature_sharpens():
    logits = jax.random.normal(jax.random.PRNGKey(1), (16, 50))
    keys = jax.random.split(jax.random.PRNGKey(2), 5)
    greedy = decode.choose(logits, keys[0], greedy=True, temperature=1.0, top_k=None, top_p=None)
    for key in keys:
        np.testing.assert_array_equal(
            decode.choose(logits, key, greedy=False, temperature=1.0, top_k=1, top_p=None), greedy)
    cold = decode.choose(logits, keys[1], greedy=False, temperature=1e-3, top_k=None, top_p=None)
    np.testing.assert_array_equal(cold, greedy)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        decode.filter_logits(logits, temperature=0.0)


def test_beam_search_finds_the_best_sequence_by_brute_force():
    V, L, eos, alpha = 4, 4, 3, 0.6
    table = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(3), (V, V)) * 2.0, axis=-1)
    logp = np.log(np.asarray(table))
    best, best_score = None, -np.inf
    for seq in itertools.product(range(V), repeat=L):  # every sequence, cut at its first eos
        end = seq.index(eos) + 1 if eos in seq else L
        seq = seq[:end]
        prev, total = 0, 0.0
        for t in seq:
            total, prev = total + logp[prev, t], t
        score = total / decode.length_penalty(len(seq), alpha)
        if score > best_score + 1e-9:
            best, best_score = seq, score
    tokens, scores = decode.beam_search(markov_step(table), {"index": jnp.zeros(())}, jnp.zeros((1,), jnp.int32),
                                        L, beam_size=V ** 2, eos_id=eos, alpha=alpha)
    got = list(np.asarray(tokens[0, 0, :len(best)]))
    assert got == list(best)
    assert abs(float(scores[0, 0]) - best_score) < 1e-5


def test_beam_one_equals_greedy_on_a_markov_chain():
    table = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(4), (6, 6)) * 3.0, axis=-1)
    step = markov_step(table)
    cache = {"index": jnp.zeros(())}
    greedy = decode.generate(step, cache, jnp.zeros((1, 1), jnp.int32), 5, jax.random.PRNGKey(0), greedy=True)
    beam, _ = decode.beam_search(step, cache, jnp.zeros((1,), jnp.int32), 5, beam_size=1, eos_id=99)
    np.testing.assert_array_equal(beam[0, 0], greedy[0])


def test_encoder_decoder_beam_scores_match_full_forward_rescoring():
    """Beams reorder the KV cache every step; rescoring the returned hypotheses with one full
    forward pass must give the scores beam search reported."""
    import flax.linen as nn
    from tfm.models import EncoderDecoder, presets

    model = EncoderDecoder(presets.tiny("encdec", vocab_size=12))
    src = jax.random.randint(jax.random.PRNGKey(5), (2, 7), 3, 12)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), src, src)["params"])
    W, L, eos, bos = 3, 6, 1, 2
    seg = jnp.ones(src.shape, jnp.int32)
    encoded = model.apply({"params": params}, src, seg, method=EncoderDecoder.encode)
    cache = decode.init_cache(model, params, 2 * W, L, jnp.repeat(encoded, W, 0), jnp.repeat(seg, W, 0))
    tokens, scores = decode.beam_search(decode.step_fn(model, params), cache, jnp.full((2,), bos), L,
                                        beam_size=W, eos_id=eos)
    for b in range(2):
        for w in range(W):
            seq = list(np.asarray(tokens[b, w]))
            n = seq.index(eos) + 1 if eos in seq else L
            target_in = jnp.array([[bos] + seq[:L - 1]])
            logits = model.apply({"params": params}, src[b:b + 1], target_in, inputs_segment_ids=seg[b:b + 1]).logits
            logp = jax.nn.log_softmax(logits[0])[jnp.arange(n), jnp.array(seq[:n])].sum()
            np.testing.assert_allclose(scores[b, w], logp / decode.length_penalty(n, 0.6), atol=1e-4)
    # translate's beam path returns the best hypothesis of the same search (its greedy path: test_decode_sharded)
    beam = decode.translate(model, params, src, L, bos_id=bos, eos_id=eos, beam_size=W)
    np.testing.assert_array_equal(beam, tokens[:, 0])


def _brute_force_best(logp, first, limit, eos, alpha):
    """The best sequence (cut at its first eos, at most `limit` tokens) after token `first`."""
    V = logp.shape[0]
    best, best_score = None, -np.inf
    for length in range(1, limit + 1):
        for seq in itertools.product(range(V), repeat=length):
            if eos in seq[:-1] or (length < limit and seq[-1] != eos):
                continue  # ends at its first eos, or runs to the limit
            prev, total = first, 0.0
            for t in seq:
                total, prev = total + logp[prev, t], t
            score = total / decode.length_penalty(length, alpha)
            if score > best_score + 1e-9:
                best, best_score = list(seq), score
    return best, best_score


def test_beam_search_per_sentence_limits_and_early_stop_equal_brute_force():
    """Two sentences with output limits 3 and 5 in a buffer of 12: each result is the brute-force
    best within its limit, and the loop stops long before 12 steps."""
    V, eos, alpha, L = 4, 3, 0.6, 12
    table = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(6), (V, V)) * 2.0, axis=-1)
    logp = np.log(np.asarray(table))
    steps = []
    inner = markov_step(table)

    def counted(cache, tokens):
        jax.debug.callback(lambda: steps.append(1))
        return inner(cache, tokens)

    limits = jnp.array([3, 5])
    tokens, scores = decode.beam_search(counted, {"index": jnp.zeros(())}, jnp.array([0, 1]), L, beam_size=V ** 2,
                                        eos_id=eos, alpha=alpha, max_lengths=limits)
    for b, (first, limit) in enumerate([(0, 3), (1, 5)]):
        best, best_score = _brute_force_best(logp, first, limit, eos, alpha)
        assert list(np.asarray(tokens[b, 0, :len(best)])) == best
        assert (np.asarray(tokens[b, 0, len(best):]) == 0).all()
        assert abs(float(scores[b, 0]) - best_score) < 1e-5
    assert len(steps) <= 5 < L  # no step after every sentence is settled

    greedy = decode.generate(inner, {"index": jnp.zeros(())}, jnp.array([[0], [1]]), L, jax.random.PRNGKey(0),
                             greedy=True, max_lengths=limits)
    assert [int((np.asarray(row) != 0).sum()) <= n for row, n in zip(greedy, [3, 5])] == [True, True]
    assert (np.asarray(greedy[:, 5:]) == 0).all()
