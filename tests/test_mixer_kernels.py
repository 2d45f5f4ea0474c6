"""The Pallas SSD kernels (tfm.kernels.ssd, interpreted on CPU) against the chunked JAX form (tfm.ops.ssd).

One case: 37 tokens in chunks of 16 (the last chunk partial), 4 heads reading 2 groups of B/C, packed
segments with padding on both ends, an initial state. Values (y, final state) and the gradients of x, dt, A,
B, C and the initial state: fp32 max-abs error <= 1e-5 of each quantity's largest magnitude, bf16 <= 1e-2. The
inputs are bf16 values, so bf16 and fp32 runs share one reference (the chunked form computes in fp32).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.kernels import ssd as kernel
from tfm.ops import ssd as ssd_ops
from tfm.ops.segments import sequence_starts

TOLERANCES = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}  # of the largest magnitude of each compared array
Bsz, T, N, P, G, S, CHUNK = 2, 37, 4, 8, 2, 16, 16


def _inputs(dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    x = jax.random.normal(keys[0], (Bsz, T, N, P))
    dt = jax.nn.softplus(jax.random.normal(keys[1], (Bsz, T, N)))
    A = -jnp.exp(jax.random.normal(keys[2], (N,)))
    B, C = (jax.random.normal(k, (Bsz, T, G, S)) for k in keys[3:5])
    h0 = jax.random.normal(keys[5], (Bsz, N, P, S))
    segments = np.ones((Bsz, T), np.int32)
    segments[0, 10:25], segments[0, 25:] = 2, 0  # a second sequence mid-chunk, right padding
    segments[1, :3], segments[1, 20:] = 0, 3  # left padding, a sequence starting mid-chunk
    cotangents = (jax.random.normal(keys[6], (Bsz, T, N, P)), jax.random.normal(keys[7], (Bsz, N, P, S)))
    # bf16 values in either dtype, so the one fp32 reference serves both (the chunked form computes in fp32)
    sequences = tuple(a.astype(jnp.bfloat16).astype(dtype) for a in (x, dt, B, C))
    return sequences[:2] + (A,) + sequences[2:] + (h0,), jnp.asarray(segments), cotangents


def _by_kernel(x, dt, A, B, C, h0, segments, backend):
    """ssd's inputs as the kernel takes them: dt 0 at padding, x * dt, the log decays, the sequence starts."""
    real, reset = sequence_starts(segments)
    dt = jnp.where(real[..., None], dt.astype(jnp.float32), 0)
    xdt = (x.astype(jnp.float32) * dt[..., None]).astype(x.dtype)
    return kernel.chunked_ssd(xdt, dt * A, B, C, reset, h0, chunk=CHUNK, backend=backend, interpret=True)


def _by_entry_point(x, dt, A, B, C, h0, segments, impl):
    return ssd_ops.ssd(x, dt, A, B, C, segment_ids=segments, initial_state=h0, impl=impl, chunk_size=CHUNK)


def _values_and_grads(run, args, segments, cotangents):
    def loss(*args):
        y, h = run(*args, segments)
        return jnp.sum(y.astype(jnp.float32) * cotangents[0]) + jnp.sum(h * cotangents[1]), (y, h)
    (_, values), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)
    return values, grads


@functools.cache
def _reference():
    args, segments, cotangents = _inputs(jnp.float32)
    return _values_and_grads(functools.partial(_by_entry_point, impl="chunked"), args, segments, cotangents)


@pytest.mark.parametrize("dtype,driver", [(jnp.float32, "loop"), (jnp.float32, "grid"), (jnp.bfloat16, "loop")],
                         ids=["fp32-loop", "fp32-grid", "bf16-loop"])
def test_kernel_equals_the_chunked_form(dtype, driver):
    """The loop driver (GPU's) through the entry point, ssd(impl="pallas") on CPU; the grid driver (TPU's: a
    sequential chunk axis, the state in scratch) called directly; both interpreted."""
    args, segments, cotangents = _inputs(dtype)
    run = (functools.partial(_by_entry_point, impl="pallas") if driver == "loop"
           else functools.partial(_by_kernel, backend="tpu"))
    (y, h), grads = _values_and_grads(run, args, segments, cotangents)
    (y_ref, h_ref), grads_ref = _reference()
    assert y.dtype == dtype and y.shape == (Bsz, T, N, P) and h.dtype == jnp.float32 and h.shape == (Bsz, N, P, S)
    names = ("y", "final state") + tuple(f"d{name}" for name in ("x", "dt", "A", "B", "C", "h0"))
    for name, got, want, primal in zip(names, (y, h, *grads), (y_ref, h_ref, *grads_ref), (y, h, *args)):
        assert got.dtype == primal.dtype, name
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        scale = np.abs(want).max()
        assert scale > 0, name
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCES[dtype] * scale, err_msg=name)


@pytest.mark.parametrize("chunk,backend,message", [
    (48, "cpu", "power of two >= 8"), (4, "cpu", "power of two >= 8"), (8, "gpu", "power of two >= 16"),
    (64, "tpu", "multiple of 128"), (16.0, "cpu", "power of two")])
def test_chunk_is_a_validated_tile(chunk, backend, message):
    with pytest.raises(ValueError, match=f"^mixer_chunk_size={chunk}: the Pallas SSD kernel on {backend} needs "
                                         f".*{message}.*ModelConfig.execution.mixer_chunk_size") as error:
        kernel.check_chunk(chunk, backend)
    assert "\n" not in str(error.value)
    for ok, backend in ((8, "cpu"), (16, "gpu"), (256, "tpu")):
        kernel.check_chunk(ok, backend)
