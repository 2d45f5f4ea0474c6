"""Split-K decode kernel (interpret mode on CPU) against the xla reference with the cache
fill expressed as key segment ids; fp32 max-abs <= 1e-5, bf16 <= 2e-2."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.kernels.decode_attention import decode_attention
from tfm.ops.attention import dot_product_attention


@pytest.mark.parametrize("N,K,S,splits,softcap,dtype", [
    (4, 4, 300, 3, None, jnp.float32),   # MHA, S not a multiple of splits * block
    (8, 1, 256, 2, 2.0, jnp.float32),    # MQA, soft-cap
    (4, 2, 200, 1, None, jnp.bfloat16),  # GQA 2, one split
])
def test_decode_matches_xla(N, K, S, splits, softcap, dtype):
    B, H = 3, 16
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (B, N, H)).astype(dtype)
    k, v = (jax.random.normal(key, (B, S, K, H)).astype(dtype) for key in keys[1:])
    lengths = jnp.array([S, 37, 0])  # full, partial, empty cache (-> 0)
    kv_seg = (jnp.arange(S)[None] < lengths[:, None]).astype(jnp.int32)
    ref = dot_product_attention(q[:, None], k, v, kv_segment_ids=kv_seg, softcap=softcap, impl="xla")[:, 0]
    out = jax.jit(lambda q, k, v, n: decode_attention(q, k, v, kv_lengths=n, softcap=softcap, num_splits=splits,
                                                      block_kv=32))(q, k, v, lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    atol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=0, atol=atol)
    assert np.all(np.asarray(out[2]) == 0.0)


def test_decode_validates_arguments():
    q, k = jnp.zeros((1, 2, 16)), jnp.zeros((1, 64, 2, 16))
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q, k, k, kv_lengths=jnp.array([4]), block_kv=48)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(q, k, k, kv_lengths=jnp.array([4]), num_splits=0)


@pytest.mark.parametrize("platform,backend,marker", [("cuda", "gpu", "xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")])
def test_decode_lowers_for_gpu_and_tpu(platform, backend, marker):
    q, k = jnp.zeros((2, 8, 128), jnp.bfloat16), jnp.zeros((2, 4096, 2, 128), jnp.bfloat16)
    f = jax.jit(lambda q, k, v: decode_attention(q, k, v, kv_lengths=jnp.array([4096, 100]), backend=backend,
                                               interpret=False))
    assert marker in f.trace(q, k, k).lower(lowering_platforms=(platform,)).as_text()
