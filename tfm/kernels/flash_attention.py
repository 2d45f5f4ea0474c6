"""Pallas blockwise (flash) attention: forward and backward kernels (tested against tfm.ops.xla).

Layout at the entry point: q [B, T, N, H], k and v [B, S, K, H], G = N // K; positions are
implicit aranges (query i sees key j top-left aligned) and the mask semantics are those of
`tfm.ops.attention` (causal, window, segment ids with 0 = padding, ALiBi, softcap; rows
with no visible key give 0).

Inside, the wrapper moves heads ahead of length ([B, N, T, H], [B, K, S, H]), pads T and S
to multiples of the blocks and H to 64, 128 or a power of two, and calls one of two drivers
that share the same per-tile math:

  loop  (GPU Triton, CPU interpret)  grid over query blocks (dK/dV: key blocks); the
        kernel loops over the other sequence's visible blocks only.
  grid  (TPU Mosaic)  the key (dK/dV: query) blocks are a grid axis marked "arbitrary",
        accumulators live in VMEM scratch, and empty blocks are skipped with `pl.when`
        and their index maps clamped so no DMA is issued for them.

A third driver, for Hopper GPUs in Pallas Mosaic GPU (`tfm.kernels.flash_hopper`: warp-specialised,
TMA-fed wgmma kernels; measured by `benchmarks.gpu_check` before anything selects it), shares
`tile_mask`, `kv_block_range` and `q_block_range` with these two.

The visible blocks are a range per block row (causal, window) or, with a sparsity pattern
(`tfm.kernels.sparsity`), block lists: `visible_tiles` -> `block_lists`, index [n, M] and count [n]
per row. The loop driver loops over index[r, :count[r]]; the grid driver's block axis has M
steps, step t loading block index[r, t] (scalar-prefetched) and computing while t < count[r].

Forward: online softmax with fp32 accumulators, saving the log-sum-exp [B, N, T]. Backward
(`jax.custom_vjp`): recomputes the probabilities per tile; one kernel for dQ, one for dK/dV,
which iterates over the G query heads of its key/value head so K and V are never repeated.
Each of the three kernels takes its own tiles and, on GPU, its own Triton launch parameters
(`BlockSizes`: `block_*`, `launch*`; `benchmarks.triton_sweep` times them).

Blocks of a longer attention (context parallelism, `tfm.ops.pallas.Blocks`): `block_forward` and
`block_backward` run the kernels alone, the softmax statistics the caller's, with the queries at
positions shifted by a traced int32 scalar relative to the keys (`TileConfig.shifted`): an operand of
the loop driver, scalar-prefetched by the grid driver so its index maps still skip empty blocks.
Causal, window and ALiBi read the shifted positions; without a shift the kernels are unchanged.

Attention dropout (`TileConfig.dropout`, rate > 0): each kernel regenerates the keep mask M of its tile from
`tfm.kernels.dropout` (a hash of the seed, the global batch row and query head, and the query and key
positions; the seed and the call's batch/head offsets are one int32 [3] operand, scalar-prefetched by the
grid driver), so it depends on neither tiles nor driver and is never stored. The softmax statistics (lse)
see every probability; o = (P * M / (1 - rate)) V; the backward: dV = (P * M / (1 - rate))^T dO,
dP = (dO V^T) * M / (1 - rate), dS = P * (dP - delta) with delta = rowsum(dO * O) as without dropout.
The blocks of context parallelism take no dropout.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from tfm.kernels import dropout as dropout_lib
from tfm.kernels import sparsity as sparsity_lib
from tfm.kernels.tiles import GPU_DTYPES, BlockSizes, Launch, kernel_backend

_NEG_INF = -1e30  # finite, as in tfm.ops.masks: masked logits never make NaN


# --------------------------------------------------------------------------------------
# Static configuration and visible-block ranges
# --------------------------------------------------------------------------------------

class TileConfig(NamedTuple):
    """Everything static about one call; hashable, so it can be a nondiff argument."""
    causal: bool
    window: Optional[int]
    softcap: Optional[float]
    scale: float
    kv_len: Optional[int]  # keys at index >= kv_len are padding; None when S is unpadded
    segments: bool       # segment-id refs are present
    alibi: bool          # slope refs are present
    groups: int          # G
    block_q: int
    block_kv: int
    driver: str          # "loop" | "grid"
    interpret: bool
    sparsity: Optional[sparsity_lib.Pattern] = None  # its block lists (`visible_tiles`) pick the blocks
    shifted: bool = False  # a shift operand: query i sits at position i + shift relative to key 0
    dropout: float = 0.0   # attention dropout rate; > 0: a seed operand (`_drop_key`)
    launch: Launch = Launch()  # Triton's num_warps and num_stages for this kernel (GPU only)


def _div(x, d: int):
    """x // d for non-negative int32 x (lax.div lowers on every backend)."""
    return lax.div(jnp.asarray(x, jnp.int32), jnp.int32(d))


def _blocks_upto(end, block: int):
    """Blocks of `block` covering indices [0, end): ceil(end / block), 0 for end <= 0."""
    return _div(jnp.maximum(end, 0) + block - 1, block)


def kv_block_range(qi, cfg: TileConfig, block_q: int, block_kv: int, num_kv: int, shift=0):
    """Key blocks [lo, hi) holding a key visible from query block qi (its queries at positions
    qi * block_q + shift + [0, block_q) relative to key 0); others are empty."""
    first = qi * block_q + shift
    last = first + block_q - 1
    lo, hi = jnp.int32(0), jnp.asarray(num_kv, jnp.int32)
    if cfg.kv_len is not None:
        hi = jnp.minimum(hi, _div(cfg.kv_len + block_kv - 1, block_kv))
    if cfg.causal:
        hi = jnp.minimum(hi, _blocks_upto(last + 1, block_kv))
    if cfg.window is not None:
        lo = _div(jnp.maximum(first - (cfg.window - 1), 0), block_kv)
        if not cfg.causal:
            hi = jnp.minimum(hi, _blocks_upto(last + cfg.window, block_kv))
    return lo, hi


def q_block_range(kj, cfg: TileConfig, block_q: int, block_kv: int, num_q: int, shift=0):
    """Query blocks [lo, hi) that can see a key of key block kj (query i at position i + shift
    relative to key 0); others are empty."""
    first, last = kj * block_kv - shift, kj * block_kv + block_kv - 1 - shift  # in query indices
    lo, hi = jnp.int32(0), jnp.asarray(num_q, jnp.int32)
    if cfg.causal:
        lo = _div(jnp.maximum(first, 0), block_q)
    if cfg.window is not None:
        hi = jnp.minimum(hi, _blocks_upto(last + cfg.window, block_q))
        if not cfg.causal:
            lo = _div(jnp.maximum(first - (cfg.window - 1), 0), block_q)
    return lo, hi


def visible_tiles(cfg: TileConfig, nq: int, nk: int) -> np.ndarray:
    """bool [nq, nk]: the (block_q x block_kv) tiles holding a visible (query, key) pair as far as the
    static masks tell (causal, window, key padding, sparsity; segment ids are data, not consulted).
    Each term alone is exact, and so is a pattern with causal (a tile straddling the diagonal holds an
    i == j pair, which every pattern sees); a pattern with a window too may add tiles where the two
    meet in no pair (visited, fully masked: correct, not minimal)."""
    bq, bk = cfg.block_q, cfg.block_kv
    q_first, k_first = np.arange(nq)[:, None] * bq, np.arange(nk)[None, :] * bk
    lo, hi = q_first - (k_first + bk - 1), q_first + bq - 1 - k_first  # every i - j of a tile: [lo, hi]
    seen = np.ones((nq, nk), bool)
    if cfg.causal:
        seen &= hi >= 0
    if cfg.window is not None:
        seen &= (lo < cfg.window) & (cfg.causal or hi > -cfg.window)
    if cfg.kv_len is not None:
        seen &= k_first < cfg.kv_len
    if cfg.sparsity is not None:
        seen &= cfg.sparsity.tiles(bq, bk, nq, nk, nq * bq, nk * bk)
    return seen


def visited_share(length: int, *, causal: bool = False, window: Optional[int] = None,
                  sparsity: Optional[sparsity_lib.Pattern] = None, block: int = 128) -> float:
    """The share of the (block x block) tiles of a [length, length] self-attention that the kernels
    visit under these static masks (`visible_tiles`): 1.0 for full bidirectional attention. BigBird
    refuses tiles that do not divide its block, as the kernels do."""
    if isinstance(sparsity, sparsity_lib.BigBird):
        sparsity.check_tiles(block, block)
    n = -(-length // block)
    cfg = TileConfig(causal=causal, window=window, softcap=None, scale=1.0, kv_len=None, segments=False, alibi=False,
                  groups=1, block_q=block, block_kv=block, driver="loop", interpret=True, sparsity=sparsity)
    return float(visible_tiles(cfg, n, n).mean())


def block_lists(seen: np.ndarray):
    """For seen [n, m] bool: index int32 [n, M] (row r's true columns first, in order; M a power of two)
    and count int32 [n, 1]. The kernels visit index[r, :count[r]] of block row r only."""
    count = seen.sum(axis=1)
    width = pl.next_power_of_2(max(1, int(count.max(initial=0))))
    index = np.argsort(~seen, axis=1, kind="stable")[:, :width]
    if index.shape[1] < width:
        index = np.pad(index, ((0, 0), (0, width - index.shape[1])))
    return index.astype(np.int32), count[:, None].astype(np.int32)


def _visits(lists, lo, hi):
    """Loop bounds and the block visited at step t: the range [lo, hi) or, with block lists
    (index_ref [M], count_ref [1] of this row), the listed blocks."""
    if lists is None:
        return lo, hi, lambda t: t
    index_ref, count_ref = lists
    return jnp.int32(0), count_ref[0], lambda t: index_ref[t]


# --------------------------------------------------------------------------------------
# Per-tile math, shared by both drivers
# --------------------------------------------------------------------------------------

def _dot(a, b, contract=(1, 0)):
    """a @ b contracting a's dim contract[0] with b's dim contract[1]; fp32 result."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def _tile_logits(q, k, q_start, kv_start, q_seg, kv_seg, slope, cfg: TileConfig):
    """Masked fp32 logits [bq, bk] for q [bq, H], k [bk, H].

    Returns (logits, visible [bq, bk] or None, tanh(raw / softcap) or None).
    q_seg [bq, 1], kv_seg [1, bk] ints or None; slope [1, 1] or None.
    """
    s = _dot(q, k, (1, 1)) * cfg.scale
    capped = None
    if cfg.softcap is not None:
        capped = jnp.tanh(s / cfg.softcap)
        s = cfg.softcap * capped
    rows = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    cols = kv_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    s, visible = tile_mask(s, rows, cols, q_seg, kv_seg, slope, cfg)
    return s, visible, capped


def tile_mask(s, rows, cols, q_seg, kv_seg, slope, cfg: TileConfig):
    """ALiBi and the masks of one tile of scaled (and soft-capped) fp32 logits s [bq, bk]: (s with
    invisible entries at -1e30, visible bool [bq, bk] or None when all are). rows, cols int32 [bq, bk]:
    the query and key positions; q_seg, kv_seg ints broadcasting to [bq, bk] or None; slope a scalar
    or None. Shared by every driver (the Hopper driver's operands carry its register layouts)."""
    if slope is not None:
        s = s - slope * jnp.abs(rows - cols).astype(jnp.float32)
    visible = None

    def conj(mask):
        return mask if visible is None else visible & mask

    if cfg.causal:
        visible = conj(cols <= rows)
    if cfg.window is not None:
        distance = rows - cols if cfg.causal else jnp.abs(rows - cols)
        visible = conj(distance < cfg.window)
    if cfg.sparsity is not None and (pattern := cfg.sparsity.in_tile(rows, cols)) is not None:
        visible = conj(pattern)
    if q_seg is not None:
        visible = conj((q_seg == kv_seg) & (kv_seg != 0))
    elif cfg.kv_len is not None:
        visible = conj(cols < cfg.kv_len)
    if visible is not None:
        s = jnp.where(visible, s, _NEG_INF)
    return s, visible


def _probs(s, visible, lse):
    """exp(s - lse) with invisible entries exactly 0."""
    p = jnp.exp(s - lse)
    return p if visible is None else jnp.where(visible, p, 0.0)


def _drop_key(seed_ref, batch, head):
    """The dropout key (`tfm.kernels.dropout.head_key`) of this call's batch row and query head, or None
    without dropout. seed_ref int32 [3]: the seed, and the global index of the call's batch row 0 and query
    head 0 (a device's shard offsets under a mesh)."""
    if seed_ref is None:
        return None
    return dropout_lib.head_key(seed_ref[0], seed_ref[1] + batch, seed_ref[2] + head)


def _dropout_mask(shape, q_start, kv_start, drop, cfg: TileConfig):
    """bool [bq, bk]: the tile's keep mask, its query positions from q_start and keys from kv_start (the
    row and column hashes O(bq + bk), one mix per element); None without dropout (drop None)."""
    if drop is None:
        return None
    rows = q_start + lax.broadcasted_iota(jnp.int32, (shape[0], 1), 0)
    cols = kv_start + lax.broadcasted_iota(jnp.int32, (1, shape[1]), 1)
    return dropout_lib.keep(drop, rows, cols, cfg.dropout)


def _masked(x, kept, cfg: TileConfig):
    """x [bq, bk] * keep mask / (1 - rate); x without dropout (kept None)."""
    return x if kept is None else jnp.where(kept, x * (1.0 / (1.0 - cfg.dropout)), 0.0)


def _fwd_tile(carry, q, k, v, q_start, kv_start, q_seg, kv_seg, slope, drop, cfg):
    """One online-softmax step. carry = (m [bq, 1], l [bq, 1], acc [bq, H]) fp32. The softmax statistics
    m, l see every probability; with dropout (drop: `_drop_key`) acc sums the kept ones, rescaled."""
    m, l, acc = carry
    s, visible, _ = _tile_logits(q, k, q_start, kv_start, q_seg, kv_seg, slope, cfg)
    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
    p = _probs(s, visible, m_new)
    correction = jnp.exp(m - m_new)
    l = l * correction + p.sum(axis=-1, keepdims=True)
    p = _masked(p, _dropout_mask(p.shape, q_start, kv_start, drop, cfg), cfg)
    acc = acc * correction + _dot(p.astype(v.dtype), v)
    return m_new, l, acc


def _fwd_finish(m, l, acc, o_ref, lse_ref):
    """Writes o = acc / l (0 where no key was visible) and lse (+inf there)."""
    empty = l == 0.0
    safe_l = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / safe_l).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(safe_l))


def _ds_tile(q, k, v, do, lse, delta, q_start, kv_start, q_seg, kv_seg, slope, drop, cfg):
    """Recomputed probabilities after dropout, P * M / (1 - rate) [bq, bk] (P without dropout), and dlogits
    ds [bq, bk] (scale folded in), fp32: dP = (dO V^T) * M / (1 - rate), dS = P * (dP - delta), delta =
    rowsum(dO * O), M the forward's mask (drop: `_drop_key`)."""
    s, visible, capped = _tile_logits(q, k, q_start, kv_start, q_seg, kv_seg, slope, cfg)
    p = _probs(s, visible, lse)
    kept = _dropout_mask(s.shape, q_start, kv_start, drop, cfg)
    ds = p * (_masked(_dot(do, v, (1, 1)), kept, cfg) - delta)
    if capped is not None:
        ds = ds * (1.0 - capped * capped)
    return _masked(p, kept, cfg), ds * cfg.scale


# --------------------------------------------------------------------------------------
# Kernels. Ref order: q, k, v, [do, lse, delta], [q_seg, kv_seg], [slope], [shift], [seed], [block index, count],
# outputs, scratch; the grid driver takes the block lists, the shift and the seed first instead (TPU scalar
# prefetch).
# --------------------------------------------------------------------------------------

def _split_refs(refs, cfg: TileConfig, num_main: int):
    """(main refs, q_seg_ref, kv_seg_ref, slope_ref, block lists (index_ref, count_ref) or None, shift,
    seed_ref, rest); shift: the queries' position offset (a traced int32 scalar, `TileConfig.shifted`) or 0;
    seed_ref: int32 [3] with dropout (`_drop_key`), else None."""
    q_seg_ref = kv_seg_ref = slope_ref = lists = seed_ref = None
    shift = 0
    if cfg.driver == "grid":
        count = _num_prefetched(cfg)
        (lists, shift, seed_ref), refs = _prefetched(cfg, refs[:count]), refs[count:]
    main, refs = refs[:num_main], refs[num_main:]
    if cfg.segments:
        (q_seg_ref, kv_seg_ref), refs = refs[:2], refs[2:]
    if cfg.alibi:
        slope_ref, refs = refs[0], refs[1:]
    if cfg.shifted and cfg.driver == "loop":
        shift, refs = refs[0][0], refs[1:]
    if cfg.dropout and cfg.driver == "loop":
        seed_ref, refs = refs[0], refs[1:]
    if cfg.sparsity is not None and cfg.driver == "loop":
        lists, refs = tuple(refs[:2]), refs[2:]
    return main, q_seg_ref, kv_seg_ref, slope_ref, lists, shift, seed_ref, refs


def _grid_step(row, step, lists, lo, hi):
    """Grid driver: (whether grid step `step` of block row `row` computes, the block it computes): the
    range [lo, hi), or with block lists (index_ref [n, M], count_ref [n]) the row's step-th listed block."""
    if lists is None:
        return (step >= lo) & (step < hi), step
    index_ref, count_ref = lists
    return step < count_ref[row], index_ref[row, step]


def _load(ref, *idx):
    return None if ref is None else ref[idx]


def _fwd_loop_kernel(*refs, cfg: TileConfig):
    """Grid (B, N, T/bq). q [bq, H], k/v [S, H] -> o [bq, H], lse [bq, 1]."""
    (q_ref, k_ref, v_ref), q_seg_ref, kv_seg_ref, slope_ref, lists, shift, seed_ref, (o_ref, lse_ref) = \
        _split_refs(refs, cfg, 3)
    bq, bk = cfg.block_q, cfg.block_kv
    qi = pl.program_id(2)
    q, q_seg, slope = q_ref[...], _load(q_seg_ref, ...), _load(slope_ref, ...)
    drop = _drop_key(seed_ref, pl.program_id(0), pl.program_id(1))
    lo, hi, block = _visits(lists, *kv_block_range(qi, cfg, bq, bk, k_ref.shape[0] // bk, shift))

    def body(t, carry):
        start = pl.multiple_of(block(t) * bk, bk)
        rows = pl.ds(start, bk)
        kv_seg = _load(kv_seg_ref, slice(None), rows)
        return _fwd_tile(carry, q, k_ref[rows, :], v_ref[rows, :], qi * bq + shift, start, q_seg, kv_seg,
                         slope, drop, cfg)

    init = (jnp.full((bq, 1), _NEG_INF, jnp.float32), jnp.zeros((bq, 1), jnp.float32),
            jnp.zeros(o_ref.shape, jnp.float32))
    _fwd_finish(*lax.fori_loop(lo, hi, body, init), o_ref, lse_ref)


def _fwd_grid_kernel(*refs, cfg: TileConfig):
    """Grid (B, N, T/bq, S/bk), last axis sequential; m, l, acc in VMEM scratch."""
    (q_ref, k_ref, v_ref), q_seg_ref, kv_seg_ref, slope_ref, lists, shift, seed_ref, rest = _split_refs(refs, cfg, 3)
    o_ref, lse_ref, m_ref, l_ref, acc_ref = rest
    bq, bk = cfg.block_q, cfg.block_kv
    qi, t = pl.program_id(2), pl.program_id(3)
    active, j = _grid_step(qi, t, lists, *kv_block_range(qi, cfg, bq, bk, pl.num_programs(3), shift))
    drop = _drop_key(seed_ref, pl.program_id(0), pl.program_id(1))

    @pl.when(t == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG_INF, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(active)
    def _step():
        carry = _fwd_tile((m_ref[...], l_ref[...], acc_ref[...]), q_ref[...], k_ref[...], v_ref[...],
                          qi * bq + shift, j * bk, _load(q_seg_ref, ...), _load(kv_seg_ref, ...),
                          _load(slope_ref, ...), drop, cfg)
        m_ref[...], l_ref[...], acc_ref[...] = carry

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        _fwd_finish(m_ref[...], l_ref[...], acc_ref[...], o_ref, lse_ref)


def _dq_loop_kernel(*refs, cfg: TileConfig):
    """Grid (B, N, T/bq). q/do [bq, H], lse/delta [bq, 1], k/v [S, H] -> dq [bq, H]."""
    main, q_seg_ref, kv_seg_ref, slope_ref, lists, shift, seed_ref, (dq_ref,) = _split_refs(refs, cfg, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = main
    bq, bk = cfg.block_q, cfg.block_kv
    qi = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_seg, slope = _load(q_seg_ref, ...), _load(slope_ref, ...)
    drop = _drop_key(seed_ref, pl.program_id(0), pl.program_id(1))
    lo, hi, block = _visits(lists, *kv_block_range(qi, cfg, bq, bk, k_ref.shape[0] // bk, shift))

    def body(t, dq):
        start = pl.multiple_of(block(t) * bk, bk)
        rows = pl.ds(start, bk)
        k = k_ref[rows, :]
        _, ds = _ds_tile(q, k, v_ref[rows, :], do, lse, delta, qi * bq + shift, start, q_seg,
                         _load(kv_seg_ref, slice(None), rows), slope, drop, cfg)
        return dq + _dot(ds.astype(k.dtype), k)

    dq_ref[...] = lax.fori_loop(lo, hi, body, jnp.zeros(dq_ref.shape, jnp.float32)).astype(dq_ref.dtype)


def _dq_grid_kernel(*refs, cfg: TileConfig):
    """Grid (B, N, T/bq, S/bk), last axis sequential; dq accumulates in VMEM scratch."""
    main, q_seg_ref, kv_seg_ref, slope_ref, lists, shift, seed_ref, (dq_ref, acc_ref) = _split_refs(refs, cfg, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = main
    bq, bk = cfg.block_q, cfg.block_kv
    qi, t = pl.program_id(2), pl.program_id(3)
    active, j = _grid_step(qi, t, lists, *kv_block_range(qi, cfg, bq, bk, pl.num_programs(3), shift))
    drop = _drop_key(seed_ref, pl.program_id(0), pl.program_id(1))

    @pl.when(t == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(active)
    def _step():
        k = k_ref[...]
        _, ds = _ds_tile(q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...],
                         qi * bq + shift, j * bk, _load(q_seg_ref, ...), _load(kv_seg_ref, ...),
                         _load(slope_ref, ...), drop, cfg)
        acc_ref[...] += _dot(ds.astype(k.dtype), k)

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = acc_ref[...].astype(dq_ref.dtype)


def _dkv_accumulate(dk, dv, q, k, v, do, lse, delta, q_start, kv_start, q_seg, kv_seg, slope, drop, cfg):
    """dk, dv [bk, H] fp32 += the contribution of one query tile."""
    p, ds = _ds_tile(q, k, v, do, lse, delta, q_start, kv_start, q_seg, kv_seg, slope, drop, cfg)
    dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
    dk = dk + _dot(ds.astype(q.dtype), q, (0, 0))
    return dk, dv


def _dkv_loop_kernel(*refs, cfg: TileConfig):
    """Grid (B, K, S/bk). q/do [G*T, H], lse/delta [G*T, 1], q_seg [T, 1], slope [G, 1],
    k/v [bk, H] -> dk, dv [bk, H]; loops over the G heads and the visible query blocks."""
    main, q_seg_ref, kv_seg_ref, slope_ref, lists, shift, seed_ref, (dk_ref, dv_ref) = _split_refs(refs, cfg, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = main
    bq, bk, G = cfg.block_q, cfg.block_kv, cfg.groups
    T = q_ref.shape[0] // G
    b, h, kj = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k, v, kv_seg = k_ref[...], v_ref[...], _load(kv_seg_ref, ...)
    lo, hi, block = _visits(lists, *q_block_range(kj, cfg, bq, bk, T // bq, shift))

    def head(g, carry):
        slope = _load(slope_ref, pl.ds(g, 1), slice(None))
        drop = _drop_key(seed_ref, b, h * G + g)

        def body(t, carry):
            start = pl.multiple_of(block(t) * bq, bq)
            rows = pl.ds(pl.multiple_of(g * T + start, bq), bq)
            q_seg = _load(q_seg_ref, pl.ds(start, bq), slice(None))
            return _dkv_accumulate(*carry, q_ref[rows, :], k, v, do_ref[rows, :], lse_ref[rows, :],
                                   delta_ref[rows, :], start + shift, kj * bk, q_seg, kv_seg, slope, drop, cfg)

        return lax.fori_loop(lo, hi, body, carry)

    zeros = jnp.zeros(dk_ref.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk.astype(dk_ref.dtype), dv.astype(dv_ref.dtype)


def _dkv_grid_kernel(*refs, cfg: TileConfig):
    """Grid (B, K, S/bk, G, T/bq), last two axes sequential; dk, dv in VMEM scratch."""
    main, q_seg_ref, kv_seg_ref, slope_ref, lists, shift, seed_ref, rest = _split_refs(refs, cfg, 6)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = main
    dk_ref, dv_ref, dk_acc, dv_acc = rest
    bq, bk = cfg.block_q, cfg.block_kv
    kj, g, t = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    active, i = _grid_step(kj, t, lists, *q_block_range(kj, cfg, bq, bk, pl.num_programs(4), shift))
    drop = _drop_key(seed_ref, pl.program_id(0), pl.program_id(1) * cfg.groups + g)
    first = (g == 0) & (t == 0)
    last = (g == pl.num_programs(3) - 1) & (t == pl.num_programs(4) - 1)

    @pl.when(first)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    @pl.when(active)
    def _step():
        dk_acc[...], dv_acc[...] = _dkv_accumulate(
            dk_acc[...], dv_acc[...], q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...],
            delta_ref[...], i * bq + shift, kj * bk, _load(q_seg_ref, ...), _load(kv_seg_ref, ...),
            _load(slope_ref, ...), drop, cfg)

    @pl.when(last)
    def _finish():
        dk_ref[...], dv_ref[...] = dk_acc[...].astype(dk_ref.dtype), dv_acc[...].astype(dv_ref.dtype)


# --------------------------------------------------------------------------------------
# pallas_call builders. Kernel layout: q, do, o [B, N, T, H]; k, v [B, K, S, H];
# lse, delta [B, N, T, 1] fp32; q_seg [B, T, 1]; kv_seg [B, 1, S]; slopes [N, 1, 1].
# --------------------------------------------------------------------------------------

def _compiler_params(backend: str, interpret: bool, num_axes: int, num_sequential: int = 0,
                     launch: Launch = Launch()):
    """TPU: grid-axis semantics (the last `num_sequential` axes accumulate). GPU: Triton
    parameters (`launch`), which also select the Triton lowering (pallas_call on GPU would
    otherwise pick Mosaic GPU)."""
    if interpret:
        return None
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        semantics = ("parallel",) * (num_axes - num_sequential) + ("arbitrary",) * num_sequential
        return pltpu.CompilerParams(dimension_semantics=semantics)
    if backend == "gpu":
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages)
    return None


def _vmem(shape):
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.VMEM(shape, jnp.float32)


def _clamp(idx, lo, hi, count):
    """idx clamped into the visible range [lo, hi) (and [0, count)): skipped steps then
    repeat the previous block index, so the pipeline issues no copy for them."""
    return jnp.clip(jnp.clip(idx, lo, jnp.maximum(hi - 1, lo)), 0, count - 1)


def _lists(cfg: TileConfig, seen):
    """Block lists (index [n, M], count [n, 1]; `block_lists`) of the tiles seen() -> [n, m] bool, or None
    without a sparsity pattern (the kernels then skip by the causal/window ranges)."""
    return None if cfg.sparsity is None else block_lists(seen())


def _num_prefetched(cfg: TileConfig) -> int:
    """Scalar-prefetch operands of the grid driver: the block lists (2), the shift (1), the dropout seed (1)."""
    return 2 * (cfg.sparsity is not None) + cfg.shifted + (cfg.dropout > 0)


def _prefetched(cfg: TileConfig, prefetch):
    """The grid driver's scalar-prefetch refs -> (block lists (index_ref, count_ref) or None, shift or 0,
    seed_ref or None)."""
    lists, prefetch = (tuple(prefetch[:2]), prefetch[2:]) if cfg.sparsity is not None else (None, prefetch)
    shift, prefetch = (prefetch[0][0], prefetch[1:]) if cfg.shifted else (0, prefetch)
    return lists, shift, (prefetch[0] if cfg.dropout else None)


def _listed(prefetch, row, step):
    """Grid driver index maps: the block of `row` that grid step `step` loads, from the scalar-prefetched
    lists; steps past the row's count repeat its last block, so the pipeline issues no copy for them."""
    index_ref, count_ref = prefetch
    return index_ref[row, jnp.clip(step, 0, jnp.maximum(count_ref[row] - 1, 0))]


def _extras(cfg: TileConfig, q_seg, kv_seg, slopes, q_seg_spec, kv_seg_spec, slope_spec, lists=None, shift=None,
            seed=None):
    """Optional operands and their specs, in kernel ref order. The loop driver takes the block lists as
    two operands, row r at its grid step (., ., r), the shift as one (int32 [1]) and the dropout seed as one
    (int32 [3], `_drop_key`); the grid driver takes them as scalar prefetch (`_call`)."""
    args, specs = [], []
    if cfg.segments:
        args += [q_seg, kv_seg]
        specs += [q_seg_spec, kv_seg_spec]
    if cfg.alibi:
        args.append(slopes)
        specs.append(slope_spec)
    if cfg.shifted and cfg.driver == "loop":
        args.append(jnp.asarray(shift, jnp.int32).reshape(1))
        specs.append(pl.BlockSpec((1,), lambda *_: (0,)))
    if cfg.dropout and cfg.driver == "loop":
        args.append(seed)
        specs.append(pl.BlockSpec((3,), lambda *_: (0,)))
    if lists is not None and cfg.driver == "loop":
        index, count = lists
        args += [jnp.asarray(index), jnp.asarray(count)]
        specs += [pl.BlockSpec((None, index.shape[1]), lambda b, h, r: (r, 0)),
                  pl.BlockSpec((None, 1), lambda b, h, r: (r, 0))]
    return args, specs


# [block_q, block_kv, H] matrix products per visible tile: forward q k^T, p v; dQ adds do v^T and ds k;
# dK/dV recomputes p and dp and adds p^T do and ds^T q.
_MATMULS = {"flash_attention_fwd": 2, "flash_attention_dq": 3, "flash_attention_dkv": 4}


def cost_estimate(name: str, cfg: TileConfig, q_shape, S: int, K: int, itemsize: int) -> pl.CostEstimate:
    """What XLA's cost model knows of one kernel call (it scores a Pallas call by this alone): for q
    [B, N, T, H] against S keys of K heads, the visible tiles' (`visible_tiles`) matrix products (2 FLOPs
    a multiply-add), one exp per visible score (a tanh too with soft-cap), and the bytes: the operands
    streamed once per visible tile on the other side (K and V in the forward and dQ; Q, dO and the row
    statistics in dK/dV), the rest read or written once."""
    B, N, T, H = q_shape
    bq, bk = cfg.block_q, cfg.block_kv
    tiles = int(visible_tiles(cfg, T // bq, S // bk).sum()) * B * N
    scores = tiles * bq * bk
    rows = B * N * T * 4  # fp32 per query row (lse; delta too in the backward)
    if name == "flash_attention_dkv":
        moved = itemsize * (4 * B * K * S * H + tiles * bq * 2 * H) + tiles * bq * 8
    else:
        once = 2 if name == "flash_attention_fwd" else 3  # q, o / q, do, dq
        moved = itemsize * (once * B * N * T * H + tiles * bk * 2 * H) + rows * (1 if once == 2 else 2)
    return pl.CostEstimate(flops=2 * _MATMULS[name] * scores * H,
                           transcendentals=scores * (2 if cfg.softcap else 1), bytes_accessed=moved)


_carry_cost_estimates = True  # False inside `without_cost_estimates`


@contextlib.contextmanager
def without_cost_estimates():
    """Inside, the kernels' pallas_calls are traced without their `cost_estimate`, so XLA's cost model
    scores each call at 0 s: a step compiled inside and outside gives the kernels' part of XLA's own step
    estimate (the preflight's `kernels_apart`). JAX's caches of traced functions do not key on this
    setting, so they are cleared on entering and on leaving (a jitted step is traced again)."""
    global _carry_cost_estimates
    jax.clear_caches()
    _carry_cost_estimates = False
    try:
        yield
    finally:
        _carry_cost_estimates = True
        jax.clear_caches()


def _call(kernel, cfg: TileConfig, backend: str, lists, *, grid, in_specs, out_specs, scratch, out_shape, name,
          num_sequential: int, cost: pl.CostEstimate, shift=None, seed=None):
    """The pallas_call of `kernel` as a function of its operands. With block lists, a shift or a dropout
    seed the grid driver takes them first, as TPU scalar prefetch (index [n, M], count [n], shift [1] and
    seed [3] in SMEM; the index maps read the first three). `cost` is left off inside
    `without_cost_estimates`."""
    params = _compiler_params(backend, cfg.interpret, len(grid), num_sequential, cfg.launch)
    cost = cost if _carry_cost_estimates else None
    kernel = functools.partial(kernel, cfg=cfg)
    if _num_prefetched(cfg) == 0 or cfg.driver == "loop":
        return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
                              scratch_shapes=scratch, compiler_params=params, interpret=cfg.interpret, name=name,
                              cost_estimate=cost)
    from jax.experimental.pallas import tpu as pltpu
    spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=_num_prefetched(cfg), grid=grid, in_specs=in_specs,
                                        out_specs=out_specs, scratch_shapes=scratch)
    call = pl.pallas_call(kernel, out_shape=out_shape, grid_spec=spec, compiler_params=params,
                          interpret=cfg.interpret, name=name, cost_estimate=cost)
    prefetch = () if lists is None else (jnp.asarray(lists[0]), jnp.asarray(lists[1][:, 0]))
    if cfg.shifted:
        prefetch += (jnp.asarray(shift, jnp.int32).reshape(1),)
    if cfg.dropout:
        prefetch += (seed,)
    return functools.partial(call, *prefetch)


def _query_major_specs(q_shape, S: int, cfg: TileConfig, lists=None):
    """Grid and BlockSpecs shared by the forward and dQ calls: the grid runs over query blocks
    (the TPU "grid" driver adds a sequential key-block axis that skips masked-out blocks, or with
    block lists steps through the listed ones).
    -> grid, q_map, kv_spec, (q_seg_spec, kv_seg_spec), slope_spec."""
    B, N, T, H = q_shape
    G, bq, bk = cfg.groups, cfg.block_q, cfg.block_kv
    nq, nk = T // bq, S // bk
    if cfg.driver == "loop":
        q_map = lambda b, n, i: (b, n, i, 0)
        kv_spec = pl.BlockSpec((None, None, S, H), lambda b, n, i: (b, _div(n, G), 0, 0))
        seg_specs = (pl.BlockSpec((None, bq, 1), lambda b, n, i: (b, i, 0)),
                     pl.BlockSpec((None, 1, S), lambda b, n, i: (b, 0, 0)))
        slope_spec = pl.BlockSpec((None, 1, 1), lambda b, n, i: (n, 0, 0))
        return (B, N, nq), q_map, kv_spec, seg_specs, slope_spec

    def kv_block(i, j, prefetch):
        lists, shift, _ = _prefetched(cfg, prefetch)
        return _listed(lists, i, j) if lists else _clamp(j, *kv_block_range(i, cfg, bq, bk, nk, shift), nk)

    q_map = lambda b, n, i, j, *prefetch: (b, n, i, 0)
    kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, n, i, j, *p: (b, _div(n, G), kv_block(i, j, p), 0))
    seg_specs = (pl.BlockSpec((None, bq, 1), lambda b, n, i, j, *p: (b, i, 0)),
                 pl.BlockSpec((None, 1, bk), lambda b, n, i, j, *p: (b, 0, kv_block(i, j, p))))
    slope_spec = pl.BlockSpec((None, 1, 1), lambda b, n, i, j, *p: (n, 0, 0))
    steps = nk if lists is None else lists[0].shape[1]
    return (B, N, nq, steps), q_map, kv_spec, seg_specs, slope_spec


def _fwd_call(q, k, v, q_seg, kv_seg, slopes, cfg: TileConfig, backend: str, shift=None, seed=None):
    """-> o [B, N, T, H] (q dtype), lse [B, N, T, 1] fp32. shift: int32 scalar when cfg.shifted; seed:
    int32 [3] when cfg.dropout (`_drop_key`)."""
    B, N, T, H = q.shape
    lists = _lists(cfg, lambda: visible_tiles(cfg, T // cfg.block_q, k.shape[2] // cfg.block_kv))
    grid, q_map, kv_spec, seg_specs, slope_spec = _query_major_specs(q.shape, k.shape[2], cfg, lists)
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, N, T, 1), jnp.float32))
    if cfg.driver == "loop":
        scratch, kernel = (), _fwd_loop_kernel
    else:
        kernel = _fwd_grid_kernel
        scratch = (_vmem((cfg.block_q, 1)), _vmem((cfg.block_q, 1)), _vmem((cfg.block_q, H)))  # m, l, acc
    q_spec = pl.BlockSpec((None, None, cfg.block_q, H), q_map)
    extra_args, extra_specs = _extras(cfg, q_seg, kv_seg, slopes, *seg_specs, slope_spec, lists, shift, seed)
    return _call(kernel, cfg, backend, lists, grid=grid, in_specs=[q_spec, kv_spec, kv_spec, *extra_specs],
                 out_specs=(q_spec, pl.BlockSpec((None, None, cfg.block_q, 1), q_map)), scratch=scratch,
                 out_shape=out_shape, name="flash_attention_fwd", num_sequential=len(grid) - 3, shift=shift,
                 seed=seed, cost=cost_estimate("flash_attention_fwd", cfg, q.shape, k.shape[2], k.shape[1],
                                               q.dtype.itemsize))(q, k, v, *extra_args)


def _dq_call(q, k, v, do, lse, delta, q_seg, kv_seg, slopes, cfg: TileConfig, backend: str, shift=None, seed=None):
    """-> dq [B, N, T, H]."""
    T, H = q.shape[2:]
    lists = _lists(cfg, lambda: visible_tiles(cfg, T // cfg.block_q, k.shape[2] // cfg.block_kv))
    grid, q_map, kv_spec, seg_specs, slope_spec = _query_major_specs(q.shape, k.shape[2], cfg, lists)
    if cfg.driver == "loop":
        scratch, kernel = (), _dq_loop_kernel
    else:
        scratch, kernel = (_vmem((cfg.block_q, H)),), _dq_grid_kernel
    q_spec = pl.BlockSpec((None, None, cfg.block_q, H), q_map)
    row_spec = pl.BlockSpec((None, None, cfg.block_q, 1), q_map)
    extra_args, extra_specs = _extras(cfg, q_seg, kv_seg, slopes, *seg_specs, slope_spec, lists, shift, seed)
    return _call(kernel, cfg, backend, lists, grid=grid,
                 in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *extra_specs], out_specs=q_spec,
                 scratch=scratch, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), name="flash_attention_dq",
                 num_sequential=len(grid) - 3, shift=shift, seed=seed,
                 cost=cost_estimate("flash_attention_dq", cfg, q.shape, k.shape[2], k.shape[1], q.dtype.itemsize)
                 )(q, k, v, do, lse, delta, *extra_args)


def _dkv_call(q, k, v, do, lse, delta, q_seg, kv_seg, slopes, cfg: TileConfig, backend: str, shift=None, seed=None):
    """-> dk, dv [B, K, S, H]; each key/value head sums over its G query heads."""
    B, N, T, H = q.shape
    K, S, G, bq, bk = k.shape[1], k.shape[2], cfg.groups, cfg.block_q, cfg.block_kv
    nq, nk = T // bq, S // bk
    lists = _lists(cfg, lambda: visible_tiles(cfg, nq, nk).T)  # row j: the query blocks key block j is seen from
    args = (q, do, lse, delta)
    if cfg.driver == "loop":
        # Query-side operands as [B, K, G*T, .] (a free reshape): one block per kv head.
        args = tuple(x.reshape(B, K, G * T, x.shape[-1]) for x in args)
        slopes = None if slopes is None else slopes.reshape(K, G, 1)
        grid, scratch, kernel = (B, K, nk), (), _dkv_loop_kernel
        q_spec = pl.BlockSpec((None, None, G * T, H), lambda b, h, j: (b, h, 0, 0))
        row_spec = pl.BlockSpec((None, None, G * T, 1), lambda b, h, j: (b, h, 0, 0))
        kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, j: (b, h, j, 0))
        seg_specs = (pl.BlockSpec((None, T, 1), lambda b, h, j: (b, 0, 0)),
                     pl.BlockSpec((None, 1, bk), lambda b, h, j: (b, 0, j)))
        slope_spec = pl.BlockSpec((None, G, 1), lambda b, h, j: (h, 0, 0))
    else:
        grid, kernel = (B, K, nk, G, nq if lists is None else lists[0].shape[1]), _dkv_grid_kernel
        scratch = (_vmem((bk, H)), _vmem((bk, H)))

        def q_block(j, i, prefetch):
            lists, shift, _ = _prefetched(cfg, prefetch)
            return _listed(lists, j, i) if lists else _clamp(i, *q_block_range(j, cfg, bq, bk, nq, shift), nq)

        q_map = lambda b, h, j, g, i, *p: (b, h * G + g, q_block(j, i, p), 0)
        q_spec = pl.BlockSpec((None, None, bq, H), q_map)
        row_spec = pl.BlockSpec((None, None, bq, 1), q_map)
        kv_spec = pl.BlockSpec((None, None, bk, H), lambda b, h, j, g, i, *p: (b, h, j, 0))
        seg_specs = (pl.BlockSpec((None, bq, 1), lambda b, h, j, g, i, *p: (b, q_block(j, i, p), 0)),
                     pl.BlockSpec((None, 1, bk), lambda b, h, j, g, i, *p: (b, 0, j)))
        slope_spec = pl.BlockSpec((None, 1, 1), lambda b, h, j, g, i, *p: (h * G + g, 0, 0))
    extra_args, extra_specs = _extras(cfg, q_seg, kv_seg, slopes, *seg_specs, slope_spec, lists, shift, seed)
    out_shape = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    q_arg, do_arg, lse_arg, delta_arg = args
    return _call(kernel, cfg, backend, lists, grid=grid,
                 in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *extra_specs],
                 out_specs=(kv_spec, kv_spec), scratch=scratch, out_shape=out_shape, name="flash_attention_dkv",
                 num_sequential=len(grid) - 3, shift=shift, seed=seed,
                 cost=cost_estimate("flash_attention_dkv", cfg, q.shape, S, K, q.dtype.itemsize)
                 )(q_arg, k, v, do_arg, lse_arg, delta_arg, *extra_args)


# --------------------------------------------------------------------------------------
# custom_vjp core (on padded kernel-layout arrays) and the public wrapper
# --------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, q_seg, kv_seg, slopes, seed, cfg, cfg_dq, cfg_dkv, backend):
    return _fwd_call(q, k, v, q_seg, kv_seg, slopes, cfg, backend, seed=seed)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, slopes, seed, cfg, cfg_dq, cfg_dkv, backend):
    o, lse = _fwd_call(q, k, v, q_seg, kv_seg, slopes, cfg, backend, seed=seed)
    return o, (q, k, v, q_seg, kv_seg, slopes, seed, o, lse)


def _flash_bwd(cfg, cfg_dq, cfg_dkv, backend, residuals, do):
    q, k, v, q_seg, kv_seg, slopes, seed, o, lse = residuals
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    operands = (q, k, v, do, lse, delta, q_seg, kv_seg, slopes)
    dq = _dq_call(*operands, cfg_dq, backend, seed=seed)
    dk, dv = _dkv_call(*operands, cfg_dkv, backend, seed=seed)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _padded_head_dim(h: int) -> int:
    """64 and 128 natively; smaller dims pad to 64, others to the next power of two."""
    return max(64, pl.next_power_of_2(h))


def _fit(block: int, length: int, floor: int) -> int:
    """Shrinks a block to the (power-of-two rounded) sequence, not below `floor`."""
    return min(block, max(floor, pl.next_power_of_2(length)))


def pad_to(x, axis: int, size: int, value=0):
    """x padded at the end of `axis` to `size` with `value`."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


class _Prepared(NamedTuple):
    """Kernel-layout operands of one call (q [B, N, Tp, Hp], k, v [B, K, Sp, Hp], q_seg [B, Tp, 1],
    kv_seg [B, 1, Sp], slopes [N, 1, 1]) and its static settings."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_seg: Optional[jax.Array]
    kv_seg: Optional[jax.Array]
    slopes: Optional[jax.Array]
    cfg: TileConfig
    cfg_dq: TileConfig
    cfg_dkv: TileConfig
    backend: str
    padded: tuple  # (Tp, Sp, Hp)

    def to_kernel(self, x, length: int, value=0):
        """x [B, L, N, H] -> [B, N, Lp, Hp] (length: Tp or Sp), padded with value."""
        return pad_to(pad_to(x, 1, length, value), 3, self.padded[2]).transpose(0, 2, 1, 3)


def _prepare(q, k, v, *, causal: bool = False, q_segment_ids=None, kv_segment_ids=None,
             window: Optional[int] = None, alibi_slopes=None, softcap: Optional[float] = None,
             sparsity: Optional[sparsity_lib.Pattern] = None, scale: Optional[float] = None,
             block_sizes: Optional[BlockSizes] = None, backend: Optional[str] = None,
             interpret: Optional[bool] = None, dropout_rate: float = 0.0, shifted: bool = False) -> _Prepared:
    """Validates the options of `flash_attention`, picks the tiles and pads into the kernel layout."""
    B, T, N, H = q.shape
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate and shifted:
        raise ValueError("the blocks of context-parallel attention (block_forward/backward) take no dropout")
    S, K = k.shape[1], k.shape[2]
    backend = kernel_backend(backend, "flash attention")
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    if backend == "gpu" and not interpret:
        dtypes = sorted({jnp.dtype(x.dtype).name for x in (q, k, v)} - set(GPU_DTYPES))
        if dtypes:
            raise ValueError(f"flash attention on GPU takes {' or '.join(GPU_DTYPES)} q, k, v, not "
                             f"{'/'.join(dtypes)} (Triton's float32 dot runs off the tensor cores and "
                             f"spills registers): cast them to bfloat16, or use impl='xla'")
    scale = H ** -0.5 if scale is None else scale
    block_sizes = BlockSizes.default(backend, H) if block_sizes is None else block_sizes
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    if not interpret:
        block_sizes.check_backend(backend)
    floor = {"tpu": 128, "gpu": 16, "cpu": 8}[backend]
    tiles = [(_fit(bq, T, floor), _fit(bk, S, floor))  # forward, dQ, dK/dV
             for bq, bk in ((block_sizes.block_q, block_sizes.block_kv), block_sizes.backward, block_sizes.dkv)]
    Tp, Sp = (-(-L // max(sizes)) * max(sizes) for L, sizes in zip((T, S), zip(*tiles)))  # powers of two
    Hp = _padded_head_dim(H)

    q_seg, kv_seg = q_segment_ids, kv_segment_ids
    if kv_seg is not None and q_seg is None:  # key padding only: any non-zero id is visible
        kv_seg, q_seg = (kv_seg != 0).astype(jnp.int32), jnp.ones((B, T), jnp.int32)
    if kv_seg is not None:
        q_seg = pad_to(q_seg.astype(jnp.int32), 1, Tp)[:, :, None]    # [B, Tp, 1]
        kv_seg = pad_to(kv_seg.astype(jnp.int32), 1, Sp)[:, None, :]  # [B, 1, Sp]
    slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32).reshape(N, 1, 1)

    cfg = TileConfig(causal=causal, window=window, softcap=softcap, scale=float(scale),
                  kv_len=None if Sp == S else S, segments=kv_seg is not None, alibi=slopes is not None,
                  groups=N // K, block_q=tiles[0][0], block_kv=tiles[0][1],
                  driver="grid" if backend == "tpu" else "loop", interpret=interpret, sparsity=sparsity,
                  shifted=shifted, dropout=float(dropout_rate))
    cfg, cfg_dq, cfg_dkv = (cfg._replace(block_q=bq, block_kv=bk, launch=launch)
                            for (bq, bk), launch in zip(tiles, block_sizes.launches))
    if isinstance(sparsity, sparsity_lib.BigBird):
        for bq, bk in tiles:
            sparsity.check_tiles(bq, bk)
    prepared = _Prepared(None, None, None, q_seg, kv_seg, slopes, cfg, cfg_dq, cfg_dkv, backend, (Tp, Sp, Hp))
    return prepared._replace(q=prepared.to_kernel(q, Tp), k=prepared.to_kernel(k, Sp), v=prepared.to_kernel(v, Sp))


def _from_kernel(x, length: int, head_dim: int):
    """[B, N, Lp, Hp] -> [B, length, N, head_dim]."""
    return x.transpose(0, 2, 1, 3)[:, :length, :, :head_dim]


def flash_attention(q, k, v, *, dropout_rate: float = 0.0, dropout_seed=None, dropout_offsets=(0, 0), **options):
    """Flash attention. q [B, T, N, H]; k, v [B, S, K, H] -> [B, T, N, H].

    options: causal, q_segment_ids, kv_segment_ids, window, alibi_slopes, softcap, sparsity, scale,
    block_sizes, backend, interpret. backend: "tpu" (grid driver, Mosaic), "gpu" (loop driver,
    Triton; q, k, v in GPU_DTYPES) or "cpu"; default the JAX default backend. interpret: run the
    Pallas interpreter; default on CPU. sparsity (`tfm.kernels.sparsity`): both drivers visit only
    the tiles of `visible_tiles`.

    dropout_rate > 0: attention dropout on the normalised probabilities, the mask that of
    `tfm.kernels.dropout` for int32 [] dropout_seed (`dropout.seed(rng)`) at batch row b +
    dropout_offsets[0] and query head n + dropout_offsets[1] (ints or int32 scalars: a shard's place
    in the whole call, so a sharded call drops as the unsharded one does).
    """
    c = _prepare(q, k, v, dropout_rate=dropout_rate, **options)
    seed = None
    if c.cfg.dropout:
        if dropout_seed is None:
            raise ValueError("flash attention with dropout_rate > 0 needs a dropout_seed")
        seed = jnp.stack([jnp.asarray(x, jnp.int32).reshape(()) for x in (dropout_seed, *dropout_offsets)])
    o = _flash(c.q, c.k, c.v, c.q_seg, c.kv_seg, c.slopes, seed, c.cfg, c.cfg_dq, c.cfg_dkv, c.backend)
    return _from_kernel(o, q.shape[1], q.shape[3])


# --------------------------------------------------------------------------------------
# One block of a longer attention (context parallelism): query i at position i + shift relative
# to key 0, shift a traced int32 scalar; the softmax statistics come from the caller.
# --------------------------------------------------------------------------------------

def block_forward(q, k, v, shift, **options):
    """The forward kernel alone: o [B, T, N, H] (q dtype) and lse [B, N, T] (fp32, +inf on rows that
    see no key). options: those of `flash_attention` but sparsity."""
    c = _prepare(q, k, v, shifted=True, **options)
    o, lse = _fwd_call(c.q, c.k, c.v, c.q_seg, c.kv_seg, c.slopes, c.cfg, c.backend, shift)
    T = q.shape[1]
    return _from_kernel(o, T, q.shape[3]), lse[:, :, :T, 0]


def block_backward(q, k, v, do, lse, delta, shift, **options):
    """The dQ and dK/dV kernels for one block given the whole row's lse and delta = rowsum(dO * O)
    [B, N, T] (fp32): dq [B, T, N, H], dk, dv [B, S, K, H] (this block's share, input dtypes)."""
    c = _prepare(q, k, v, shifted=True, **options)
    Tp = c.padded[0]
    rows = lambda x, value: pad_to(x, 2, Tp, value)[..., None]  # [B, N, T] -> [B, N, Tp, 1]
    operands = (c.q, c.k, c.v, c.to_kernel(do, Tp), rows(lse, jnp.inf), rows(delta, 0.0), c.q_seg, c.kv_seg,
                c.slopes)
    dq = _dq_call(*operands, c.cfg_dq, c.backend, shift)
    dk, dv = _dkv_call(*operands, c.cfg_dkv, c.backend, shift)
    T, S, H = q.shape[1], k.shape[1], q.shape[3]
    return _from_kernel(dq, T, H), _from_kernel(dk, S, H), _from_kernel(dv, S, H)
