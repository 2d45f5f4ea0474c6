"""The flash-attention kernels compiled by the real compilers, from this CPU machine.

Every kernel variant the attention entry point reaches (`benchmarks.gpu_registers.VARIANTS`:
bidirectional, causal, cross-attention with T != S, packed segments, window, ALiBi, soft-cap,
GQA, MQA, and all features at once for self- and cross-attention), bf16, H 64 and 128, at the
default block sizes, through `dot_product_attention(impl="pallas")` in `jax.jit`: compiled
by libtpu for a v5p-8 slice (Mosaic) and by XLA's CUDA plugin for one H100 (Triton, register
spilling refused). Each compile is of the gradients, so it holds the forward kernel (the
custom VJP's forward is the primal's kernel) and the dQ and dK/dV kernels. Also: the context-
parallel ring with the kernels as its blocks (traced position shifts; impl "auto" picks them)
under a context=2 mesh of two v5p chips and of two H100s of one host; the GPU forward kernel's
register headroom (when ptxas is installed) and fp32 refused on Triton. Attention dropout in the
kernels (with every mask feature) compiles for both targets.
"""
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import gpu_registers
from benchmarks.gpu_registers import REFUSE_SPILLS, VARIANTS
from tfm.kernels import flash_attention as fa
from tfm.ops import pallas, select
from tfm.ops import delta_rule as delta_ops
from tfm.ops import ssd as ssd_ops
from tfm.ops import wkv as wkv_ops
from tfm.ops.linear_scan import linear_scan
from tfm.ops.attention import alibi_slopes, dot_product_attention
from tfm.parallel import flax_rules, make_rules
from tfm.parallel.mesh import MeshConfig, make_mesh
from tfm.preflight.targets import parse_target

KERNEL_CALLS = {"v5p-8": 'custom_call_target="tpu_custom_call"',
                "h100-1": 'custom_call_target="__gpu$xla.gpu.triton"'}
HEADROOM = 16  # registers the GPU forward kernel keeps free at the defaults (255 - 239)


@functools.cache
def _devices(target: str):
    """Compile-only devices of `target`; skips when its compiler plugin is not installed
    (`make test` installs both)."""
    try:
        return tuple(parse_target(target).devices())
    except ValueError as error:  # tfm.preflight.require_plugin: names the pip command
        pytest.skip(str(error))


def _kernels(hlo: str, target: str) -> list[str]:
    """Sorted kernel names (fwd, dq, dkv) of the Pallas custom calls in compiled HLO text."""
    lines = [line for line in hlo.splitlines() if KERNEL_CALLS[target] in line]
    return sorted(re.search(r"flash_attention_(fwd|dkv|dq)", line).group(1) for line in lines)


# Every mask feature alone at H 128; at H 64 (where registers are tighter per tile) the combinations that
# hold every single feature, which spill first, and BERT's bidirectional case.
AT_64 = ("bidirectional", "causal_window_segments_alibi", "all", "cross_all")
SHAPES = [(v, 128) for v in VARIANTS] + [(v, 64) for v in VARIANTS if v.name in AT_64]


@pytest.mark.parametrize("variant,head_dim", SHAPES, ids=[f"{v.name}-{h}" for v, h in SHAPES])
@pytest.mark.parametrize("target", list(KERNEL_CALLS))
def test_kernels_compile(target, variant, head_dim):
    options = REFUSE_SPILLS if target == "h100-1" else None  # a spilling kernel raises
    compiled = gpu_registers.compile_attention(variant, head_dim, _devices(target), compiler_options=options)
    assert _kernels(compiled.as_text(), target) == ["dkv", "dq", "fwd"]


# BERT's attention (H 64, MHA, padding segment ids) and every mask feature with GQA at H 128. At H 64 with
# every feature the Triton dK/dV kernel spills 12 bytes with dropout (255 registers; 233 without dropout).
DROPOUT_CASES = {"bert_h64": (64, 4, {}),
                 "all_gqa_h128": (128, 2, dict(causal=True, window=96, softcap=30.0, alibi_slopes=alibi_slopes(4)))}


@pytest.mark.parametrize("case", list(DROPOUT_CASES))
@pytest.mark.parametrize("target", list(KERNEL_CALLS))
def test_kernels_with_dropout_compile(target, case):
    """Attention dropout in the kernels (`tfm.ops.pallas.attention`, the seed from an rng), bf16, the
    gradients under a batch-split mesh: the three kernels compile for a v5p-8 slice and for an H100
    without register spills."""
    head_dim, K, features = DROPOUT_CASES[case]
    devices = _devices(target)
    mesh = make_mesh(MeshConfig(), devices)
    B, T, N = len(devices), 512, 4
    batch = NamedSharding(mesh, P("data"))
    q = jax.ShapeDtypeStruct((B, T, N, head_dim), jnp.bfloat16, sharding=batch)
    kv = jax.ShapeDtypeStruct((B, T, K, head_dim), jnp.bfloat16, sharding=batch)
    segments = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))

    def grads(q, k, v, segments, rng):
        loss = lambda q, k, v: pallas.attention(
            q, k, v, causal=features.get("causal", False), q_segment_ids=segments, kv_segment_ids=segments,
            scale=head_dim ** -0.5, dropout_rate=0.1, dropout_rng=rng,
            **{name: value for name, value in features.items() if name != "causal"}).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    options = REFUSE_SPILLS if target == "h100-1" else None
    with jax.set_mesh(mesh):
        compiled = jax.jit(grads).lower(q, kv, kv, segments, rng).compile(compiler_options=options)
    assert _kernels(compiled.as_text(), target) == ["dkv", "dq", "fwd"]


@pytest.mark.parametrize("target,kernel_calls", [("v5p-8", "v5p-8"), ("h100-2", "h100-1")])
def test_context_parallel_ring_compiles_with_the_kernels(target, kernel_calls):
    """Causal packed-segment GQA with a window and ALiBi, bf16, by ring over context=2, impl "auto"
    (`select.choose_context_impl`: the kernels on TPU and bf16 GPU): the three kernels in the
    compiled gradients, the blocks passed on by collective permutes."""
    mesh = make_mesh(MeshConfig(data=1, context=2), _devices(target)[:2])
    B, T, N, K, H = 1, 1024, 4, 2, 128
    seq = NamedSharding(mesh, P(None, "context"))
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=seq)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16, sharding=seq)
    segments = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=seq)

    def grads(q, k, v, segments):
        loss = lambda q, k, v: dot_product_attention(
            q, k, v, causal=True, q_segment_ids=segments, kv_segment_ids=segments, window=300,
            alibi_slopes=alibi_slopes(N), impl="auto", context_strategy="ring").astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    options = REFUSE_SPILLS if target.startswith("h100") else None
    with jax.set_mesh(mesh), nn.logical_axis_rules(flax_rules(make_rules("context", activations=True))):
        hlo = jax.jit(grads).lower(q, kv, kv, segments).compile(compiler_options=options).as_text()
    assert set(_kernels(hlo, kernel_calls)) == {"dkv", "dq", "fwd"}  # kernel_calls: its custom-call target
    assert "collective-permute" in hlo


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_forward_register_headroom(head_dim):
    """ptxas -v on the forward kernel with every mask feature: <= 255 - HEADROOM registers."""
    if gpu_registers.ptxas_path() is None:
        pytest.skip("no ptxas (nvidia-cuda-nvcc-cu12 in the compile-only plugin folder)")
    variant = next(v for v in VARIANTS if v.name == "all")
    found = gpu_registers.kernel_registers(variant, head_dim, _devices("h100-1"), backward=False)
    forward = found["flash_attention_fwd"]
    print(f"H {head_dim}: forward {forward}")
    assert forward.threads == 32 * fa.Launch().num_warps
    assert forward.spill_stores == forward.spill_loads == 0
    assert forward.registers <= gpu_registers.MAX_REGISTERS - HEADROOM, forward


def test_triton_refuses_fp32():
    """Triton's fp32 dot runs off the tensor cores and spills: a one-line error names the fixes;
    interpret mode (the CPU tests) and bf16/fp16 are unaffected."""
    q = jnp.zeros((1, 64, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"^flash attention on GPU .*float32.*bfloat16.*impl='xla'") as error:
        fa.flash_attention(q, q, q, backend="gpu", interpret=False)
    assert "\n" not in str(error.value)
    for dtype in (jnp.bfloat16, jnp.float16):  # lowering only: the check passes these
        x = jnp.zeros((1, 64, 2, 64), dtype)
        jax.jit(functools.partial(fa.flash_attention, backend="gpu", interpret=False)).trace(x, x, x)
    out = fa.flash_attention(q, q, q, backend="gpu", interpret=True)
    assert out.shape == q.shape and out.dtype == jnp.float32


def test_entry_point_refuses_fp32_on_an_h100_and_auto_picks_xla():
    with pytest.raises(ValueError, match="flash attention on GPU"):
        gpu_registers.compile_attention(VARIANTS[1], 64, _devices("h100-1"), dtype="float32")
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)
    with jax.set_mesh(make_mesh(MeshConfig(), _devices("h100-1"))):
        assert select.choose_impl(q, q) == "xla"
        bf16 = q.update(dtype=jnp.bfloat16)
        assert not select.cuda_present()  # compile-only: JAX cannot lower cuDNN calls here
        assert select.choose_impl(bf16, q) == "pallas"
        assert (select.choose_context_impl(q), select.choose_context_impl(bf16)) == ("chunked", "pallas")


@pytest.mark.parametrize("target", ["h100-1", "H200-1"])
def test_auto_on_a_hopper_gpu_picks_cudnn_then_the_hopper_kernels(monkeypatch, target):
    """The rules measured on an H100 and an H200 (RESULTS.md), JAX's CUDA libraries assumed present:
    cuDNN where it computes the layer, else tfm's Hopper kernels, else Triton (sparse patterns, head
    dims over 128), else xla (fp32)."""
    monkeypatch.setattr(select, "cuda_present", lambda: True)
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32)
    with jax.set_mesh(make_mesh(MeshConfig(), _devices(target))):
        assert select.hopper_present()
        assert select.choose_impl(q, q) == "xla"
        assert select.choose_impl(q, q, dropout_rate=0.1) == "xla"
        bf16 = q.update(dtype=jnp.bfloat16)
        assert select.choose_impl(bf16, q) == "cudnn"
        for features in (dict(softcap=5.0), dict(window=8), dict(alibi=True), dict(segments=True),
                         dict(dropout_rate=0.1), dict(causal=True, dropout_rate=0.1)):
            assert select.choose_impl(bf16, q, **features) == "hopper", features
        assert select.choose_impl(bf16, q, causal=True, window=8) == "cudnn"
        assert select.choose_impl(bf16.update(shape=(1, 256, 2, 80)), q) == "cudnn"
        assert select.choose_impl(bf16.update(shape=(1, 256, 2, 68)), q) == "hopper"  # cuDNN: H % 8 != 0
        assert select.choose_impl(bf16, q, sparse=True) == "pallas"
        assert select.choose_impl(bf16.update(shape=(1, 256, 2, 256)), q, alibi=True) == "pallas"  # H > 128


def test_impl_hopper_is_refused_in_one_line_where_it_cannot_run():
    """A compile-only H100 (no CUDA libraries to load a Mosaic GPU kernel with) and a TPU: refused,
    naming what runs it; auto there never picks it."""
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    for target, where in (("h100-1", r"NVIDIA H100 80GB HBM3 \(gpu, compile-only\)"), ("v5p-8", r"\(tpu\)")):
        with jax.set_mesh(make_mesh(MeshConfig(), _devices(target))):
            assert not select.hopper_present() and select.choose_impl(q, q, alibi=True) == "pallas"
            with pytest.raises(ValueError, match=r"^impl='hopper' runs on H100/H200 GPUs .*" + where) as error:
                jax.jit(functools.partial(dot_product_attention, impl="hopper")).trace(q, q, q)
            assert "\n" not in str(error.value)


@pytest.mark.parametrize("target", ["v5p-8", "h100-1"])
def test_a_kernel_traced_for_accelerators_without_a_mesh_is_refused_not_interpreted(target):
    """impl="pallas" in a jit whose inputs live on compile-only TPU/GPU devices, with no current mesh,
    would have lowered the Pallas interpreter for them: refused in one line saying what to set. Under
    the mesh the same call lowers the real kernel."""
    mesh = make_mesh(MeshConfig(), _devices(target))
    q = jax.ShapeDtypeStruct((4, 128, 2, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    attend = jax.jit(functools.partial(dot_product_attention, impl="pallas", causal=True))
    with pytest.raises(ValueError, match=r"^impl='pallas' traced for (tpu|gpu) devices without a current mesh.*"
                                         r"jax.set_mesh\(mesh\)") as error:
        attend.trace(q, q, q)
    assert "\n" not in str(error.value)
    with jax.set_mesh(mesh):
        hlo = attend.trace(q, q, q).lower().compile().as_text()
    assert _kernels(hlo, target)


def test_the_kernels_carry_their_cost_for_the_cost_model():
    """XLA's TPU cost model sees a Pallas call only through its cost estimate: causal attention over
    512 tokens in 128-blocks visits 10 of 16 tiles, and a train step of it costs the three kernels'
    products there, 2 x (2 + 3 + 4) x 128 x 128 x H FLOPs per tile and head (the closed form), plus
    XLA's own few elementwise FLOPs (under 1%)."""
    B, T, N, H = 1, 512, 2, 128
    mesh = make_mesh(MeshConfig(), _devices("v5p-8")[:1])
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    attend = functools.partial(fa.flash_attention, causal=True, backend="tpu", interpret=False,
                               block_sizes=fa.BlockSizes(128, 128))
    per_tile = 2 * 128 * 128 * H * B * N * 10
    forward = jax.jit(attend).trace(q, q, q).lower().compile().cost_analysis()
    assert forward["flops"] == 2 * per_tile and forward["transcendentals"] == 128 * 128 * B * N * 10
    step = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    flops = step.trace(q, q, q).lower().compile().cost_analysis()["flops"]
    assert 9 * per_tile <= flops < 1.01 * 9 * per_tile, flops / per_tile


@pytest.mark.parametrize("target,kernel_calls,chunk,delta_chunk,delta_dim", [("v5p-8", "v5p-8", 128, 128, 128),
                                                                              ("h100-2", "h100-1", 64, 16, 16)])
def test_mixer_kernels_compile(target, kernel_calls, chunk, delta_chunk, delta_dim):
    """The linear-time mixers' kernels through their entry points (impl="pallas"), bf16, the gradients (so every
    forward and backward kernel), 2 heads, packed segments, an initial state, a length that is not a chunk
    multiple: Mamba-2's SSD (head dim 64, state 128, one group, chunks of `chunk`) and the gated delta rule with
    a decay per head and one per key channel (KDA; key and value head dims `delta_dim`, chunks of `delta_chunk`),
    under a tensor=2 mesh of two v5p chips (the grid driver, Mosaic) and of two H100s (the loop driver, Triton,
    register spilling refused): each device runs the kernels on its own head (SSD's group repeated for it), inside
    shard_map. On the H100 the delta rule's kernels fit the registers only at small head dims
    (tfm.kernels.delta_rule, tfm.kernels.kda). Beside them RG-LRU's linear scan
    (fp32, 2 heads of 256 channels, TPU blocks of `chunk` rows), Mamba's selective scan (bf16, 512 channels of
    state 16, 256 on each device, the fused kernel a chunk at a time) and RWKV's WKV (fp32, 512
    channels, 256 on each device): their forward and reverse (backward) passes."""
    mesh = make_mesh(MeshConfig(data=1, tensor=2), _devices(target)[:2])
    B, T, N, H, S, Dk = 2, 200, 2, 64, 128, delta_dim
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    f32 = functools.partial(spec, dtype=jnp.float32)
    total = lambda outs: sum(out.astype(jnp.float32).sum() for out in outs)

    def grads(ssd_args, delta_args, kda_args, scan_args, selective_args, wkv_args, segments):
        ssd_loss = lambda x, dt, A, b, c, h0: total(ssd_ops.ssd(
            x, dt, A, b, c, initial_state=h0, segment_ids=segments, impl="pallas", chunk_size=chunk))
        delta_loss = lambda q, k, v, g, beta, h0: total(delta_ops.gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, segment_ids=segments, impl="pallas", chunk_size=delta_chunk))
        scan_loss = lambda a, b, h0: total(linear_scan(a, b, initial_state=h0, segment_ids=segments, impl="pallas",
                                                       chunk_size=chunk))
        selective_loss = lambda x, dt, A, b, c, h0: total(ssd_ops.selective_scan(
            x, dt, A, b, c, initial_state=h0, segment_ids=segments, impl="pallas", chunk_size=chunk))
        wkv_loss = lambda w, u, k, v, state: total(jax.tree.leaves(wkv_ops.wkv(
            w, u, k, v, initial_state=state, segment_ids=segments, impl="pallas", chunk_size=chunk)))
        return (jax.grad(ssd_loss, argnums=tuple(range(6)))(*ssd_args),
                jax.grad(delta_loss, argnums=tuple(range(6)))(*delta_args),
                jax.grad(delta_loss, argnums=tuple(range(6)))(*kda_args),
                jax.grad(scan_loss, argnums=(0, 1, 2))(*scan_args),
                jax.grad(selective_loss, argnums=tuple(range(6)))(*selective_args),
                jax.grad(wkv_loss, argnums=tuple(range(5)))(*wkv_args))

    ssd_args = (spec((B, T, N, H)), f32((B, T, N)), f32((N,)), spec((B, T, 1, S)), spec((B, T, 1, S)),
                f32((B, N, H, S)))
    delta_args = (spec((B, T, N, Dk)), spec((B, T, N, Dk)), spec((B, T, N, Dk)), f32((B, T, N)), f32((B, T, N)),
                  f32((B, N, Dk, Dk)))
    kda_args = delta_args[:3] + (f32((B, T, N, Dk)),) + delta_args[4:]  # g per key channel
    scan_args = (f32((B, T, N, 256)), f32((B, T, N, 256)), f32((B, N, 256)))
    E = 512
    selective_args = (spec((B, T, E)), spec((B, T, E)), f32((E, 16)), spec((B, T, 16)), spec((B, T, 16)),
                      f32((B, E, 16)))
    wkv_args = (f32((E,)), f32((E,)), f32((B, T, E)), f32((B, T, E)), (f32((B, E)),) * 3)
    with jax.set_mesh(mesh):
        hlo = jax.jit(grads).lower(ssd_args, delta_args, kda_args, scan_args, selective_args, wkv_args,
                                   spec((B, T), jnp.int32)).compile(
            compiler_options=REFUSE_SPILLS if kernel_calls == "h100-1" else None).as_text()
    calls = [line for line in hlo.splitlines() if KERNEL_CALLS[kernel_calls] in line]
    pattern = r"(ssd_fwd|ssd_bwd_[a-z]+|gated_delta_fwd|gated_delta_bwd_[a-z]+|kda_fwd|kda_bwd_[a-z]+|" \
              r"linear_scan_[a-z]+|wkv_[a-z]+|selective_scan_[a-z]+)"
    assert sorted(re.search(pattern, line).group(1) for line in calls) == [
        "gated_delta_bwd_chunk", "gated_delta_bwd_state", "gated_delta_fwd", "kda_bwd_chunk", "kda_bwd_state",
        "kda_fwd", "linear_scan_bwd", "linear_scan_fwd",
        "selective_scan_bwd", "selective_scan_fwd", "selective_scan_fwd",  # the chunk's forward again in its backward
        "ssd_bwd_across", "ssd_bwd_intra", "ssd_bwd_state", "ssd_fwd", "wkv_bwd", "wkv_fwd"]
    chunked = [line for line in calls if re.search(r"(ssd|gated_delta|kda)_", line)]
    assert all(f"bf16[{B},1," in line for line in chunked)  # per device: [B, N / 2, T, head dim]
    # per device: one RG-LRU head's state, and Mamba's E / 2 channels of state 16
    assert all(f"f32[{B},1,256]" in line for line in calls if "linear_scan_" in line)
    assert all(f"f32[{B},1,{E // 2}]" in line for line in calls if "selective_scan_" in line)
    assert all(f"f32[{B},1,{E // 2}]" in line for line in calls if "wkv_" in line)  # per device: half the channels
