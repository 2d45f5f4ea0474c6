"""Decoding under a mesh equals single-device decoding; the KV cache is sharded by its names.

On 8 simulated CPU devices with the trainer's activation rules, params placed as the trainer
places them and the batch sharded: greedy and sampled tokens of a GPT-2-style decoder and a
GQA llama (scanned layers) equal the single-device tokens; the encoder-decoder's greedy
tokens and beam-4 tokens equal, beam scores within 1e-5 (fp32); and every cached key, value
and segment-id array carries the NamedSharding its logical names give under the rule set.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tfm import decode
from tfm.models import DecoderLM, EncoderDecoder
from tfm.models.presets import tiny
from tfm.parallel import (MeshConfig, batch_sharding, flax_rules, make_mesh, make_rules, param_shardings,
                          parse_parallelism)

B, PROMPT, NEW, W, BOS, EOS = 8, 3, 5, 4, 2, 1
MESHES = {  # name -> (mesh config, rule sets, batch axis, tensor size)
    "data8": (MeshConfig(data=8), "data", "data", 1),
    "data2_tensor4": (MeshConfig(data=2, tensor=4), "data+tensor", "data", 4),
    "fsdp4_tensor2": (MeshConfig(data=1, fsdp=4, tensor=2), "fsdp+tensor", "fsdp", 2),
}
MODELS = {  # one layer where layers are looped: compile time dominates
    "decoder": lambda: DecoderLM(tiny("decoder", num_layers=1)),                     # MHA, K = 4
    "llama": lambda: DecoderLM(tiny("llama", scan_layers=True)),                     # GQA, K = 2, stacked
    "encdec": lambda: EncoderDecoder(tiny("encdec", num_layers=1, num_kv_heads=2)),  # GQA self + cross
    "hybrid": lambda: DecoderLM(tiny("hybrid")),  # a Mamba-2 layer (8 heads) and a GQA attention layer
}
SCORE_TOL = 1e-5  # fp32, absolute on the beam scores


@functools.lru_cache(maxsize=None)
def _setup(family):
    """(model, boxed params, inputs [B, PROMPT] or sources [B, 7])."""
    model = MODELS[family]()
    x = jax.random.randint(jax.random.PRNGKey(1), (B, 7 if family == "encdec" else PROMPT), 3, 64)
    boxed = jax.jit(model.init)(jax.random.PRNGKey(0), *((x, x) if family == "encdec" else (x,)))["params"]
    return model, boxed, x


def _lm_decode(model, params, prompt):
    """Greedy and sampled continuations [B, NEW] of prompt [B, PROMPT], and the cache after it."""
    rng, cache, step = jax.random.PRNGKey(3), decode.init_cache(model, params, B, PROMPT + NEW), decode.step_fn(model, params)
    greedy = decode.generate(step, cache, prompt, NEW, rng, greedy=True)
    sampled = decode.generate(step, cache, prompt, NEW, rng, temperature=0.8, top_k=20, top_p=0.9)
    return {"greedy": greedy, "sampled": sampled}, step(cache, prompt)[1]


def _seq2seq_decode(model, params, src):
    """Greedy translations [B, NEW] of src [B, S], beam-4 tokens [B/W, W, NEW] and scores of
    its first B/W rows (one cache row per beam: B rows in all), and the beam cache."""
    greedy = decode.translate(model, params, src, NEW, bos_id=BOS, eos_id=EOS)
    seg = jnp.ones(src.shape, jnp.int32)
    rows = jnp.repeat(src[:B // W], W, axis=0)  # [B, S]: example b's beams are rows b*W .. b*W+W-1
    encoded = model.apply({"params": params}, rows, seg, method=EncoderDecoder.encode)
    cache = decode.init_cache(model, params, B, NEW, encoded, seg)
    tokens, scores = decode.beam_search(decode.step_fn(model, params), cache, jnp.full((B // W,), BOS), NEW,
                                        beam_size=W, eos_id=EOS)
    return {"greedy": greedy, "beam": tokens, "scores": scores}, cache


def _run(family, mesh_name=None):
    """Decoding outputs (numpy) and the cache, on one device or under the named mesh."""
    model, boxed, x = _setup(family)
    fn = jax.jit(functools.partial(_seq2seq_decode if family == "encdec" else _lm_decode, model))
    if mesh_name is None:
        out, cache = fn(nn.unbox(boxed), x)
        return jax.tree.map(np.asarray, out), cache
    mesh_cfg, parallelism, _, _ = MESHES[mesh_name]
    mesh, styles = make_mesh(mesh_cfg), parse_parallelism(parallelism)
    rules = make_rules(*styles)
    params = jax.device_put(nn.unbox(boxed), param_shardings(boxed, mesh, rules))
    x = jax.device_put(x, batch_sharding(mesh, rules))
    with jax.set_mesh(mesh), nn.logical_axis_rules(flax_rules(make_rules(*styles, activations=True))):
        out, cache = fn(params, x)
    return jax.tree.map(np.asarray, out), cache


_reference = functools.lru_cache(maxsize=None)(_run)


def _expected_spec(mesh_name, names, shape):
    """The rule sets restated: cache batch (self- and cross-attention's) over the batch axis, kv
    heads (and a mixer's state heads) over tensor when it divides them, everything else (layers,
    length, head dim, state, convolution window) whole."""
    _, _, batch_axis, tensor = MESHES[mesh_name]
    spec = [batch_axis if n in ("cache_batch", "cache_memory_batch") else
            "tensor" if n in ("cache_kv_heads", "cache_heads") and tensor > 1 and dim % tensor == 0 else None
            for n, dim in zip(names, shape)]
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def _check_cache_shardings(cache, mesh_name):
    """Every named cache array has the expected NamedSharding; returns how many were checked."""
    boxes = [x for x in jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
             if isinstance(x, nn.LogicallyPartitioned)]
    for box in boxes:
        assert isinstance(box.value.sharding, NamedSharding)
        assert box.value.sharding.spec == _expected_spec(mesh_name, box.names, box.value.shape), box.names
    return len(boxes)


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("family", ["decoder", "llama"])
def test_lm_decoding_under_a_mesh_equals_single_device(family, mesh):
    ref, _ = _reference(family)
    got, cache = _run(family, mesh)
    np.testing.assert_array_equal(got["greedy"], ref["greedy"])
    np.testing.assert_array_equal(got["sampled"], ref["sampled"])
    assert not np.array_equal(ref["greedy"], ref["sampled"]), "sampling should differ from greedy here"
    assert _check_cache_shardings(cache, mesh) == 3  # k, v, segment ids (looped: 1 layer, or stacked)


def test_hybrid_decoding_under_a_mesh_equals_single_device():
    """A Mamba-2 + attention hybrid: tokens equal, the recurrent state's heads split over tensor."""
    ref, _ = _reference("hybrid")
    got, cache = _run("hybrid", "data2_tensor4")
    np.testing.assert_array_equal(got["greedy"], ref["greedy"])
    np.testing.assert_array_equal(got["sampled"], ref["sampled"])
    # attention: k, v, segment ids; Mamba-2: its state and 3 convolutions' windows and their segment ids
    assert _check_cache_shardings(cache, "data2_tensor4") == 10


@pytest.mark.parametrize("mesh", list(MESHES))
def test_translation_and_beam_search_under_a_mesh_equal_single_device(mesh):
    ref, _ = _reference("encdec")
    got, cache = _run("encdec", mesh)
    np.testing.assert_array_equal(got["greedy"], ref["greedy"])
    np.testing.assert_array_equal(got["beam"], ref["beam"])
    print(mesh, "beam scores max |diff| vs one device:", float(np.max(np.abs(got["scores"] - ref["scores"]))))
    np.testing.assert_allclose(got["scores"], ref["scores"], atol=SCORE_TOL, rtol=0)
    assert np.all(ref["scores"] > -1e8), "every beam should hold a real hypothesis"
    assert _check_cache_shardings(cache, mesh) == 6  # (self, cross) x (k, v, segment ids)
