"""Model-level properties: KV-cache decoding equals the full forward pass, causality, block
variants, mixture-of-experts routing against brute force, positions."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm import decode
from tfm.layers.positions import apply_rope
from tfm.layers.feedforward import route
from tfm.models import DecoderLM, EncoderDecoder, EncoderModel, EncoderOutput, LMOutput, Unembedding, presets

RNG = jax.random.PRNGKey(0)


def init(model, *args, **kwargs):
    return nn.meta.unbox(model.init(RNG, *args, **kwargs)["params"])


def tokens(shape, vocab=64, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 1, vocab)


DECODER_CONFIGS = {
    "gpt2": presets.tiny("decoder"),
    "llama_gqa": presets.tiny("llama"),
    "llama_window": presets.tiny("llama", sliding_window=3),
    "mqa_alibi": presets.tiny("decoder", num_kv_heads=1, position="alibi"),
    "moe": presets.tiny("moe"),
    "parallel_scan": presets.tiny("llama", parallel_block=True, scan_layers=True),
    "latent_attention": presets.tiny("llama", num_kv_heads=4, head_dim=12,
                                     mla=dict(kv_rank=16, rope_dim=4, q_rank=8, value_dim=6)),
}


@pytest.mark.parametrize("name", sorted(DECODER_CONFIGS))
def test_decoder_kv_cache_matches_full_forward(name):
    model = DecoderLM(DECODER_CONFIGS[name])
    x = tokens((2, 11))
    params = init(model, x)
    full = model.apply({"params": params}, x).logits
    cache = decode.init_cache(model, params, 2, 16)
    step = jax.jit(decode.step_fn(model, params))
    logits, cache = step(cache, x[:, :4])  # prefill 4, then one token at a time
    pieces = [logits]
    for t in range(4, 11):
        logits, cache = step(cache, x[:, t:t + 1])
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=1e-5)
    window = DECODER_CONFIGS[name].sliding_window  # a windowed layer keeps a ring of `window` slots, not all 16
    lengths = {a.shape[-2] for path, a in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(cache))
               if "'cached_key'" in jax.tree_util.keystr(path) or "'cached_latent'" in jax.tree_util.keystr(path)}
    assert lengths == ({16} if window is None else {window})


def test_latent_attention_caches_the_latent_and_rope_key_only():
    """DeepSeek's MLA cache holds kv_rank + rope_dim numbers per token and layer (the paper's
    d_c + d_h^R: 16 + 4 here, against 2 * N * H = 96 for keys and values), and the kernels give
    the reference's logits although value heads (6) are narrower than query/key heads (12)."""
    cfg = DECODER_CONFIGS["latent_attention"]
    model = DecoderLM(cfg)
    x = tokens((2, 11))
    params = init(model, x)
    cache = decode.init_cache(model, params, 2, 16)
    layer = cache["decoder"]["layer_0"]["self_attn"]
    per_token = {name: a.shape[2:] for name, a in nn.meta.unbox(layer).items() if a.ndim == 3}
    assert per_token == {"cached_latent": (16,), "cached_key_rope": (4,)}
    assert set(nn.meta.unbox(layer)) == {"cached_latent", "cached_key_rope", "cached_segment_ids", "index"}
    pallas = DecoderLM(cfg.replace(attention_impl="pallas"))
    seg = jnp.array([[1] * 11, [1] * 7 + [0] * 4])
    a = model.apply({"params": params}, x, segment_ids=seg).logits
    b = pallas.apply({"params": params}, x, segment_ids=seg).logits
    np.testing.assert_allclose(np.asarray(b)[:, :7], np.asarray(a)[:, :7], atol=1e-5)


@pytest.mark.parametrize("overrides", [{}, {"num_kv_heads": 2, "sliding_window": 4, "norm_position": "pre"}])
def test_encoder_decoder_kv_cache_matches_full_forward(overrides):
    model = EncoderDecoder(presets.tiny("encdec", **overrides))
    src, tgt = tokens((2, 9), seed=2), tokens((2, 7), seed=3)
    src_seg = jnp.array([[1] * 9, [1] * 6 + [0] * 3])
    params = init(model, src, tgt)
    full = model.apply({"params": params}, src, tgt, inputs_segment_ids=src_seg).logits
    encoded = model.apply({"params": params}, src, src_seg, method=EncoderDecoder.encode)
    cache = decode.init_cache(model, params, 2, 8, encoded, src_seg)
    step = jax.jit(decode.step_fn(model, params))
    pieces = []
    for t in range(7):
        logits, cache = step(cache, tgt[:, t:t + 1])
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama_window", "moe"])
def test_future_tokens_do_not_change_earlier_logits(name):
    model = DecoderLM(DECODER_CONFIGS[name])
    x = tokens((2, 12))
    params = init(model, x)
    y = x.at[:, 7:].set(tokens((2, 5), seed=9))
    a, b = model.apply({"params": params}, x).logits, model.apply({"params": params}, y).logits
    np.testing.assert_allclose(a[:, :7], b[:, :7], atol=1e-6)
    assert float(jnp.max(jnp.abs(a[:, 7:] - b[:, 7:]))) > 1e-3


def test_encoder_decoder_target_causality_and_source_padding():
    model = EncoderDecoder(presets.tiny("encdec"))
    src, tgt = tokens((1, 9), seed=2), tokens((1, 8), seed=3)
    seg = jnp.array([[1] * 6 + [0] * 3])
    params = init(model, src, tgt)
    f = lambda s, t: model.apply({"params": params}, s, t, inputs_segment_ids=seg).logits
    base = f(src, tgt)
    np.testing.assert_allclose(f(src, tgt.at[:, 5:].set(1))[:, :5], base[:, :5], atol=1e-6)
    np.testing.assert_allclose(f(src.at[:, 6:].set(1), tgt), base, atol=1e-6)  # padded source ignored


def test_packed_rows_equal_separate_sequences():
    cfg = presets.tiny("llama")
    model = DecoderLM(cfg)
    a, b = tokens((1, 5), seed=4), tokens((1, 6), seed=5)
    params = init(model, a)
    packed = jnp.concatenate([a, b, jnp.zeros((1, 3), jnp.int32)], 1)
    seg = jnp.array([[1] * 5 + [2] * 6 + [0] * 3])
    pos = jnp.array([list(range(5)) + list(range(6)) + [0] * 3])
    out = model.apply({"params": params}, packed, segment_ids=seg, positions=pos).logits
    np.testing.assert_allclose(out[:, :5], model.apply({"params": params}, a).logits, atol=1e-5)
    np.testing.assert_allclose(out[:, 5:11], model.apply({"params": params}, b).logits, atol=1e-5)


def test_post_norm_block_matches_hand_computation():
    """Post-norm: x <- LN(x + Attn(x)); x <- LN(x + FFN(x)) (Vaswani et al.), one layer by hand."""
    cfg = presets.tiny("encoder", num_layers=1, heads=(), embedding_norm=False, type_vocab_size=0)
    model = EncoderModel(cfg)
    x = tokens((1, 6))
    params = init(model, x)
    hidden = model.apply({"params": params}, x).hidden
    p = params["encoder"]["layer_0"]
    h = params["embed"]["embedding"][x] + params["input"]["position"]["embedding"][:6]

    def ln(y, q):
        mu, var = y.mean(-1, keepdims=True), y.var(-1, keepdims=True)
        return (y - mu) / jnp.sqrt(var + cfg.norm_eps) * q["scale"] + q["bias"]

    a = p["self_attn"]
    proj = lambda w, y: jnp.einsum("btd,dnh->btnh", y, w["kernel"]) + w["bias"]
    q, k, v = proj(a["query"], h), proj(a["key"], h), proj(a["value"], h)
    w = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(cfg.head_dim), -1)
    attn = jnp.einsum("bnts,bsnh->btnh", w, v)
    attn = jnp.einsum("btnh,nhd->btd", attn, a["out"]["kernel"]) + a["out"]["bias"]
    h = ln(h + attn, p["attn_norm"])
    f = p["ffn"]
    ff = jax.nn.gelu(h @ f["wi"]["kernel"] + f["wi"]["bias"], approximate=False) @ f["wo"]["kernel"] + f["wo"]["bias"]
    np.testing.assert_allclose(hidden, ln(h + ff, p["ffn_norm"]), atol=1e-5)


def test_moe_dropless_matches_per_token_brute_force():
    cfg = presets.tiny("moe", num_layers=1)
    model = DecoderLM(cfg)
    x = tokens((2, 6))
    params = init(model, x)
    moe = params["decoder"]["layer_0"]["ffn"]
    h = jax.random.normal(RNG, (2, 6, cfg.d_model))
    from tfm.layers.feedforward import MoeMlp
    got, _ = MoeMlp(cfg).apply({"params": moe}, h, mutable=["losses"])
    want = np.zeros_like(h)
    for b in range(2):
        for t in range(6):
            probs = jax.nn.softmax(h[b, t] @ moe["router"]["kernel"])
            top = np.argsort(-np.asarray(probs))[:2]
            gates = probs[top] / probs[top].sum()
            for g, e in zip(gates, top):
                hidden = jax.nn.silu(h[b, t] @ moe["wi_gate"][e]) * (h[b, t] @ moe["wi_up"][e])
                want[b, t] += g * (hidden @ moe["wo"][e])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_moe_routing_capacity_and_aux_loss_closed_form():
    cfg = presets.tiny("moe", experts_per_token=1, moe_impl="einsum", capacity_factor=1.0)  # E=4, k=1: capacity T/4
    logits = jnp.zeros((1, 8, 4)).at[0, :, 2].set(5.0)  # every token prefers expert 2
    dispatch, combine, aux = route(logits, cfg, capacity=2)
    assert dispatch.shape == (1, 8, 4, 2)
    np.testing.assert_array_equal(dispatch.sum((2, 3))[0], [1, 1, 0, 0, 0, 0, 0, 0])  # first two fit
    p = jax.nn.softmax(jnp.array([0, 0, 5.0, 0]))
    np.testing.assert_allclose(aux, 4 * float(p[2]), rtol=1e-6)  # E * (fraction 1.0 on e=2) * mean prob
    _, _, uniform_aux = route(jnp.zeros((1, 8, 4)), cfg.replace(experts_per_token=2), capacity=8)
    np.testing.assert_allclose(uniform_aux, 2.0, rtol=1e-6)  # uniform router: aux = k


def test_rope_depends_only_on_relative_position_and_linear_scaling():
    cfg = presets.tiny("llama")
    q, k = jax.random.normal(RNG, (2, 1, 1, cfg.head_dim))
    dot = lambda i, j, c=cfg: float(jnp.sum(apply_rope(q[None], jnp.array([[i]]), c) *
                                            apply_rope(k[None], jnp.array([[j]]), c)))
    assert abs(dot(3, 1) - dot(12, 10)) < 1e-5 and abs(dot(3, 1) - dot(3, 2)) > 1e-3
    scaled = cfg.replace(rope=dict(scaling="linear", factor=4.0))
    assert abs(dot(8, 4, scaled) - dot(2, 1)) < 1e-5


def test_bfloat16_computation_keeps_float32_params_and_logits():
    model = DecoderLM(presets.tiny("llama", dtype="bfloat16"))
    x = tokens((2, 8))
    params = init(model, x)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    out = model.apply({"params": params}, x).logits
    ref = DecoderLM(presets.tiny("llama")).apply({"params": params}, x).logits
    assert out.dtype == jnp.float32
    assert 0 < float(jnp.max(jnp.abs(out - ref))) < 0.1


@pytest.mark.parametrize("family", ["decoder", "llama", "encdec"])  # tied (GPT-2, Transformer) and untied (Llama)
def test_logits_block_size_pads_the_matmul_not_the_function(family):
    """V 64 padded to 96 (block 48) inside the logits matmul: the same logits and gradients, the same
    parameter shapes."""
    x = tokens((2, 8))
    Model = EncoderDecoder if family == "encdec" else DecoderLM
    base, padded = (Model(presets.tiny(family, logits_block_size=b)) for b in (1, 48))
    inputs = (x, x) if family == "encdec" else (x,)
    params = init(base, *inputs)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, init(padded, *inputs))
    weights = jax.random.normal(jax.random.PRNGKey(5), (2, 8, 64))
    def loss(model, p):
        out = model.apply({"params": p}, *inputs)
        return jnp.sum(out.logits * weights), out.logits
    (l0, logits0), g0 = jax.value_and_grad(lambda p: loss(base, p), has_aux=True)(params)
    (l1, logits1), g1 = jax.value_and_grad(lambda p: loss(padded, p), has_aux=True)(params)
    assert logits1.shape == logits0.shape == (2, 8, 64)
    np.testing.assert_allclose(logits1, logits0, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4), g0, g1)


def test_logits_block_size_by_platform(monkeypatch):
    """None pads the logits matmul to 128 columns on GPU only; a set value on every platform."""
    from tfm.models import embedding
    x = tokens((1, 4))
    model = DecoderLM(presets.tiny("decoder"))
    params = init(model, x)
    def pads(jaxpr):  # the rows of every pad, nested calls included
        for e in jaxpr.eqns:
            yield from [e.outvars[0].aval.shape[0]] if e.primitive.name == "pad" else []
            for sub in e.params.values():
                yield from pads(sub.jaxpr) if hasattr(sub, "jaxpr") else []
    padded_width = lambda m: list(pads(jax.make_jaxpr(lambda p: m.apply({"params": p}, x).logits)(params).jaxpr))
    assert padded_width(model) == []  # CPU: as is
    assert padded_width(DecoderLM(presets.tiny("decoder", logits_block_size=48))) == [96]
    monkeypatch.setattr(embedding, "current_platform", lambda: "gpu")
    assert padded_width(model) == [128]


def test_remat_and_scan_give_identical_loss_and_gradients():
    x = tokens((2, 8))
    base = DecoderLM(presets.tiny("llama", scan_layers=True))
    params = init(base, x)
    loss = lambda m: jax.value_and_grad(lambda p: jnp.mean(m.apply({"params": p}, x).logits ** 2))(params)
    l0, g0 = loss(base)
    l1, g1 = loss(DecoderLM(presets.tiny("llama", scan_layers=True, remat_policy="dots_saveable")))
    assert abs(float(l0 - l1)) < 1e-6
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), g0, g1)  # recompute reorders fp32 sums


def test_bert_heads_shapes_and_mlm_positions():
    cfg = presets.tiny("encoder", heads=("mlm", "nsp", "classification"), num_labels=3)
    model = EncoderModel(cfg)
    x = tokens((2, 10))
    params = init(model, x)
    out = model.apply({"params": params}, x, token_type_ids=jnp.zeros_like(x), mlm_positions=jnp.array([[1, 4], [0, 9]]))
    assert out.mlm_logits.shape == (2, 2, 64) and out.nsp_logits.shape == (2, 2)
    assert out.logits.shape == (2, 3) and out.hidden.shape == (2, 10, 32)
    assert out.score is None and out.embedding is None and out.mlm_unembedding is None  # heads not configured
    full = model.apply({"params": params}, x).mlm_logits
    np.testing.assert_allclose(out.mlm_logits[1, 1], full[1, 9], atol=1e-5)



def test_each_model_returns_one_output_type_whatever_its_flags():
    """A flag (heads, logits=False, decode) fills or empties fields of one output type; it never
    changes the type (docs/DESIGN.md: typed seams)."""
    x = tokens((2, 6))
    gpt1 = DecoderLM(presets.tiny("decoder", heads=("classification",), num_labels=3))
    params = init(gpt1, x)
    plain, fused = gpt1.apply({"params": params}, x), gpt1.apply({"params": params}, x, logits=False)
    assert type(plain) is type(fused) is LMOutput
    assert plain.logits.shape == (2, 6, 64) and plain.unembedding is None and plain.cls_logits.shape == (2, 3)
    assert fused.logits is None and isinstance(fused.unembedding, Unembedding) and fused.cls_logits.shape == (2, 3)
    cache = decode.init_cache(gpt1, params, 2, 8)
    stepped, _ = gpt1.apply({"params": params, "cache": cache}, x[:, :1], decode=True, mutable=["cache"])
    assert type(stepped) is LMOutput and stepped.cls_logits is None
    for heads in [(), ("mlm",), ("pooler", "mean_pool"), ("regression", "span")]:
        bert = EncoderModel(presets.tiny("encoder", heads=heads))
        p = init(bert, x)
        for kw in ({}, {"logits": False}):
            out = bert.apply({"params": p}, x, **kw)
            assert type(out) is EncoderOutput and out.hidden.shape == (2, 6, 32)
            assert (out.mlm_logits is not None) == ("mlm" in heads and not kw)
            assert (out.mlm_unembedding is not None) == ("mlm" in heads and bool(kw))
    encdec = EncoderDecoder(presets.tiny("encdec"))
    p = init(encdec, x, x)
    assert type(encdec.apply({"params": p}, x, x)) is type(encdec.apply({"params": p}, x, x, logits=False)) is LMOutput

LOGICAL_NAMES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "expert", "layers", "length", None}


@pytest.mark.parametrize("family, model_cls, n_inputs", [
    ("decoder", DecoderLM, 1), ("moe", DecoderLM, 1), ("encoder", EncoderModel, 1), ("encdec", EncoderDecoder, 2)])
@pytest.mark.parametrize("scan", [False, True])
def test_every_parameter_carries_logical_axis_names(family, model_cls, n_inputs, scan):
    cfg = presets.tiny(family, scan_layers=scan)
    if family == "encoder":
        cfg = cfg.replace(heads=("mlm", "nsp", "classification"))
    x = jnp.ones((1, 4), jnp.int32)
    boxed = jax.eval_shape(lambda: model_cls(cfg).init(RNG, *[x] * n_inputs)["params"])
    leaves = jax.tree.leaves(boxed, is_leaf=lambda v: isinstance(v, nn.Partitioned))
    assert leaves and all(isinstance(v, nn.Partitioned) for v in leaves)
    for v in leaves:
        assert len(v.names) == v.value.ndim and set(v.names) <= LOGICAL_NAMES, v.names
    assert any("layers" in v.names for v in leaves) == scan


def test_a_windowed_cache_is_flat_in_context():
    """RecurrentGemma-2B's decode cache for one sequence (shapes only, nothing allocated): each local-attention
    layer keeps its 2,048-token window, the RG-LRU layers fixed-size states, so the cache is the same size at
    4,096 and 32,768 tokens of context (all 32,768 positions would be 16x the window)."""
    model = DecoderLM(presets.recurrentgemma_2b())
    params = jax.eval_shape(lambda: init(model, jnp.zeros((1, 8), jnp.int32)))
    shapes = {n: jax.eval_shape(lambda p: decode.init_cache(model, p, 1, n), params) for n in (4096, 32768)}
    sizes = {n: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(nn.meta.unbox(c))) for n, c in shapes.items()}
    assert sizes[4096] == sizes[32768]
    lengths = {a.shape[-2] for path, a in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(shapes[32768]))
               if "'cached_key'" in jax.tree_util.keystr(path)}
    assert lengths == {2048}
