"""DeepSeek Sparse Attention's indexer loss (DeepSeek-V3.2: KL from the main attention's head-summed, L1-normalised
distribution to the softmax of the index scores, over each query's chosen keys; the indexer's input detached), and
the task option that trains on it (Task.indexer_loss_weight).

A tiny MLA model with an indexer (2 heads, 4 index heads of 8) on 12 tokens, fp32: the sown loss against a float64
numpy reference recomputed from the layer's own queries, keys and scores; exactly 0 with one key per query (both
distributions are that key); the LM loss gives the indexer no gradient and the indexer loss gives only the indexer
one; the task adds weight * loss to its objective and reports it; gradient steps on the indexer alone lower it.
"""
import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.config import ModelConfig
from tfm.models import DecoderLM
from tfm.train.tasks import LMTask

B, T, V = 2, 12, 64
KEY = jax.random.PRNGKey(0)


def _model(top_k):
    cfg = ModelConfig(vocab_size=V, d_model=32, num_heads=2, num_kv_heads=2, head_dim=12, num_layers=1, d_ff=48,
                      norm="rmsnorm", norm_position="pre", position="rope", activation="swiglu", attention_bias=False,
                      ffn_bias=False, max_len=64, mla=dict(kv_rank=8, q_rank=12, rope_dim=4, value_dim=8),
                      indexer=dict(heads=4, head_dim=8, top_k=top_k))
    return DecoderLM(cfg)


@pytest.fixture(scope="module")
def setup():
    model = _model(top_k=5)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, V, (B, T)))
    seg = jnp.asarray([[1] * T, [1] * 7 + [2] * 3 + [0] * 2])  # packed, then padding
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), ids)["params"])
    return model, params, ids, seg


def _losses(model, params, ids, seg):
    out, sown = model.apply({"params": params}, ids, segment_ids=seg, mutable=["losses"])
    (kl,) = jax.tree.leaves(sown["losses"])
    return out, kl


def _is_indexer(path):
    return any("indexer" in str(getattr(k, "key", "")) for k in path)


def test_loss_matches_a_float64_reference_from_the_layers_values(setup):
    """The sown KL equals numpy's from the captured attention queries/keys and index scores (1e-5 relative)."""
    from tfm.layers import attention
    model, params, ids, seg = setup
    seen = {}
    original = attention.Attention._sow_index_loss

    def capture(self, q, k, scale, chosen, scores):
        seen.update(q=q, k=k, scale=scale, chosen=chosen, scores=scores)
        return original(self, q, k, scale, chosen, scores)
    attention.Attention._sow_index_loss = capture
    try:
        _, kl = _losses(model, params, ids, seg)
    finally:
        attention.Attention._sow_index_loss = original
    q, k, chosen, scores = (np.asarray(seen[n], np.float64) for n in ("q", "k", "chosen", "scores"))
    chosen = chosen.astype(bool)
    total, rows = 0.0, 0
    for b in range(B):
        for t in range(T):
            keys = np.flatnonzero(chosen[b, t])
            if not len(keys):
                continue
            logits = np.einsum("nh,snh->ns", q[b, t], k[b, keys]) * float(seen["scale"])
            heads = np.exp(logits - logits.max(-1, keepdims=True))
            p = (heads / heads.sum(-1, keepdims=True)).sum(0)
            p /= p.sum()
            s = scores[b, t, keys]
            log_q = s - s.max() - np.log(np.exp(s - s.max()).sum())
            total, rows = total + np.sum(p * (np.log(p) - log_q)), rows + 1
    assert chosen.sum(-1).max() == 5 and rows == B * T - 2  # top-5, the padding queries see nothing
    np.testing.assert_allclose(float(kl), total / rows, rtol=1e-5)
    assert float(kl) > 0


def test_one_key_per_query_gives_zero():
    model = _model(top_k=1)
    ids = jnp.asarray(np.random.default_rng(1).integers(1, V, (B, T)))
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), ids)["params"])
    assert abs(float(_losses(model, params, ids, jnp.ones((B, T), jnp.int32))[1])) < 1e-6


def test_gradients_are_separated(setup):
    """d(LM loss)/d(indexer) = 0 (top-k selection, detached input); d(KL)/d(everything else) = 0, d(KL)/d(indexer) != 0."""
    model, params, ids, seg = setup
    lm = jax.grad(lambda p: jnp.sum(_losses(model, p, ids, seg)[0].logits ** 2))(params)
    kl = jax.grad(lambda p: _losses(model, p, ids, seg)[1])(params)
    for path, g in jax.tree_util.tree_leaves_with_path(lm):
        if _is_indexer(path):
            assert not np.any(np.asarray(g)), jax.tree_util.keystr(path)
    indexer = [g for path, g in jax.tree_util.tree_leaves_with_path(kl) if _is_indexer(path)]
    rest = [g for path, g in jax.tree_util.tree_leaves_with_path(kl) if not _is_indexer(path)]
    assert indexer and all(np.any(np.asarray(g)) for g in indexer)
    assert not any(np.any(np.asarray(g)) for g in rest)


def test_task_option_adds_the_weighted_loss_and_trains_the_indexer(setup):
    model, params, ids, seg = setup
    batch = {"inputs": ids, "targets": ids, "segment_ids": seg, "weights": (seg > 0).astype(jnp.float32)}
    task, weighted = LMTask(), LMTask(indexer_loss_weight=2.0)
    totals = task.weight_totals(batch)
    plain, metrics = task.loss(model, params, batch, KEY, totals, deterministic=True)
    both, weighted_metrics = weighted.loss(model, params, batch, KEY, totals, deterministic=True)
    kl = float(metrics["indexer_kl_loss"])
    assert kl > 0 and "moe_aux_loss" not in metrics
    np.testing.assert_allclose(float(both), float(plain) + 2.0 * kl, rtol=1e-6)

    def step(p, _):
        g = jax.grad(lambda p: weighted.loss(model, p, batch, KEY, totals, deterministic=True)[1]["indexer_kl_loss"])(p)
        return jax.tree.map(lambda x, d: x - 0.5 * d, p, g), None
    trained, _ = jax.lax.scan(step, params, None, length=20)
    after = float(task.loss(model, trained, batch, KEY, totals, deterministic=True)[1]["indexer_kl_loss"])
    assert after < 0.8 * kl, (kl, after)


def test_gathered_top_keys_equal_masked_dense_attention_and_form_no_dense_logits(setup):
    """attention_impl="chunked" (each query's chosen keys gathered, queries 5 at a time) gives the masked dense
    form's logits and gradients (1e-5 of the largest), and its program holds no [B, N, T, S] array."""
    model, params, ids, seg = setup
    gathered = DecoderLM(model.config.replace(attention_impl="chunked", attention_chunk_size=5))

    def run(m):
        loss = lambda p: jnp.sum(m.apply({"params": p}, ids, segment_ids=seg).logits ** 2 * (seg > 0)[..., None])
        return jax.value_and_grad(loss)(params)
    (want, want_grads), (got, grads) = run(model), run(gathered)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grads))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, atol=1e-5 * scale, rtol=0)
    def shapes(m):
        """Every array shape the forward computes, nested programs included."""
        found = set()

        def walk(jaxpr):
            for eq in jaxpr.eqns:
                found.update(tuple(v.aval.shape) for v in eq.outvars)
                for value in eq.params.values():
                    for sub in value if isinstance(value, (tuple, list)) else [value]:
                        if isinstance(sub, jax.extend.core.ClosedJaxpr):
                            walk(sub.jaxpr)
                        elif isinstance(sub, jax.extend.core.Jaxpr):
                            walk(sub)
        walk(jax.make_jaxpr(lambda p: m.apply({"params": p}, ids, segment_ids=seg).logits)(params).jaxpr)
        return found
    dense = (B, model.config.num_heads, T, T)
    assert dense in shapes(model) and dense not in shapes(gathered)
