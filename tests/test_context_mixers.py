"""Context parallelism for the linear-time mixers (tfm.ops.context_scan): the sequence split over
`context`, each device's share reduced to an affine map of the state, the maps composed across the
devices, each share rerun from the state handed to it.

On 8 simulated CPU devices, mesh (data=2, context=4), fp32, 32 tokens a row (8 a device, chunks of 4),
packed so that sequences start inside a share, exactly at a device boundary (8) and after padding
that begins at one (24): a hybrid decoder with every mixer (Mamba, Mamba-2, gated DeltaNet, RWKV with
its channel mix, RG-LRU, KDA, the mLSTM with its running maximum; their chunked forms, short convolutions and token shifts) beside ring
attention (fed by a shared block, whose own attention rings too) equals one device (the same jit without a mesh) in each mixer's output, the loss and every
gradient; beside it, a scan from a given initial state (the first device's start) equals one device
in its outputs, final state and gradients. The same hybrid by the Pallas kernels (interpreted, chunks
of 8; without the mLSTM, which has none) split, against the chunked forms on one device. The split programs
gather nothing (no all-gather or all-to-all: maps, states and the convolutions' windows travel by
collective-permute). One compile each way, shared by the tests. A window longer than a device's share
fails in one line.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tfm.models import DecoderLM
from tfm.models.presets import tiny
from tfm.ops import context_scan
from tfm.ops.linear_scan import linear_scan
from tfm.parallel import MeshConfig, flax_rules, make_mesh, make_rules

B, T, V = 2, 32, 64
SEGMENTS = np.asarray([[1] * 11 + [2] * 13 + [0] * 5 + [3] * 3,   # a start at 11, padding from 24, a start at 29
                       [1] * 8 + [2] * 13 + [3] * 11])            # starts at 8 (a device boundary) and 21
POSITIONS = np.asarray([np.r_[0:11, 0:13, [0] * 5, 0:3], np.r_[0:8, 0:13, 0:11]])
MIXERS = ("mamba", "mamba2", "gated_deltanet", "rwkv", "rglru", "kda", "mlstm")  # layers 0-6; layer 7 is attention
KERNEL_MIXERS = MIXERS[:-1]  # the mixers with a Pallas kernel (KDA's: tfm.kernels.kda)
# The kernels against the chunked forms, of each array's largest magnitude: fp32 products and the delta rule's
# triangular inverse by doubling round apart by up to 1.3e-5 of the largest gradient after five layers (seen).
KERNEL_ATOL = 5e-5


def _model(mixers=MIXERS, impl="chunked", chunk=4):
    """A hybrid decoder: `mixers`, then an attention layer fed by a shared block (Zamba's, with LoRA adapters); channel
    mix after RWKV, a dense FFN after attention."""
    ffn = tuple("rwkv" if kind == "rwkv" else "none" for kind in mixers) + ("dense",)
    cfg = tiny("llama", num_layers=len(mixers) + 1, mixer_chunk_size=chunk, mixer_pattern=mixers + ("shared>attention",),
               ffn_pattern=ffn, mixer_impl=impl, mamba=dict(state_size=4),
               mamba2=dict(state_size=4, head_dim=8, groups=2),
               deltanet=dict(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8), kda=dict(heads=2, head_dim=8),
               mlstm=dict(heads=2), shared_block=dict(lora_rank=2))
    return DecoderLM(cfg)


def _inputs(model):
    """Parameters (drawn at random on their shapes: no init compile), the batch, a cotangent of the
    logits, and a linear scan's a, b, initial state and cotangent; numpy."""
    rng = np.random.default_rng(0)
    shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
    params = jax.tree.map(lambda s: (0.5 * rng.standard_normal(s.shape)).astype(np.float32), shapes["params"])
    ids = rng.integers(1, V, (B, T)).astype(np.int32) * (SEGMENTS > 0)
    ct = rng.standard_normal((B, T, V)).astype(np.float32) * (SEGMENTS > 0)[..., None]
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    scan = (1 / (1 + np.exp(-normal(B, T, 3) - 2)), normal(B, T, 3), normal(B, 3), normal(B, T, 3))
    return params, (ids, SEGMENTS, POSITIONS, ct) + scan


def _step(model, layers):
    """jit(value_and_grad) of the model's sum(logits * ct) plus a linear scan's sum(h * ct) + sum(final)
    -> ((loss, (each mixer's output, logits, h, final)), gradients of the parameters, a, b and the initial state)."""
    def f(params, a, b, h0, ids, segments, positions, ct, scan_ct):
        out, found = model.apply({"params": params}, ids, segment_ids=segments, positions=positions,
                                 capture_intermediates=lambda module, _: module.name == "mixer",
                                 mutable=["intermediates"])
        h, final = linear_scan(a, b, segment_ids=segments, initial_state=h0)
        mixed = [found["intermediates"]["decoder"][f"layer_{i}"]["mixer"]["__call__"][0] for i in range(layers)]
        return jnp.sum(out.logits * ct) + jnp.sum(h * scan_ct) + jnp.sum(final), (mixed, out.logits, h, final)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))


def _split(mesh, arrays):
    """[B, T, ...] arrays split over data x context, [B, ...] over data."""
    spec = lambda x: P("data", "context") if x.shape[:2] == (B, T) else P("data")
    return [jax.device_put(x, NamedSharding(mesh, spec(x))) for x in arrays]


def _one_and_split(mixers, split_impl, chunk):
    """(one device with the chunked forms, split over context with `split_impl`) results of `_step`, and the split
    program's compiled text."""
    model = _model(mixers, "chunked", chunk)
    params, (ids, segments, positions, ct, a, b, h0, scan_ct) = _inputs(model)
    args = (a, b, h0, ids, segments, positions, ct, scan_ct)
    one = _step(model, len(mixers))(params, *args)
    step = _step(_model(mixers, split_impl, chunk), len(mixers))
    mesh = make_mesh(MeshConfig(data=2, context=4), jax.devices()[:8])
    with jax.set_mesh(mesh), nn.logical_axis_rules(flax_rules(make_rules("data", "context", activations=True))):
        compiled = step.lower(params, *_split(mesh, args)).compile()
    return one, compiled(params, *_split(mesh, args)), compiled.as_text()


@pytest.fixture(scope="module")
def results():
    return _one_and_split(MIXERS, "chunked", 4)


@pytest.fixture(scope="module")
def kernels():
    return _one_and_split(KERNEL_MIXERS, "pallas", 8)


def _close(got, want, atol=1e-5):
    """Leaf by leaf, within atol of the largest magnitude among `want`'s leaves."""
    scale = max(float(np.abs(w).max()) for w in jax.tree.leaves(want))
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=atol * scale, rtol=0, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("layer,mixer", list(enumerate(MIXERS)))
def test_mixer_split_over_context_equals_one_device(results, layer, mixer):
    """The mixer's output and its layer's parameter gradients."""
    ((_, (want, *_)), (want_grads, *_)), ((_, (got, *_)), (got_grads, *_)), _ = results
    _close(got[layer], want[layer])
    _close(got_grads["decoder"][f"layer_{layer}"], want_grads["decoder"][f"layer_{layer}"])


@pytest.mark.parametrize("layer,mixer", list(enumerate(KERNEL_MIXERS)))
def test_mixer_kernel_split_over_context_equals_one_device(kernels, layer, mixer):
    """mixer_impl='pallas' split over context: each kernel mixer's output and its layer's gradients equal the
    chunked form's on one device."""
    ((_, (want, *_)), (want_grads, *_)), ((_, (got, *_)), (got_grads, *_)), _ = kernels
    _close(got[layer], want[layer], KERNEL_ATOL)
    _close(got_grads["decoder"][f"layer_{layer}"], want_grads["decoder"][f"layer_{layer}"], KERNEL_ATOL)


@pytest.mark.parametrize("fixture", ["results", "kernels"])
def test_hybrid_and_initial_state_split_over_context_equal_one_device(request, fixture):
    """The logits, every parameter's gradient (attention by ring, embeddings, head), and a linear scan's
    outputs, final state and gradients from a given initial state; the chunked forms and the kernels."""
    ((_, (_, want_logits, *want_scan)), want_grads), ((_, (_, got_logits, *got_scan)), got_grads), _ = \
        request.getfixturevalue(fixture)
    atol = KERNEL_ATOL if fixture == "kernels" else 1e-5
    _close(got_logits, want_logits, atol)
    _close(got_grads[0], want_grads[0], atol)
    _close((got_scan, got_grads[1:]), (want_scan, want_grads[1:]), atol)


@pytest.mark.parametrize("fixture", ["results", "kernels"])
def test_split_program_gathers_nothing(request, fixture):
    text = request.getfixturevalue(fixture)[2]
    assert "collective-permute" in text  # maps, states, windows, attention's key/value blocks
    assert "all-gather" not in text and "all-to-all" not in text


def test_a_window_longer_than_a_share_fails_in_one_line():
    """A short convolution reading more earlier tokens than a device holds is refused where it is traced."""
    mesh = make_mesh(MeshConfig(data=1, context=4), jax.devices()[:4])
    x = jnp.zeros((1, 8, 2))
    with jax.set_mesh(mesh), nn.logical_axis_rules(flax_rules(make_rules("context", activations=True))):
        with pytest.raises(ValueError, match=r"^a window of 3 earlier tokens needs at least 3 tokens per 'context'"):
            context_scan.with_previous(lambda x: x, 3, (jnp.zeros((1, 3, 2)),), (x,))
