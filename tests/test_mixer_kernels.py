"""The Pallas kernels of the linear-time mixers (tfm.kernels.ssd, tfm.kernels.delta_rule, tfm.kernels.kda,
tfm.kernels.linear_scan, tfm.kernels.wkv; interpreted on CPU) against their chunked JAX forms (tfm.ops.ssd,
tfm.ops.delta_rule, tfm.ops.linear_scan, tfm.ops.wkv; the WKV kernel's values and gradients are tested in
tests/test_wkv.py).

One case per family: 37 tokens in chunks of 16 (the last chunk partial), packed segments (starting mid-chunk
and on a chunk boundary) with padding on both ends, an initial state; Mamba-2 with 4 heads reading 2 groups of
B/C; Mamba's selective scan (the fused kernel) with 8 channels of state 4; KDA (a decay per key channel) with
two of its 8 channels decaying by e^-5 to e^-20 a token, where exp(-cs) over a chunk overflows float32. Values
(output, final state) and the gradients of every input: fp32 max-abs error <= 1e-5 of each quantity's largest
magnitude, bf16 <= 1e-2. The inputs are bf16 values, so bf16 and fp32 runs share one reference (the chunked forms
compute in fp32).
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.kernels import delta_rule as delta_kernel
from tfm.kernels import kda as kda_kernel
from tfm.kernels import linear_scan as scan_kernel
from tfm.kernels import row_loop
from tfm.kernels import selective_scan as selective_kernel
from tfm.kernels import wkv as wkv_kernel
from tfm.kernels import ssd as ssd_kernel
from tfm.models import DecoderLM
from tfm.models.presets import tiny
from tfm.ops import delta_rule as delta_ops
from tfm.ops import ssd as ssd_ops
from tfm.ops import wkv as wkv_ops
from tfm.ops.linear_scan import linear_scan
from tfm.ops.segments import sequence_starts

TOLERANCES = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}  # of the largest magnitude of each compared array
Bsz, T, CHUNK = 1, 37, 16
N, P, G, S = 4, 8, 2, 16  # Mamba-2: heads, head dim, groups, state size
H, K, V = 2, 8, 16  # gated DeltaNet and KDA: heads, key and value head dims
E, SE = 8, 4  # Mamba: channels, state size
NAMES = {"ssd": ("x", "dt", "A", "B", "C", "h0"), "selective": ("x", "dt", "A", "B", "C", "h0"),
         "delta": ("q", "k", "v", "g", "beta", "h0"), "kda": ("q", "k", "v", "g", "beta", "h0")}
ENTRY_POINTS = {"ssd": ssd_ops.ssd, "selective": ssd_ops.selective_scan, "delta": delta_ops.gated_delta_rule,
                "kda": delta_ops.gated_delta_rule}


def _segments():
    """Left padding, sequences starting mid-chunk (10) and on a chunk boundary (32), right padding."""
    return jnp.asarray(np.repeat([0, 1, 2, 3, 0], [3, 7, 22, 3, 2])[None], jnp.int32)


def _inputs(family, dtype):
    """(the scan's six differentiable inputs, its output dtype taken from the sequences), cotangents of
    (output, final state). Sequences are bf16 values in `dtype`; decays, A and the state fp32."""
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    rounded = lambda a: a.astype(jnp.bfloat16).astype(dtype)
    if family == "ssd":
        x = jax.random.normal(keys[0], (Bsz, T, N, P))
        dt = jax.nn.softplus(jax.random.normal(keys[1], (Bsz, T, N)))
        B, C = (jax.random.normal(key, (Bsz, T, G, S)) for key in keys[3:5])
        args = (rounded(x), rounded(dt), -jnp.exp(jax.random.normal(keys[2], (N,))), rounded(B), rounded(C),
                jax.random.normal(keys[5], (Bsz, N, P, S)))
        shapes = ((Bsz, T, N, P), (Bsz, N, P, S))
    elif family == "selective":
        x = jax.random.normal(keys[0], (Bsz, T, E))
        dt = jax.nn.softplus(jax.random.normal(keys[1], (Bsz, T, E)))
        B, C = (jax.random.normal(key, (Bsz, T, SE)) for key in keys[3:5])
        args = (rounded(x), rounded(dt), -jnp.exp(jax.random.normal(keys[2], (E, SE))), rounded(B), rounded(C),
                jax.random.normal(keys[5], (Bsz, E, SE)))
        shapes = ((Bsz, T, E), (Bsz, E, SE))
    else:
        unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)
        q = unit(jax.random.normal(keys[0], (Bsz, T, H, K))) * K ** -0.5
        k = unit(jax.random.normal(keys[1], (Bsz, T, H, K)))
        v = jax.random.normal(keys[2], (Bsz, T, H, V))
        g = -jax.nn.softplus(jax.random.normal(keys[3], (Bsz, T, H) + ((K,) if family == "kda" else ())))
        if family == "kda":  # two channels strongly decaying: a factored exp(cs_i) exp(-cs_j) overflows
            g = g.at[..., :2].set(-jax.random.uniform(jax.random.fold_in(keys[3], 1), (Bsz, T, H, 2), minval=5,
                                                      maxval=20))
        beta = jax.nn.sigmoid(jax.random.normal(keys[4], (Bsz, T, H)))
        args = (rounded(q), rounded(k), rounded(v), g, beta, jax.random.normal(keys[5], (Bsz, H, K, V)))
        shapes = ((Bsz, T, H, V), (Bsz, H, K, V))
    return args, tuple(jax.random.normal(key, shape) for key, shape in zip(keys[6:], shapes))


def _by_entry_point(family, impl, *args):
    *args, h0, segments = args
    return ENTRY_POINTS[family](*args, segment_ids=segments, initial_state=h0, impl=impl, chunk_size=CHUNK)


def _by_kernel(family, *args):
    """The scans' inputs as the kernels take them (padding an identity step, the sequence starts), the TPU
    driver interpreted."""
    *args, h0, segments = args
    real, reset = sequence_starts(segments)
    real = real[..., None]
    options = dict(chunk=CHUNK, backend="tpu", interpret=True)
    if family == "ssd":
        x, dt, A, B, C = args
        dt = jnp.where(real, dt.astype(jnp.float32), 0)
        xdt = (x.astype(jnp.float32) * dt[..., None]).astype(x.dtype)
        return ssd_kernel.chunked_ssd(xdt, dt * A, B, C, reset, h0, **options)
    if family == "selective":
        x, dt, A, B, C = args
        dt = jnp.where(real, dt.astype(jnp.float32), 0)
        y, h = selective_kernel.selective_scan(x, dt, jnp.broadcast_to(A, h0.shape), B, C, reset, h0, **options)
        return y.astype(x.dtype), h
    q, k, v, g, beta = args
    chunked = kda_kernel.chunked_kda if family == "kda" else delta_kernel.chunked_gated_delta_rule
    return chunked(q, k, v, jnp.where(real.reshape(real.shape + (1,) * (g.ndim - 3)), g, 0), jnp.where(real, beta, 0),
                   reset, h0, **options)


def _values_and_grads(run, args, cotangents, segments=None):
    """run(*args, segment ids) -> (output, final state, an array or a tuple of them): those and the gradients of
    every arg (segment ids `_segments()` unless given); cotangents (of the output, of the state alike)."""
    segments = _segments() if segments is None else segments

    def loss(*args):
        out, h = run(*args, segments)
        state = sum(jnp.sum(s * c) for s, c in zip(jax.tree.leaves(h), jax.tree.leaves(cotangents[1])))
        return jnp.sum(out.astype(jnp.float32) * cotangents[0]) + state, (out, h)
    (_, values), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return values, grads


@functools.cache
def _reference(family):
    return _values_and_grads(functools.partial(_by_entry_point, family, "chunked"), *_inputs(family, jnp.float32))


@pytest.mark.parametrize("family,dtype,driver", [
    ("ssd", jnp.float32, "loop"), ("ssd", jnp.bfloat16, "grid"), ("delta", jnp.float32, "loop"),
    ("delta", jnp.bfloat16, "grid"), ("kda", jnp.float32, "loop"), ("kda", jnp.bfloat16, "grid"),
    ("selective", jnp.float32, "loop"), ("selective", jnp.bfloat16, "grid")],
    ids=["ssd-fp32-loop", "ssd-bf16-grid", "delta-fp32-loop", "delta-bf16-grid", "kda-fp32-loop", "kda-bf16-grid",
         "selective-fp32-loop", "selective-bf16-grid"])
def test_kernels_equal_the_chunked_forms(family, dtype, driver):
    """The loop driver (GPU's) through the entry point, impl="pallas" on CPU; the grid driver (TPU's: a
    sequential chunk axis, the state in scratch) called directly; both interpreted."""
    args, cotangents = _inputs(family, dtype)
    run = (functools.partial(_by_entry_point, family, "pallas") if driver == "loop"
           else functools.partial(_by_kernel, family))
    (out, h), grads = _values_and_grads(run, args, cotangents)
    (out_ref, h_ref), grads_ref = _reference(family)
    assert out.dtype == dtype and out.shape == out_ref.shape and h.dtype == jnp.float32 and h.shape == h_ref.shape
    names = ("output", "final state") + tuple(f"d{name}" for name in NAMES[family])
    for name, got, want, primal in zip(names, (out, h, *grads), (out_ref, h_ref, *grads_ref), (out, h, *args)):
        assert got.dtype == primal.dtype, name
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.isfinite(got).all(), name
        scale = np.abs(want).max()
        assert scale > 0, name
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCES[dtype] * scale, err_msg=name)


def test_kda_case_overflows_a_factored_decay():
    """The KDA case above is one a factored decay exp(cs_i) exp(-cs_j) could not compute: exp(-cs) over its first
    chunk overflows float32."""
    g = np.asarray(_inputs("kda", jnp.float32)[0][3], np.float32)
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(-np.cumsum(g[:, :CHUNK], axis=1))).any()


@pytest.mark.parametrize("driver,dtype", [("loop", jnp.float32), ("grid", jnp.float32), ("loop", jnp.bfloat16)])
def test_linear_scan_kernel_equals_the_associative_scan(driver, dtype):
    """RG-LRU's diagonal recurrence h_t = a_t h_{t-1} + b_t over the same packed 37 tokens, channels [3 heads, 5],
    an initial state: the loop driver (GPU's) through linear_scan(impl="pallas"); the grid driver (TPU's: chunks of
    8 rows in order, the backward's pass over them from the last) called directly on the steps the entry point
    makes of the segments (a = 0 where a sequence starts, padding a = 1, b = 0). Output, final state and the
    gradients of a, b and h0 against impl="chunked" (an associative scan): within the module's tolerances."""
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    shape = (2, T, 3, 5)
    a = jax.nn.sigmoid(jax.random.normal(keys[0], shape)).astype(dtype)
    b = jax.random.normal(keys[1], shape).astype(dtype)
    h0 = jax.random.normal(keys[2], (2, 3, 5))
    segments = jnp.concatenate([_segments(), jnp.asarray(np.repeat([1, 2], [16, T - 16])[None], jnp.int32)])
    cotangents = (jax.random.normal(keys[3], shape), jax.random.normal(keys[4], (2, 3, 5)))

    def by_kernel(a, b, h0, segments):
        real, starts = (x[..., None, None] for x in sequence_starts(segments))
        a, b = jnp.where(starts, 0.0, jnp.where(real, a, 1.0)), jnp.where(real, b, 0.0)
        out, h = scan_kernel.linear_scan(a, b, h0, chunk=8, backend="tpu", interpret=True)
        return out.astype(dtype), h

    entry = lambda impl: lambda a, b, h0, segments: linear_scan(a, b, segment_ids=segments, initial_state=h0,
                                                                impl=impl)
    got, got_grads = _values_and_grads(entry("pallas") if driver == "loop" else by_kernel, (a, b, h0), cotangents,
                                       segments)
    want, want_grads = _values_and_grads(entry("chunked"), (a, b, h0), cotangents, segments)
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32
    for name, g, w in zip(("output", "final state", "da", "db", "dh0"), got + got_grads, want + want_grads):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCES[dtype] * np.abs(w).max(), err_msg=name)


def test_wkv_grid_driver_equals_the_chunked_form():
    """RWKV's WKV by the TPU driver (chunks of 8 rows, the carry in scratch; interpreted; tests/test_wkv.py runs the
    loop driver through the entry point) over the module's packed 37 tokens, 6 channels, keys up to ~10, from a given
    state: output, final state and the gradients of w, u, k, v and the state against the chunked form, 1e-5 of each
    one's largest magnitude."""
    keys = jax.random.split(jax.random.PRNGKey(2), 8)
    w, u = jnp.exp(jax.random.normal(keys[0], (6,))), jax.random.normal(keys[1], (6,))
    k, v = 3 * jax.random.normal(keys[2], (1, T, 6)), jax.random.normal(keys[3], (1, T, 6))
    state = (jax.random.normal(keys[4], (1, 6)), 1 + jax.random.uniform(keys[5], (1, 6)),
             jax.random.normal(keys[6], (1, 6)))
    ct = jax.random.normal(keys[7], (4, 1, T, 6))
    cotangents = (ct[0], tuple(c[:, 0] for c in ct[1:]))

    def by_kernel(w, u, k, v, state, segments):
        real, starts = sequence_starts(segments)
        return wkv_kernel.wkv(w[None], u[None], k, v, real, starts, state, chunk=8, backend="tpu", interpret=True)

    def chunked(w, u, k, v, state, segments):
        return wkv_ops.wkv(w, u, k, v, segment_ids=segments, initial_state=state, impl="chunked", chunk_size=8)

    got, got_grads = _values_and_grads(by_kernel, (w, u, k, v, state), cotangents)
    want, want_grads = _values_and_grads(chunked, (w, u, k, v, state), cotangents)
    for g, r in zip(jax.tree.leaves((got, got_grads)), jax.tree.leaves((want, want_grads))):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * float(jnp.abs(r).max()))


def test_row_loop_chunk_is_checked_on_tpu():
    with pytest.raises(ValueError, match=r"^mixer_chunk_size=12: the Pallas linear-scan kernel on tpu .* of 8"):
        scan_kernel.linear_scan(jnp.ones((1, 16, 4)), jnp.ones((1, 16, 4)), chunk=12, backend="tpu", interpret=True)
    row_loop.check_chunk(12, "gpu", "linear-scan")  # the loop driver reads whole rows: any chunk
    row_loop.check_chunk(64, "tpu", "linear-scan")


@pytest.mark.parametrize("chunk,backend,message", [
    (48, "cpu", "power of two >= 8"), (4, "cpu", "power of two >= 8"), (8, "gpu", "power of two >= 16"),
    (64, "tpu", "multiple of 128"), (16.0, "cpu", "power of two")])
def test_chunk_is_a_validated_tile(chunk, backend, message):
    with pytest.raises(ValueError, match=f"^mixer_chunk_size={chunk}: the Pallas SSD kernel on {backend} needs "
                                         f".*{message}.*ModelConfig.execution.mixer_chunk_size") as error:
        ssd_kernel.check_chunk(chunk, backend)
    assert "\n" not in str(error.value)
    for ok, backend in ((8, "cpu"), (16, "gpu"), (256, "tpu")):
        ssd_kernel.check_chunk(ok, backend)


@pytest.mark.parametrize("kind", ["rglru", "mamba", "rwkv"])
def test_a_recurrent_model_trains_through_the_kernel(kind):
    """A tiny RG-LRU (recurrent blocks [B, T, heads, head dim]), Mamba (the selective scan's chunks [B, L, E, S]) or
    RWKV (WKV over [B, T, C]) + attention model with
    mixer_impl="pallas": the loss and every parameter's gradient over a packed, padded batch equal
    mixer_impl="chunked"'s (1e-5 of the largest), so the layer hands the kernel its scan as the chunked form gets it."""
    cfg = tiny("llama", mixer_pattern=(kind, "attention"), mixer_chunk_size=8, mamba=dict(state_size=4))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 64, (2, 12)), jnp.int32)
    seg = jnp.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12])
    params = nn.meta.unbox(DecoderLM(cfg).init(jax.random.PRNGKey(0), tokens)["params"])

    def loss_and_grads(impl):
        model = DecoderLM(cfg.replace(mixer_impl=impl))
        loss = lambda p: jnp.sum(jnp.square(model.apply({"params": p}, tokens, segment_ids=seg).logits)
                                 * (seg > 0)[..., None])
        return jax.jit(jax.value_and_grad(loss))(params)

    (got, grads), (want, want_grads) = loss_and_grads("pallas"), loss_and_grads("chunked")
    np.testing.assert_allclose(got, want, rtol=1e-5)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want_grads))
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * scale)
