"""The flash-attention forward kernel for Hopper GPUs (sm_90a) in Pallas Mosaic GPU.

Layout: q [B, T, N, H], k and v [B, S, K, H] (bf16 or fp16), G = N // K, as at tfm's entry point;
the mask semantics are those of `tfm.kernels.flash_attention` (causal, window, segment ids with
0 = padding, soft-cap; rows with no visible key give 0), and each tile's masks are that module's
`tile_mask`, its visible key blocks `kv_block_range`.

One thread block per (batch row, 128 queries, query head), three warpgroups:
  0, 1  compute: 64 query rows each. Q stays in shared memory; per key block S = Q Kᵀ and
        O += P V run on the tensor cores (wgmma, fp32 accumulators in registers), the online
        softmax between them.
  2     memory: streams the key/value blocks both compute warpgroups need (the union of their
        visible ranges) by TMA into a ring of `STAGES` slots, refilling a slot once both have
        released it (a "consumed" barrier of two arrivals).
A compute warpgroup waits on every streamed block (so the barriers' phases stay in step) and
computes only those it can see. The kernel writes o and the log-sum-exp [B, N, T] (fp32).

Not yet here (refused in one line): ALiBi, attention dropout, the backward; `auto` and the
entry point never pick this driver until `benchmarks.gpu_check` has measured it correct and fast
on a Hopper GPU (benchmarks/RESULTS.md). On a CPU it runs in Mosaic GPU's interpreter
(`interpret=True`), which models the warpgroups, barriers and TMA copies.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tfm.kernels.flash_attention import TileConfig, kv_block_range, pad_to, tile_mask
from tfm.kernels.tiles import GPU_DTYPES

BLOCK_Q = 64           # query rows per compute warpgroup (one wgmma M)
COMPUTE_WARPGROUPS = 2
STAGES = 2             # key/value slots in flight


def _block_kv(head_dim: int) -> int:
    """Keys per block: 128 up to H 128 (the shared memory of the ring and Q fits), 64 beyond."""
    return 128 if head_dim <= 128 else 64


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # the interpreter's one entry
    return InterpretGPUParams()


def _smem_tile(shape, dtype):
    """A shared-memory buffer in wgmma's operand layout: 8×64 tiles, 128-byte swizzle."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


class _Registers:
    """Register arrays in wgmma's layouts, and the tensor-core products, when compiled; plain arrays
    and jnp products in the interpreter, which models the threads, barriers and TMA copies but neither
    register layouts nor a transposed wgmma operand."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def cast(self, x, layout):
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, shape, dimension: int):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dimension)
        return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)

    def load(self, ref, layout):
        return ref[...] if self.interpret else plgpu.load(ref, (), layout=layout)

    def product(self, a, b_ref, transpose_b: bool, shape):
        """fp32 a @ b (a a shared-memory ref or a register array; b [K, n], or [n, K] transposed)."""
        if self.interpret:
            a = a if isinstance(a, jax.Array) else a[...]
            return lax.dot_general(a, b_ref[...], (((1,), (1 if transpose_b else 0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        b = plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            return acc_ref[...]
        return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _row(x, shape):
    """A per-query-row vector [bq] broadcast over the key columns of a [bq, bk] tile."""
    return lax.broadcast_in_dim(x, shape, [0])


def _forward(q, k, v, q_seg, kv_seg, cfg: TileConfig, interpret: bool):
    """o [B, Tp, N, H], lse [B, N, Tp] for padded q [B, Tp, N, H], k, v [B, Sp, K, H] and
    q_seg [B, Tp], kv_seg [B, Sp] int32 (or None)."""
    B, Tp, N, H = q.shape
    Sp = k.shape[1]
    bq, bk, G = cfg.block_q, cfg.block_kv, cfg.groups
    num_kv, rows_per_block = Sp // bk, COMPUTE_WARPGROUPS * bq
    dtype, tile = q.dtype, (bq, bk)
    segments = q_seg is not None
    regs = _Registers(interpret)
    row_layout, column_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, smem, loaded, consumed):
        q_smem, k_smem, v_smem, lse_smem, q_seg_smem, kv_seg_smem = smem
        q_bar, q_seg_bar, k_bar, v_bar, seg_bar = loaded
        k_done, v_done = consumed
        b, qt, n = lax.axis_index("batch"), lax.axis_index("q_block"), lax.axis_index("head")
        wg = lax.axis_index("wg")
        # the key blocks either warpgroup sees: from the first one's lo to the second one's hi
        first, _ = kv_block_range(qt * COMPUTE_WARPGROUPS, cfg, bq, bk, num_kv)
        _, last = kv_block_range(qt * COMPUTE_WARPGROUPS + COMPUTE_WARPGROUPS - 1, cfg, bq, bk, num_kv)
        steps = jnp.maximum(last - first, 0)

        @pl.when(wg == COMPUTE_WARPGROUPS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(n, jnp.int32(G))

            def issue(step, slot):
                keys = pl.ds((first + step) * bk, bk)
                plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kv_head], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kv_head], v_smem.at[slot], v_bar.at[slot])
                if segments:
                    plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, keys], kv_seg_smem.at[slot], seg_bar.at[slot])

            for slot in range(STAGES):
                pl.when(slot < steps)(functools.partial(issue, slot, slot))

            @pl.loop(0, jnp.maximum(steps - STAGES, 0))
            def _refill(i):
                slot = lax.rem(i, jnp.int32(STAGES))
                plgpu.barrier_wait(k_done.at[slot])
                plgpu.barrier_wait(v_done.at[slot])
                issue(i + STAGES, slot)

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            block = qt * COMPUTE_WARPGROUPS + wg
            q_start = block * bq
            rows = pl.ds(q_start, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[b, rows, n], q_smem.at[wg], q_bar.at[wg])
            if segments:
                plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], q_seg_smem.at[wg], q_seg_bar.at[wg])
                plgpu.barrier_wait(q_seg_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            q_segs = None
            if segments:
                q_segs = _row(regs.load(q_seg_smem.at[wg], row_layout), tile)
            lo, hi = kv_block_range(block, cfg, bq, bk, num_kv)

            def wait(slot):
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                if segments:
                    plgpu.barrier_wait(seg_bar.at[slot])

            def release(slot):
                plgpu.barrier_arrive(k_done.at[slot])
                plgpu.barrier_arrive(v_done.at[slot])

            def skip(step, carry):
                slot = lax.rem(step, jnp.int32(STAGES))
                wait(slot)
                release(slot)
                return carry

            def attend(step, carry):
                m, l, acc = carry
                slot = lax.rem(step, jnp.int32(STAGES))
                wait(slot)

                s = regs.product(q_smem.at[wg], k_smem.at[slot], True, tile) * cfg.scale
                if cfg.softcap is not None:
                    s = cfg.softcap * jnp.tanh(s / cfg.softcap)
                kv_start = (first + step) * bk
                q_pos, kv_pos = q_start + regs.iota(tile, 0), kv_start + regs.iota(tile, 1)
                kv_segs = None
                if segments:
                    kv_segs = lax.broadcast_in_dim(regs.load(kv_seg_smem.at[slot], column_layout), tile, [1])
                s, visible = tile_mask(s, q_pos, kv_pos, q_segs, kv_segs, None, cfg)
                m_new = jnp.maximum(m, s.max(axis=1))
                p = jnp.exp(s - _row(m_new, tile))
                if visible is not None:  # a row with nothing visible yet has m_new = -1e30: exp(0) there
                    p = jnp.where(visible, p, 0.0)
                correction = jnp.exp(m - m_new)
                l = l * correction + p.sum(axis=1)

                pv = regs.product(p.astype(dtype), v_smem.at[slot], False, (bq, H))
                release(slot)
                return m_new, l, acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv

            vector = lambda value: regs.cast(jnp.full((bq,), value, jnp.float32), row_layout)
            carry = (vector(-1e30), vector(0.0), regs.cast(jnp.zeros((bq, H), jnp.float32), plgpu.Layout.WGMMA))
            lo_step, hi_step = jnp.clip(lo - first, 0, steps), jnp.clip(hi - first, 0, steps)
            carry = lax.fori_loop(0, lo_step, skip, carry)
            m, l, acc = lax.fori_loop(lo_step, jnp.maximum(hi_step, lo_step), attend, carry)
            lax.fori_loop(jnp.maximum(hi_step, lo_step), steps, skip, None)

            seen = l > 0.0
            inverse = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            q_smem.at[wg][...] = (acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(dtype)
            lse_smem.at[wg][...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[b, rows, n])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, n, rows])
            plgpu.wait_smem_to_gmem(0)

    def entry(q_ref, k_ref, v_ref, *refs):
        q_seg_ref, kv_seg_ref = refs[:2] if segments else (None, None)
        o_ref, lse_ref = refs[-2:]
        smem = (_smem_tile((COMPUTE_WARPGROUPS, bq, H), dtype), _smem_tile((STAGES, bk, H), dtype),
                _smem_tile((STAGES, bk, H), dtype), plgpu.SMEM((COMPUTE_WARPGROUPS, bq), jnp.float32),
                plgpu.SMEM((COMPUTE_WARPGROUPS, bq), jnp.int32) if segments else None,
                plgpu.SMEM((STAGES, bk), jnp.int32) if segments else None)
        loaded = (plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS),
                  plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS) if segments else None, plgpu.Barrier(num_barriers=STAGES),
                  plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=STAGES) if segments else None)
        consumed = (plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=STAGES),) * 2
        pl.run_scoped(lambda *scratch: kernel(q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, o_ref, lse_ref, *scratch),
                      smem, loaded, consumed, collective_axes="wg")

    operands = (q, k, v) + ((q_seg, kv_seg) if segments else ())
    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)),
        grid=(B, Tp // rows_per_block, N), grid_names=("batch", "q_block", "head"),
        num_threads=COMPUTE_WARPGROUPS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params() if interpret else None,
    )(*operands)


def flash_attention_forward(q, k, v, *, causal: bool = False, q_segment_ids=None, kv_segment_ids=None,
                            window: Optional[int] = None, softcap: Optional[float] = None,
                            scale: Optional[float] = None, alibi_slopes=None, dropout_rate: float = 0.0,
                            interpret: bool = False):
    """(o [B, T, N, H], lse [B, N, T] fp32, +inf on rows that see no key) of attention on a Hopper
    GPU; q [B, T, N, H], k, v [B, S, K, H] in bf16 or fp16, H a multiple of 64 up to 256 after
    padding (smaller H is padded to 64). interpret: run Mosaic GPU's interpreter (CPU)."""
    for name, unsupported in (("ALiBi", alibi_slopes is not None), ("attention dropout", dropout_rate > 0.0)):
        if unsupported:
            raise ValueError(f"the Hopper flash-attention driver does not implement {name} yet; use "
                             f"impl='pallas' (the Triton driver) or 'xla'")
    dtypes = sorted({jnp.dtype(x.dtype).name for x in (q, k, v)} - set(GPU_DTYPES))
    if dtypes or len({q.dtype, k.dtype, v.dtype}) > 1:
        raise ValueError(f"the Hopper flash-attention driver takes q, k, v all bfloat16 or all float16, not "
                         f"{jnp.dtype(q.dtype).name}/{jnp.dtype(k.dtype).name}/{jnp.dtype(v.dtype).name}")
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    Hp = -(-H // 64) * 64
    if Hp > 256:
        raise ValueError(f"the Hopper flash-attention driver takes head dims up to 256, got {H}")
    bk = _block_kv(Hp)
    Tp, Sp = -(-T // (COMPUTE_WARPGROUPS * BLOCK_Q)) * COMPUTE_WARPGROUPS * BLOCK_Q, -(-S // bk) * bk
    q_seg, kv_seg = q_segment_ids, kv_segment_ids
    if kv_seg is not None and q_seg is None:  # key padding only: any non-zero id is visible
        kv_seg, q_seg = (kv_seg != 0).astype(jnp.int32), jnp.ones((B, T), jnp.int32)
    if kv_seg is not None:
        q_seg, kv_seg = pad_to(q_seg.astype(jnp.int32), 1, Tp), pad_to(kv_seg.astype(jnp.int32), 1, Sp)
    cfg = TileConfig(causal=causal, window=window, softcap=softcap, scale=float(H ** -0.5 if scale is None else scale),
                     kv_len=None if Sp == S or kv_seg is not None else S, segments=kv_seg is not None,
                     alibi=False, groups=N // K, block_q=BLOCK_Q, block_kv=bk, driver="hopper",
                     interpret=interpret)
    pad = lambda x, length: pad_to(pad_to(x, 1, length), 3, Hp)
    o, lse = _forward(pad(q, Tp), pad(k, Sp), pad(v, Sp), q_seg, kv_seg, cfg, interpret)
    return o[:, :T, :, :H], lse[:, :, :T]
