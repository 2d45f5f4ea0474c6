"""Flash attention for Hopper GPUs (sm_90a) in Pallas Mosaic GPU: forward and a deterministic backward.

Layout: q [B, T, N, H], k and v [B, S, K, H] (bf16 or fp16), G = N // K, as at tfm's entry point;
the mask semantics are those of `tfm.kernels.flash_attention` (causal, window, segment ids with
0 = padding, ALiBi, soft-cap, dropout; rows with no visible key give 0). Every tile's masks are that module's
`tile_mask` and its visible blocks `kv_block_range` / `q_block_range`.

Each kernel runs three warpgroups per thread block:
  0, 1  compute: 64 rows each (queries in the forward and dQ, keys in dK/dV), held in shared
        memory; the products run on the tensor cores (wgmma, fp32 accumulators in registers).
  2     memory: streams the blocks of the other sequence that either compute warpgroup sees (the
        union of their visible ranges) by TMA into a ring of `STAGES` slots, refilling a slot once
        both have released it (a "consumed" barrier of two arrivals).
A compute warpgroup waits on every streamed block, so the barriers' phases stay in step, and
computes only the blocks it can see.

  forward  grid (B, T / 128, N): per key block S = Q Kᵀ, the online softmax, O += P V; writes o
           and the log-sum-exp [B, N, T] (fp32, +inf on rows that see no key).
  dQ       grid (B, T / 128, N): S and P again from lse, dP = dO Vᵀ, dS = P (dP - delta),
           dQ += dS K, with delta = rowsum(dO * O) computed before.
  dK/dV    grid (B, S / 128, K): each key block walks the G query heads of its key/value head and
           their visible query blocks: Pᵀ, dV += Pᵀ dO, dPᵀ = V dOᵀ, dK += dSᵀ Q. No atomics and
           no repeated K/V, so the gradients are deterministic.

Attention dropout regenerates each tile's keep mask from `tfm.kernels.dropout` (the other drivers'
hash of seed, batch row, query head and positions), never stored. The entry point calls it as
impl="hopper" (`tfm.ops.pallas`, per device under a mesh), and `auto` picks it on an H100/H200 where
cuDNN does not compute the layer (`tfm.ops.select`; measured in benchmarks/RESULTS.md). On a CPU it
runs in Mosaic GPU's interpreter (`interpret=True`), which models the warpgroups, barriers and TMA
copies (see `_Registers` for what it leaves out).
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from tfm.kernels import dropout as dropout_lib
from tfm.kernels.flash_attention import TileConfig, kv_block_range, pad_to, q_block_range, tile_mask
from tfm.kernels.tiles import GPU_DTYPES

ROWS = 64              # rows per compute warpgroup (one wgmma M)
COMPUTE_WARPGROUPS = 2
STAGES = 2             # blocks of the streamed sequence in flight
LENGTH_MULTIPLE = 128  # T and S are padded to this: whole thread blocks in every kernel
# The forward's schedule. "serial": each compute warpgroup runs QKᵀ, the softmax and PV in turn, every
# tile masked (measured correct on an H200, RESULTS.md). "pingpong": the two compute warpgroups take
# turns on the tensor cores (one's softmax overlaps the other's products), PV accumulates into the
# wgmma accumulator in place, and the key blocks wholly visible to a warpgroup skip the mask.
# Interpreter-tested only until benchmarks.gpu_check measures it ("tfm hopper pingpong" rows).
FORWARD_SCHEDULES = ("serial", "pingpong")
FORWARD_SCHEDULE = "serial"  # read when a call is traced; `forward_schedule` sets it for a block of code


@contextlib.contextmanager
def forward_schedule(name: str):
    """Calls traced inside use the forward schedule `name` (one of FORWARD_SCHEDULES), e.g. to time both."""
    global FORWARD_SCHEDULE
    if name not in FORWARD_SCHEDULES:
        raise ValueError(f"unknown Hopper forward schedule {name!r}; choose from {FORWARD_SCHEDULES}")
    saved, FORWARD_SCHEDULE = FORWARD_SCHEDULE, name
    try:
        yield
    finally:
        FORWARD_SCHEDULE = saved


BACKWARD_MAX_HEAD_DIM = 128  # beyond, the backward's tiles outgrow shared memory (wgmma's K is >= 64)


class _Blocks(NamedTuple):
    """Streamed block lengths, fitted to shared memory (227 KiB) per head dim: the forward's and
    dQ's key blocks, dK/dV's query blocks (the backward's only up to BACKWARD_MAX_HEAD_DIM)."""
    forward: int
    dq: int
    dkv: int

    @staticmethod
    def for_head_dim(h: int) -> "_Blocks":
        return _Blocks(128, 128, 64) if h <= BACKWARD_MAX_HEAD_DIM else _Blocks(64, 0, 0)


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # the interpreter's one entry
    return InterpretGPUParams()


class _Registers:
    """Register arrays in wgmma's layouts, and the tensor-core products, when compiled; plain arrays
    and jnp products in the interpreter, which models the threads, barriers and TMA copies but neither
    register layouts nor a transposed wgmma operand."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def cast(self, x, layout):
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def zeros(self, shape):
        return self.cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)

    def iota(self, shape, dimension: int):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dimension)
        return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)

    def rows(self, ref, shape):
        """A per-row vector [m] from shared memory, broadcast over the columns of an [m, n] tile."""
        x = ref[...] if self.interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))
        return lax.broadcast_in_dim(x, shape, [0])

    def columns(self, ref, shape):
        """A per-column vector [n] from shared memory, broadcast over the rows of an [m, n] tile."""
        x = ref[...] if self.interpret else plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0))
        return lax.broadcast_in_dim(x, shape, [1])

    def product(self, a, b_ref, transpose_b: bool, shape, issued=None):
        """fp32 a @ b: a [m, k] a shared-memory ref or a register array; b [k, n], or [n, k] transposed.
        issued(): called once the product is issued, before waiting for it."""
        if self.interpret:
            a = a if isinstance(a, jax.Array) else a[...]
            out = lax.dot_general(a, b_ref[...], (((1,), (1 if transpose_b else 0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
            if issued is not None:
                issued()
            return out
        b = plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            if issued is not None:
                issued()
            return acc_ref[...]
        return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

    def accumulate(self, acc, a, b_ref):
        """acc + a @ b: fp32 acc [m, n] and a [m, k] in registers, b [k, n] in shared memory; the
        product accumulates into acc's registers in place when compiled."""
        if self.interpret:
            return acc + lax.dot_general(a, b_ref[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, b_ref)
        return pl.run_state(run)(plgpu.ACC.init(acc))


def _operand(shape, dtype):
    """Shared memory in wgmma's operand layout: 8×64 tiles, 128-byte swizzle."""
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))


def _scores(s, cfg: TileConfig):
    """Scaled logits, soft-capped: (s, tanh(s / softcap) or None)."""
    s = s * cfg.scale
    if cfg.softcap is None:
        return s, None
    capped = jnp.tanh(s / cfg.softcap)
    return cfg.softcap * capped, capped


def _dropped(x, kept, cfg: TileConfig):
    """x * keep mask / (1 - rate) (0 where dropped); x itself without dropout (kept None)."""
    return x if kept is None else jnp.where(kept, x * (1.0 / (1.0 - cfg.dropout)), 0.0)


def _produce(steps, issue, done):
    """The memory warpgroup: issue(step, slot) for steps [0, steps) into slot step % STAGES, refilling
    a slot once each barrier of `done` has its arrivals for it, and waiting for the last ones."""
    plgpu.set_max_registers(40, action="decrease")
    for slot in range(STAGES):
        pl.when(slot < steps)(functools.partial(issue, slot, slot))

    @pl.loop(0, jnp.maximum(steps - STAGES, 0))
    def _refill(i):
        slot = lax.rem(i, jnp.int32(STAGES))
        for barrier in done:
            plgpu.barrier_wait(barrier.at[slot])
        issue(i + STAGES, slot)

    for slot in range(STAGES):  # the last release of each slot used: every phase of a barrier is observed
        @pl.when(slot < steps)
        def _drain():
            for barrier in done:
                plgpu.barrier_wait(barrier.at[slot])


def _consume(base, count, lo, spans, carry, loaded, done, idle=None):
    """A compute warpgroup over the streamed steps base + [0, count): waits on each, calls
    attend(step, slot, carry) for those in base + [lo, hi) (its visible blocks), releases each.
    spans: [(hi, attend)], consecutive ranges from lo, each with its own attend; idle(): called on
    each step the warpgroup skips (what a visited step does besides computing, such as taking turns)."""
    def wait(slot):
        for barrier in loaded:
            plgpu.barrier_wait(barrier.at[slot])

    def release(slot):
        for barrier in done:
            plgpu.barrier_arrive(barrier.at[slot])

    def skip(step, carry):
        slot = lax.rem(step, jnp.int32(STAGES))
        wait(slot)
        if idle is not None:
            idle()
        release(slot)
        return carry

    def visit(attend, step, carry):
        slot = lax.rem(step, jnp.int32(STAGES))
        wait(slot)
        carry = attend(step, slot, carry)
        release(slot)
        return carry

    start = jnp.clip(lo, 0, count)
    carry = lax.fori_loop(base, base + start, skip, carry)
    for hi, attend in spans:
        end = jnp.clip(hi, start, count)
        carry = lax.fori_loop(base + start, base + end, functools.partial(visit, attend), carry)
        start = end
    return lax.fori_loop(base + start, base + count, skip, carry)


def _load_own(copies, barrier, wg):
    """A compute warpgroup's own blocks: copies [(gmem, smem)] by TMA, copy i on barrier i·W + wg,
    then waits for all of them."""
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, barrier.at[i * COMPUTE_WARPGROUPS + wg])
    for i in range(len(copies)):
        plgpu.barrier_wait(barrier.at[i * COMPUTE_WARPGROUPS + wg])


def _barriers(n: int, present: bool = True):
    return plgpu.Barrier(num_barriers=n) if present else None


def _ring_done():
    return plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=STAGES)


def _store(values, smem, gmem):
    """Register tile -> shared memory -> global memory (TMA), waiting for the copy."""
    smem[...] = values
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, gmem)
    plgpu.wait_smem_to_gmem(0)


def _kernel(body, operands, out_type, grid, grid_names, interpret: bool):
    return plgpu.kernel(body, out_type=out_type, grid=grid, grid_names=grid_names,
                        num_threads=COMPUTE_WARPGROUPS + 1, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True),
                        interpret=_interpret_params() if interpret else None)(*operands)


# ------------------------------------------------------------------------- forward and dQ

def _query_major(q, k, v, q_seg, kv_seg, slopes, keys, cfg: TileConfig, interpret: bool, backward=None,
                 schedule: str = "serial"):
    """The forward kernel (backward None): (o [B, Tp, N, H], lse [B, N, Tp]); or the dQ kernel
    (backward = (do [B, Tp, N, H], lse, delta [B, N, Tp])): dq [B, Tp, N, H]. Padded operands:
    q [B, Tp, N, H], k, v [B, Sp, K, H], q_seg [B, Tp], kv_seg [B, Sp] int32 (or None), slopes
    [N, ROWS] fp32 (each head's ALiBi slope along a row; or None), keys [B, N, ROWS] int32 (each
    (batch row, head)'s dropout key along a row; or None). schedule: the forward's (FORWARD_SCHEDULES)."""
    B, Tp, N, H = q.shape
    bq, bk, G = ROWS, (_Blocks.for_head_dim(H).dq if backward else _Blocks.for_head_dim(H).forward), cfg.groups
    num_kv, tile, dtype = k.shape[1] // bk, (ROWS, bk), q.dtype
    segments, regs = q_seg is not None, _Registers(interpret)
    per_row = backward is not None  # dQ reads lse and delta per query row
    pingpong = not per_row and schedule == "pingpong"
    dropout = cfg.dropout > 0.0
    operands = (q, k, v) + ((q_seg, kv_seg) if segments else ()) + ((slopes,) if cfg.alibi else ()) + (
        (keys,) if dropout else ()) + (tuple(backward) if per_row else ())

    def kernel(refs, smem, loaded, done, turns):
        ins, outs = refs[:len(operands)], refs[len(operands):]
        q_ref, k_ref, v_ref = ins[:3]
        q_seg_ref, kv_seg_ref = ins[3:5] if segments else (None, None)
        slopes_ref = ins[3 + 2 * segments] if cfg.alibi else None
        keys_ref = ins[3 + 2 * segments + cfg.alibi] if dropout else None
        do_ref, lse_ref, delta_ref = ins[-3:] if per_row else (None,) * 3
        q_smem, do_smem, rows_smem, q_seg_smem, slope_smem, key_smem, k_smem, v_smem, kv_seg_smem = smem
        own_loaded, k_bar, v_bar, seg_bar = loaded
        b, qt, n, wg = (lax.axis_index(a) for a in ("batch", "q_block", "head", "wg"))
        first, _ = kv_block_range(qt * COMPUTE_WARPGROUPS, cfg, bq, bk, num_kv)
        _, last = kv_block_range(qt * COMPUTE_WARPGROUPS + COMPUTE_WARPGROUPS - 1, cfg, bq, bk, num_kv)
        steps = jnp.maximum(last - first, 0)
        ring_loaded = [x for x in (k_bar, v_bar, seg_bar) if x is not None]

        @pl.when(wg == COMPUTE_WARPGROUPS)
        def _memory():
            kv_head = lax.div(n, jnp.int32(G))

            def issue(step, slot):
                keys = pl.ds((first + step) * bk, bk)
                plgpu.copy_gmem_to_smem(k_ref.at[b, keys, kv_head], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[b, keys, kv_head], v_smem.at[slot], v_bar.at[slot])
                if segments:
                    plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, keys], kv_seg_smem.at[slot], seg_bar.at[slot])
            _produce(steps, issue, done)

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            block = qt * COMPUTE_WARPGROUPS + wg
            q_start = block * bq
            rows = pl.ds(q_start, bq)
            own = [(q_ref.at[b, rows, n], q_smem.at[wg])]
            if segments:
                own.append((q_seg_ref.at[b, rows], q_seg_smem.at[wg]))
            if cfg.alibi:
                own.append((slopes_ref.at[n], slope_smem.at[wg]))
            if dropout:
                own.append((keys_ref.at[b, n], key_smem.at[wg]))
            if per_row:
                own += [(do_ref.at[b, rows, n], do_smem.at[wg]), (lse_ref.at[b, n, rows], rows_smem.at[0, wg]),
                        (delta_ref.at[b, n, rows], rows_smem.at[1, wg])]
            _load_own(own, own_loaded, wg)
            q_segs = regs.rows(q_seg_smem.at[wg], tile) if segments else None
            slope = regs.rows(slope_smem.at[wg], tile) if cfg.alibi else None
            drop_key = regs.rows(key_smem.at[wg], tile) if dropout else None
            q_pos = q_start + regs.iota(tile, 0)
            lse_rows = regs.rows(rows_smem.at[0, wg], tile) if per_row else None
            delta_rows = regs.rows(rows_smem.at[1, wg], tile) if per_row else None

            def take_turn():  # pingpong: both compute warpgroups arrive, then go on
                if interpret:  # the interpreter runs a warpgroup's barrier waits on XLA:CPU's few callback
                    return     # threads: two of them blocked on each other starve the third (a hang)
                plgpu.barrier_arrive(turns)
                plgpu.barrier_wait(turns)

            def logits(step, slot, masks=cfg):
                s = regs.product(q_smem.at[wg], k_smem.at[slot], True, tile, issued=take_turn if pingpong else None)
                s, capped = _scores(s, cfg)
                kv_pos = (first + step) * bk + regs.iota(tile, 1)
                kv_segs = regs.columns(kv_seg_smem.at[slot], tile) if segments else None
                s, visible = tile_mask(s, q_pos, kv_pos, q_segs, kv_segs, slope, masks)
                kept = dropout_lib.keep(drop_key, q_pos, kv_pos, cfg.dropout) if dropout else None
                return s, visible, capped, kept

            def forward_step(step, slot, carry, masks=cfg):
                m, l, acc = carry
                s, visible, _, kept = logits(step, slot, masks)
                m_new = jnp.maximum(m, s.max(axis=1))
                p = jnp.exp(s - lax.broadcast_in_dim(m_new, tile, [0]))
                if visible is not None:  # a row with nothing visible yet has m_new = -1e30: exp(0) there
                    p = jnp.where(visible, p, 0.0)
                correction = jnp.exp(m - m_new)
                l, acc = l * correction + p.sum(axis=1), acc * lax.broadcast_in_dim(correction, acc.shape, [0])
                p = _dropped(p, kept, cfg).astype(dtype)
                if not pingpong:
                    return m_new, l, acc + regs.product(p, v_smem.at[slot], False, (bq, H))
                take_turn()  # the softmax done: PV once the other warpgroup has issued its product
                return m_new, l, regs.accumulate(acc, p, v_smem.at[slot])

            def dq_step(step, slot, dq):
                s, visible, capped, kept = logits(step, slot)
                p = jnp.exp(s - lse_rows)  # lse +inf (a row that sees nothing): 0
                if visible is not None:
                    p = jnp.where(visible, p, 0.0)
                dp = _dropped(regs.product(do_smem.at[wg], v_smem.at[slot], True, tile), kept, cfg)
                ds = p * (dp - delta_rows)
                if capped is not None:
                    ds = ds * (1.0 - capped * capped)
                return dq + regs.product(ds.astype(dtype), k_smem.at[slot], False, (bq, H))

            lo, hi = kv_block_range(block, cfg, bq, bk, num_kv)
            if per_row:
                dq = _consume(0, steps, lo - first, [(hi - first, dq_step)], regs.zeros((bq, H)), ring_loaded, done)
                _store((dq * cfg.scale).astype(dtype), q_smem.at[wg], outs[0].at[b, rows, n])
                return
            vector = lambda value: regs.cast(jnp.full((bq,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            spans = [(hi - first, forward_step)]
            if pingpong:  # the blocks before `whole` need no mask; a skipped step takes both turns
                spans = [(whole_blocks(q_start, lo, hi) - first, functools.partial(forward_step, masks=unmasked)),
                         *spans]
                pl.when(wg == 1)(take_turn)  # warpgroup 1 starts one turn behind
            m, l, acc = _consume(0, steps, lo - first, spans, (vector(-1e30), vector(0.0), regs.zeros((bq, H))),
                                 ring_loaded, done, idle=(lambda: (take_turn(), take_turn())) if pingpong else None)
            if pingpong:
                pl.when(wg == 0)(take_turn)  # and warpgroup 0 takes the last one
            seen = l > 0.0
            inverse = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            rows_smem.at[0, wg][...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
            _store((acc * lax.broadcast_in_dim(inverse, acc.shape, [0])).astype(dtype), q_smem.at[wg],
                   outs[0].at[b, rows, n])
            plgpu.copy_smem_to_gmem(rows_smem.at[0, wg], outs[1].at[b, n, rows])
            plgpu.wait_smem_to_gmem(0)

    # pingpong: the key blocks every query of a warpgroup sees whole, with no mask (no segment ids,
    # no window; causal: those wholly at or before its first query; padded keys: those before kv_len)
    unmasked = cfg._replace(causal=False, kv_len=None)

    def whole_blocks(q_start, lo, hi):
        """The end of the key blocks from lo that a warpgroup whose first query is q_start sees unmasked."""
        if segments or cfg.window is not None:
            return lo
        end = hi
        if cfg.causal:
            end = jnp.minimum(end, lax.div(q_start + 1, jnp.int32(bk)))
        if cfg.kv_len is not None:
            end = jnp.minimum(end, cfg.kv_len // bk)
        return jnp.clip(end, lo, hi)

    def entry(*refs):
        W = COMPUTE_WARPGROUPS
        smem = (_operand((W, bq, H), dtype), _operand((W, bq, H), dtype) if per_row else None,
                plgpu.SMEM((2, W, bq), jnp.float32), plgpu.SMEM((W, bq), jnp.int32) if segments else None,
                plgpu.SMEM((W, bq), jnp.float32) if cfg.alibi else None,
                plgpu.SMEM((W, bq), jnp.int32) if dropout else None, _operand((STAGES, bk, H), dtype), _operand((STAGES, bk, H), dtype),
                plgpu.SMEM((STAGES, bk), jnp.int32) if segments else None)
        own = 1 + segments + cfg.alibi + dropout + 3 * per_row
        loaded = (plgpu.Barrier(num_barriers=own * W), _barriers(STAGES), _barriers(STAGES),
                  _barriers(STAGES, segments))
        turns = plgpu.Barrier(num_arrivals=W) if pingpong and not interpret else None
        pl.run_scoped(lambda *scratch: kernel(refs, *scratch), smem, loaded, (_ring_done(), _ring_done()), turns,
                      collective_axes="wg")

    out_type = (jax.ShapeDtypeStruct(q.shape, dtype),) if per_row else (
        jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((B, N, Tp), jnp.float32))
    outs = _kernel(entry, operands, out_type, (B, Tp // (COMPUTE_WARPGROUPS * bq), N),
                   ("batch", "q_block", "head"), interpret)
    return outs[0] if per_row else tuple(outs)


# ------------------------------------------------------------------------- dK/dV

def _key_major(q, k, v, q_seg, kv_seg, slopes, keys, do, lse, delta, cfg: TileConfig, interpret: bool):
    """The dK/dV kernel: (dk, dv) [B, Sp, K, H] for padded q, do [B, Tp, N, H], k, v [B, Sp, K, H],
    lse, delta [B, N, Tp], q_seg [B, Tp], kv_seg [B, Sp] (or None), slopes [N, ROWS] and dropout keys
    [B, N, ROWS] (or None)."""
    B, Tp, N, H = q.shape
    Sp, K = k.shape[1], k.shape[2]
    bk, bq, G = ROWS, _Blocks.for_head_dim(H).dkv, cfg.groups
    num_q, tile, dtype = Tp // bq, (ROWS, bq), q.dtype  # tiles are [keys, queries]
    segments, regs = q_seg is not None, _Registers(interpret)
    dropout = cfg.dropout > 0.0
    operands = (q, k, v) + ((q_seg, kv_seg) if segments else ()) + ((slopes,) if cfg.alibi else ()) + (
        (keys,) if dropout else ()) + (do, lse, delta)

    def kernel(refs, smem, loaded, done):
        ins, (dk_ref, dv_ref) = refs[:len(operands)], refs[len(operands):]
        q_ref, k_ref, v_ref = ins[:3]
        q_seg_ref, kv_seg_ref = ins[3:5] if segments else (None, None)
        slopes_ref = ins[3 + 2 * segments] if cfg.alibi else None
        keys_ref = ins[3 + 2 * segments + cfg.alibi] if dropout else None
        do_ref, lse_ref, delta_ref = ins[-3:]
        k_smem, v_smem, kv_seg_smem, q_smem, do_smem, rows_smem, q_seg_smem, slope_smem, key_smem = smem
        own_loaded, q_bar, do_bar, lse_bar, delta_bar, seg_bar, slope_bar, key_bar = loaded
        b, kt, kv_head, wg = (lax.axis_index(a) for a in ("batch", "kv_block", "kv_head", "wg"))
        first, _ = q_block_range(kt * COMPUTE_WARPGROUPS, cfg, bq, bk, num_q)
        _, last = q_block_range(kt * COMPUTE_WARPGROUPS + COMPUTE_WARPGROUPS - 1, cfg, bq, bk, num_q)
        per_head = jnp.maximum(last - first, 0)  # query blocks streamed per query head
        steps = G * per_head                    # the G query heads of this key/value head in turn
        ring_loaded = [x for x in (q_bar, do_bar, lse_bar, delta_bar, seg_bar, slope_bar, key_bar) if x is not None]

        def head_and_block(step):
            """(query head, query block) of a streamed step."""
            g = lax.div(step, jnp.maximum(per_head, 1))
            return kv_head * G + g, first + step - g * per_head

        @pl.when(wg == COMPUTE_WARPGROUPS)
        def _memory():
            def issue(step, slot):
                n, qb = head_and_block(step)
                rows = pl.ds(qb * bq, bq)
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, n], q_smem.at[slot], q_bar.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, n], do_smem.at[slot], do_bar.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[b, n, rows], rows_smem.at[0, slot], lse_bar.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[b, n, rows], rows_smem.at[1, slot], delta_bar.at[slot])
                if segments:
                    plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], q_seg_smem.at[slot], seg_bar.at[slot])
                if cfg.alibi:  # the slope of this step's query head, along its query columns
                    plgpu.copy_gmem_to_smem(slopes_ref.at[n], slope_smem.at[slot], slope_bar.at[slot])
                if dropout:  # the dropout key of (this batch row, this step's query head)
                    plgpu.copy_gmem_to_smem(keys_ref.at[b, n], key_smem.at[slot], key_bar.at[slot])
            _produce(steps, issue, done)

        @pl.when(wg < COMPUTE_WARPGROUPS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            block = kt * COMPUTE_WARPGROUPS + wg
            k_start = block * bk
            keys = pl.ds(k_start, bk)
            own = [(k_ref.at[b, keys, kv_head], k_smem.at[wg]), (v_ref.at[b, keys, kv_head], v_smem.at[wg])]
            if segments:
                own.append((kv_seg_ref.at[b, keys], kv_seg_smem.at[wg]))
            _load_own(own, own_loaded, wg)
            kv_segs = regs.rows(kv_seg_smem.at[wg], tile) if segments else None
            k_pos = k_start + regs.iota(tile, 0)

            def step_fn(step, slot, carry):
                dk, dv = carry
                _, qb = head_and_block(step)
                s, capped = _scores(regs.product(k_smem.at[wg], q_smem.at[slot], True, tile), cfg)
                q_segs = regs.columns(q_seg_smem.at[slot], tile) if segments else None
                slope = regs.columns(slope_smem.at[slot], tile) if cfg.alibi else None
                q_pos = qb * bq + regs.iota(tile, 1)
                s, visible = tile_mask(s, q_pos, k_pos, q_segs, kv_segs, slope, cfg)
                kept = (dropout_lib.keep(regs.columns(key_smem.at[slot], tile), q_pos, k_pos, cfg.dropout)
                        if dropout else None)
                p = jnp.exp(s - regs.columns(rows_smem.at[0, slot], tile))
                if visible is not None:
                    p = jnp.where(visible, p, 0.0)
                dv = dv + regs.product(_dropped(p, kept, cfg).astype(dtype), do_smem.at[slot], False, (bk, H))
                dp = _dropped(regs.product(v_smem.at[wg], do_smem.at[slot], True, tile), kept, cfg)
                ds = p * (dp - regs.columns(rows_smem.at[1, slot], tile))
                if capped is not None:
                    ds = ds * (1.0 - capped * capped)
                return dk + regs.product(ds.astype(dtype), q_smem.at[slot], False, (bk, H)), dv

            lo, hi = q_block_range(block, cfg, bq, bk, num_q)
            heads = lambda g, carry: _consume(g * per_head, per_head, lo - first, [(hi - first, step_fn)], carry,
                                              ring_loaded, done)
            dk, dv = lax.fori_loop(0, G, heads, (regs.zeros((bk, H)), regs.zeros((bk, H))))
            _store((dk * cfg.scale).astype(dtype), k_smem.at[wg], dk_ref.at[b, keys, kv_head])
            _store(dv.astype(dtype), v_smem.at[wg], dv_ref.at[b, keys, kv_head])

    def entry(*refs):
        W = COMPUTE_WARPGROUPS
        smem = (_operand((W, bk, H), dtype), _operand((W, bk, H), dtype),
                plgpu.SMEM((W, bk), jnp.int32) if segments else None,
                _operand((STAGES, bq, H), dtype), _operand((STAGES, bq, H), dtype),
                plgpu.SMEM((2, STAGES, bq), jnp.float32), plgpu.SMEM((STAGES, bq), jnp.int32) if segments else None,
                plgpu.SMEM((STAGES, bq), jnp.float32) if cfg.alibi else None,
                plgpu.SMEM((STAGES, bq), jnp.int32) if dropout else None)
        loaded = (plgpu.Barrier(num_barriers=(2 + segments) * W), _barriers(STAGES), _barriers(STAGES),
                  _barriers(STAGES), _barriers(STAGES), _barriers(STAGES, segments), _barriers(STAGES, cfg.alibi),
                  _barriers(STAGES, dropout))
        pl.run_scoped(lambda *scratch: kernel(refs, *scratch), smem, loaded, (_ring_done(), _ring_done()),
                      collective_axes="wg")

    out = jax.ShapeDtypeStruct(k.shape, dtype)
    return tuple(_kernel(entry, operands, (out, out), (B, Sp // (COMPUTE_WARPGROUPS * bk), K),
                         ("batch", "kv_block", "kv_head"), interpret))


# ------------------------------------------------------------------------- the differentiable call

@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attention(q, k, v, q_seg, kv_seg, slopes, keys, cfg: TileConfig, interpret: bool, schedule: str):
    return _query_major(q, k, v, q_seg, kv_seg, slopes, keys, cfg, interpret, schedule=schedule)


def _attention_fwd(q, k, v, q_seg, kv_seg, slopes, keys, cfg, interpret, schedule):
    o, lse = _query_major(q, k, v, q_seg, kv_seg, slopes, keys, cfg, interpret, schedule=schedule)
    return (o, lse), (q, k, v, q_seg, kv_seg, slopes, keys, o, lse)


def _attention_bwd(cfg, interpret, schedule, residuals, cotangents):
    q, k, v, q_seg, kv_seg, slopes, keys, o, lse = residuals
    if q.shape[-1] > BACKWARD_MAX_HEAD_DIM:
        raise ValueError(f"the Hopper flash-attention backward takes head dims up to {BACKWARD_MAX_HEAD_DIM}, got "
                         f"{q.shape[-1]}; use impl='pallas' (the Triton driver) or 'xla' to train this model")
    do = cotangents[0].astype(q.dtype)  # lse is an output for callers, not differentiated
    delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    dq = _query_major(q, k, v, q_seg, kv_seg, slopes, keys, cfg, interpret, backward=(do, lse, delta))
    dk, dv = _key_major(q, k, v, q_seg, kv_seg, slopes, keys, do, lse, delta, cfg, interpret)
    return dq, dk, dv, None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q, k, v, *, causal: bool = False, q_segment_ids=None, kv_segment_ids=None,
                    window: Optional[int] = None, softcap: Optional[float] = None, scale: Optional[float] = None,
                    alibi_slopes=None, dropout_rate: float = 0.0, dropout_seed=None, dropout_offsets=(0, 0),
                    interpret: bool = False):
    """(o [B, T, N, H], lse [B, N, T] fp32, +inf on rows that see no key) of attention on a Hopper
    GPU, differentiable in q, k, v through o (lse's cotangent is ignored); q [B, T, N, H], k, v
    [B, S, K, H] all bf16 or all fp16, H up to 256 (padded to a multiple of 64; the backward up to
    128). Dropout as `tfm.kernels.flash_attention.flash_attention`'s: the mask of `tfm.kernels.dropout`
    for int32 dropout_seed at batch row b + dropout_offsets[0], query head n + dropout_offsets[1].
    interpret: Mosaic GPU's interpreter (CPU)."""
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate and dropout_seed is None:
        raise ValueError("the Hopper flash-attention driver with dropout_rate > 0 needs a dropout_seed")
    dtypes = sorted({jnp.dtype(x.dtype).name for x in (q, k, v)} - set(GPU_DTYPES))
    if dtypes or len({q.dtype, k.dtype, v.dtype}) > 1:
        raise ValueError(f"the Hopper flash-attention driver takes q, k, v all bfloat16 or all float16, not "
                         f"{jnp.dtype(q.dtype).name}/{jnp.dtype(k.dtype).name}/{jnp.dtype(v.dtype).name}")
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    Hp = -(-H // 64) * 64
    if Hp > 256:
        raise ValueError(f"the Hopper flash-attention driver takes head dims up to 256, got {H}")
    Tp, Sp = (-(-length // LENGTH_MULTIPLE) * LENGTH_MULTIPLE for length in (T, S))
    q_seg, kv_seg = q_segment_ids, kv_segment_ids
    if kv_seg is not None and q_seg is None:  # key padding only: any non-zero id is visible
        kv_seg, q_seg = (kv_seg != 0).astype(jnp.int32), jnp.ones((B, T), jnp.int32)
    if kv_seg is not None:
        q_seg, kv_seg = pad_to(q_seg.astype(jnp.int32), 1, Tp), pad_to(kv_seg.astype(jnp.int32), 1, Sp)
    cfg = TileConfig(causal=causal, window=window, softcap=softcap, scale=float(H ** -0.5 if scale is None else scale),
                     kv_len=None if Sp == S or kv_seg is not None else S, segments=kv_seg is not None,
                     alibi=alibi_slopes is not None, groups=N // K, block_q=ROWS, block_kv=ROWS, driver="hopper",
                     interpret=interpret, dropout=float(dropout_rate))
    pad = lambda x, length: pad_to(pad_to(x, 1, length), 3, Hp)
    slopes = None if alibi_slopes is None else jnp.broadcast_to(
        jnp.asarray(alibi_slopes, jnp.float32)[:, None], (N, ROWS))  # a head's slope along a row of tiles
    keys = None
    if dropout_rate:  # each (batch row, query head)'s key along a row of tiles
        batch, head = (jnp.asarray(offset, jnp.int32) + jnp.arange(size, dtype=jnp.int32)
                       for offset, size in zip(dropout_offsets, (B, N)))
        keys = dropout_lib.head_key(jnp.asarray(dropout_seed, jnp.int32), batch[:, None], head[None, :])
        keys = jnp.broadcast_to(keys[:, :, None], (B, N, ROWS))
    o, lse = _attention(pad(q, Tp), pad(k, Sp), pad(v, Sp), q_seg, kv_seg, slopes, keys, cfg, interpret,
                        FORWARD_SCHEDULE)
    return o[:, :T, :, :H], lse[:, :, :T]
