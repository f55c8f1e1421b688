"""Sparse MLA backward in three unchained kernels: probabilities, dq, dkv (fp32 scatter).

Per row chunk (the bf16 ``P`` / ``dS`` scratch is ``[rows, H, K]``):

- ``sparse_mla_bwd_kernel_preprocess``: ``delta = rowsum(out * dout)``, the sink-inclusive log-sum-exp
  (base 2) and each row's share of ``dsink`` (before the SM90 warp-specialized kernel, which forms delta itself:
  the log-sum-exp alone, ``dsink`` from that kernel's delta after the chunks).
- ``sparse_mla_bwd_kernel_ds``: per (row, head block) and ``BLOCK_K`` gathered slots, recomputes the logits
  and ``dO V^T`` and stores ``P`` and ``dS = scale * P * (dO V^T - delta)`` in bf16
  (``sparse_mla_bwd_kernel_ds_stacked``, ``KernelConfig(layout="stacked")``: the same with both as one matmul of
  stacked rows; forced only, slower than the ``heads`` layout on the H200).
- ``sparse_mla_bwd_kernel_dq``: ``dq = dS K`` over the gathered slots (fp32 accumulators).
- ``sparse_mla_bwd_kernel_dkv``: ``dkv[idx] += P^T dO + dS^T Q`` per slot block, already summed over the
  block's heads, added with fp32 atomics in column chunks of at most 128; ``DKV_COL_GROUPS`` programs per row
  split the value columns (fewer resident Q / dO columns each: two programs per SM instead of one), the rope
  tail then in a launch of its own; deterministic mode stores the per-slot pieces instead (one row per slot and
  head block) and ``sparse_mla_bwd_kernel_dkv_reduce`` sums each key's pieces in a fixed order.

Keeping the matmuls of a kernel independent of each other (no dot feeding another dot) lets the compiler
split the head block's logits between warpgroups instead of computing them twice (one per warpgroup), the
price being the bf16 ``P`` / ``dS`` round trip through memory.

On SM90 GPUs the default is ``sparse_mla_bwd_sm90_ws.py`` and ``sparse_mla_bwd_sm90.py`` instead (Gluon; which runs
when: :mod:`longtrain.dsa.triton.sparse_mla_bwd_plan`): a warp-specialized probabilities + dkv kernel and a dq kernel,
37.33 ms against 65.9 for the kernels here at T = 16384, H = 64, K = 2048 on the H200
(``benchmarks/results/dsa_mla_920af72_2026-12-02.md``); the kernels here run everywhere else, in the CPU interpreter,
and when forced (``impl="triton"``). Tried and removed: a Gluon
port of the probabilities kernel on the forward SM90 kernel's schedule (commit a54b47f): the backward took 69.3 ms
against 63.6 with the portable kernel at T = 16384, H = 64, K = 2048 on the H200
(``benchmarks/results/dsa_bwd_sm90_probabilities_2026-12-01.md``): with the warpgroups splitting 64 slots, both of
its matmuls are wgmma of N = 32.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from longtrain.dsa.triton import sparse_mla_bwd_plan as bwd_plan
from longtrain.dsa.triton._common import KernelConfig, dot_precision, interpreting, next_pow2, sm_count
from longtrain.dsa.triton.sparse_mla_bwd_plan import sm90_backward_plan, sm90_dq_plan
from longtrain.dsa.triton.sparse_mla_bwd_reduce import (
    ChunkRuns,
    dkv_reduce_chunk,
    piece_group_cols,
    scale_piece_rows,
    sparse_mla_bwd_kernel_dkv_reduce,
)
from longtrain.dsa.triton.sparse_mla_fwd import LOG2E, _row_col_mask, fwd_block_h

__all__ = [
    "DETERMINISTIC_SCRATCH_BYTES",
    "DETERMINISTIC_SCRATCH_ELEMENTS",
    "DET_PIECES",
    "DET_PIECES_MODES",
    "DET_REDUCE_OVERLAP",
    "DET_RUNS_AHEAD",
    "DKV_COL_GROUPS",
    "DKV_REDUCE_BATCH",
    "DKV_REDUCE_NUM_WARPS",
    "DQ_OVERLAP",
    "DQ_OVERLAP_MIN_CHUNKS",
    "DQ_OVERLAP_MODES",
    "DQ_PARTITION_SMS",
    "PDS_SCRATCH_BYTES",
    "sparse_mla_bwd",
    "sparse_mla_bwd_kernel_dkv",
    "sparse_mla_bwd_kernel_dkv_reduce",
    "sparse_mla_bwd_kernel_dq",
    "sparse_mla_bwd_kernel_ds",
    "sparse_mla_bwd_kernel_ds_stacked",
    "sparse_mla_bwd_kernel_preprocess",
    "sink_grad",
]

# (block_k, num_warps, num_stages) candidates per kernel, tried once per static shape by the autotuner.
_DS_CANDIDATES = ((32, 8, 2), (64, 8, 1), (32, 4, 2))
_DQ_CANDIDATES = ((64, 8, 2), (32, 8, 3), (128, 8, 1))
_DKV_CANDIDATES = ((64, 8, 2), (64, 8, 3), (64, 4, 2))
#: Programs per (row, head block) of the autotuned dkv kernel, each owning ``d_v / DKV_COL_GROUPS`` value columns
#: (the rope tail then has a launch of its own). 2 on the H200 at T = 16384, K = 2048: dkv 29.0 ms against 30.4
#: with 1 and 33.4 with 4 at H = 64 (58.3 / 60.7 / 67.0 at H = 128), each at its best candidate
#: (``benchmarks/results/dsa_bwd_variants_bdca98d_2026-12-01.md``). Read at each call.
DKV_COL_GROUPS = 2
#: Bytes of the bf16 P / dS scratch: rows are processed in chunks of ``PDS_SCRATCH_BYTES // (4 * H * K)`` rows (room
#: for P and dS; the SM90 fused kernels keep dS alone, so theirs use half of it). Read at each call.
PDS_SCRATCH_BYTES = 1 << 29
#: Elements (of the pieces' dtype, :data:`DET_PIECES`) of the deterministic mode's per-slot contribution scratch
#: (``[rows, K, dkv head blocks, D_qk]``): it sets the row chunk of a deterministic backward. ``None`` (the default):
#: :data:`DETERMINISTIC_SCRATCH_BYTES` of pieces, ``1 << 30`` two-byte or ``1 << 29`` fp32 elements (910 rows at
#: K = 2048, D_qk = 576, one head block, with two-byte pieces; on an SM90 GPU, as for every backward there, the chunk
#: is then rounded up to whole waves of programs: 924 rows on a 132-SM GPU). Never more than the backward's rows
#: need. Read at each call. The gradients do not depend on it (each chunk's reduction continues the running sum in
#: (row, slot) order): a larger scratch trades memory for speed only. Before the thirty-fourth session the default was
#: ``1 << 27`` fp32 elements (512 MiB): with bf16 pieces 2 GiB was 6-8 % faster than 512 MiB at issue 17's four
#: shapes on an H100 (``dsa_bwd_deterministic_d2e2d91_h100_2026-12-07.md``).
DETERMINISTIC_SCRATCH_ELEMENTS: int | None = None
#: The scratch's size in bytes where :data:`DETERMINISTIC_SCRATCH_ELEMENTS` is ``None``. Read at each call.
DETERMINISTIC_SCRATCH_BYTES = 1 << 31
#: With the SM90 probabilities + dkv kernel on CUDA: whether each row chunk's dq kernel runs on a second stream, beside
#: the next chunk's probabilities + dkv kernel (two dS buffers in the same scratch budget, chunks of at most
#: ``1 / DQ_OVERLAP_MIN_CHUNKS`` of the rows), so that the dq kernel's gathers overlap the other kernel's fp32
#: reductions instead of following them. ``"high"``: the second stream has the higher priority (its programs take
#: the SMs freed first); ``"same"``: the default priority; ``"partition"``: the probabilities + dkv kernel runs on a
#: high-priority stream of its own as one program per SM on all SMs but :data:`DQ_PARTITION_SMS`, and the dq kernels
#: (and in deterministic mode the reductions, whatever :data:`DET_REDUCE_OVERLAP` says: two piece buffers) run on the
#: caller's stream, on the SMs it leaves free and on those the next chunk's kernel does not take; ``None``: one
#: stream. dq and the deterministic mode's dkv are the same bit for bit either way (each dq row is one program's; the
#: reduction keeps its order). Read at each call.
DQ_OVERLAP: str | None = None
DQ_OVERLAP_MODES = (None, "high", "same", "partition")
DQ_OVERLAP_MIN_CHUNKS = 4
#: With ``DQ_OVERLAP = "partition"``: the SMs the probabilities + dkv kernel leaves to the other stream's kernels (an
#: int from 1 to the GPU's SM count - 1). Read at each call.
DQ_PARTITION_SMS = 32
#: With :data:`DQ_OVERLAP` on, in deterministic mode: whether each chunk's reduction of its dkv pieces follows its dq
#: kernel on the second stream (always with ``"partition"``) (two piece buffers, twice the scratch of
#: :data:`DETERMINISTIC_SCRATCH_ELEMENTS`), so that reading the pieces back overlaps the next chunk's probabilities
#: kernel writing its own. The chunks' reductions keep their order (one stream), so dkv is the same bit for bit. Read at
#: each call.
DET_REDUCE_OVERLAP = False
#: The dtype of the deterministic mode's per-slot dkv pieces: ``"fp32"``, or ``"bf16"``, which halves the bytes the
#: probabilities kernel writes and the reduction reads back (the traffic that bounds this mode; docs/dsa_triton.md).
#: With ``"bf16"`` each piece (one slot's sum over a head block) is rounded to bf16 before the fixed-order fp32 sum, so
#: dkv stays the same bit for bit on every run and schedule but differs from the fp32 pieces' by up to one bf16
#: rounding per piece. ``"fp16"``: each piece row divided by a power of two (its scale, stored beside it in fp32; see
#: :mod:`~longtrain.dsa.triton.sparse_mla_bwd_reduce`) and rounded to fp16, 11 significant bits at any gradient
#: magnitude, for up to 3 % more bytes than bf16 and the scales' work (3-13 % slower than bf16 pieces on an H100 at
#: issue 17's four shapes, 8x closer to the fp32 pieces' dkv). ``None`` (the default): ``"bf16"`` for a bf16 ``kv``, as
#: many significant bits as dkv itself, and ``"fp32"`` otherwise (scaled fp16 pieces have not been run with fp16
#: inputs on a GPU, so fp16 inputs keep fp32 pieces until they are). On the H200
#: the bf16 pieces with 2 GiB took the deterministic backward to 0.83x-0.88x of the default's speed at issue 17's four
#: shapes, against 0.61x-0.64x with fp32 pieces and 512 MiB (``dsa_bwd_deterministic_34a525d_h200_2026-12-07.md``);
#: their dkv's mean error against float64 is about 1.6x the fp32 pieces' (docs/dsa_triton.md), within the
#: flash-attention rule that the GPU tests check. Read at each call.
DET_PIECES: str | None = None
#: In deterministic mode on CUDA: whether each row chunk's runs of slots by key (a stable sort of its keys and a
#: search, many small kernels) are formed a chunk ahead on a side stream, beside the probabilities kernels and the
#: reductions, instead of between them on the caller's stream. The runs, and every bit of dkv, are the same either
#: way. 1.9-3.4 % faster with bf16 pieces and 2 GiB at three of issue 17's shapes on an H100, -0.1 to 1.8 % with fp32
#: pieces (``dsa_bwd_deterministic_ahead_<shape>_b04f08f_h100_2026-12-07.md``). Read at each call.
DET_RUNS_AHEAD = True
DET_PIECES_MODES = ("fp32", "bf16", "fp16")
#: Slots (a power of two) the deterministic reduction reads at a time per key row, their loads in flight together;
#: the sum is the sequential one whatever the value. ``None``: the measured choice, with bf16 pieces 8 where a slot has
#: one head block's piece (4-6 % faster for the whole backward than one at a time at issue 17's four shapes on an H100,
#: ``dsa_bwd_deterministic_d2e2d91_h100_2026-12-07.md``; 16 and 32 slower there,
#: ``dsa_bwd_deterministic_rsweep_5a8053c_h100_2026-12-07.md``) and 16 where it has two or more (more than 64 heads:
#: 2-4 % faster than 8 at both 128-head shapes in that run); 1 with fp32 pieces (1 and 8 equally fast,
#: ``dsa_bwd_deterministic_e86ec88_h100_2026-12-06.md``). Scaled fp16 pieces, two bytes too, take bf16's choice (not
#: swept: their reduction read 2-3 % slower than bf16's with it, ``dsa_breakdown_fp16_2f89fc8_h100_2026-12-07.md``).
#: Read at each call.
DKV_REDUCE_BATCH: int | None = None
#: Warps per program of the deterministic reduction (a power of two from 1 to 16; the sums do not depend on it). Read
#: at each call.
DKV_REDUCE_NUM_WARPS = 4


@triton.jit
def sparse_mla_bwd_kernel_preprocess(
    out_ptr, dout_ptr, lse_ptr, sink_ptr, delta_ptr, lse2_ptr, dsink_ptr,
    H: tl.constexpr, D_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINK: tl.constexpr,
    WITH_DELTA: tl.constexpr,
):  # fmt: skip
    """Per query row: ``lse2`` (log2 units, the sink folded in, +inf without keys) and, ``WITH_DELTA``,
    ``delta = rowsum(O * dO)`` and the row's ``dsink`` terms (the warp-specialized kernel computes delta itself)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    if WITH_DELTA:
        offs_v = tl.arange(0, BLOCK_DV)
        mask = mask_h[:, None] & (offs_v < D_V)[None, :]
        rows = t * (H * D_V) + offs_h[:, None] * D_V + offs_v[None, :]
        o = tl.load(out_ptr + rows, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_DV]
        do = tl.load(dout_ptr + rows, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_DV]
        delta = tl.sum(o * do, 1)  # [BLOCK_H]
        tl.store(delta_ptr + t * H + offs_h, delta, mask=mask_h)
    lse = tl.load(lse_ptr + t * H + offs_h, mask=mask_h, other=float("-inf"))  # [BLOCK_H]
    # Rows without keys carry lse = -inf; +inf makes every later exp2(s - lse) exactly 0.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + offs_h, mask=mask_h, other=float("-inf")) * 1.4426950408889634  # [BLOCK_H]
        top = tl.maximum(lse2, sink2)
        top_safe = tl.where((top == float("inf")) | (top == float("-inf")), 0.0, top)
        total = top_safe + tl.math.log2(tl.math.exp2(lse2 - top_safe) + tl.math.exp2(sink2 - top_safe))
        lse2 = tl.where(lse2 == float("inf"), float("inf"), total)
        if WITH_DELTA:
            tl.store(dsink_ptr + t * H + offs_h, -tl.math.exp2(sink2 - lse2) * delta, mask=mask_h)
    tl.store(lse2_ptr + t * H + offs_h, lse2, mask=mask_h)


@triton.jit
def _load_cols(base, row_mask, col0, W: tl.constexpr, D: tl.constexpr, FULL: tl.constexpr):
    """Columns ``col0 + [0, W)`` of the rows at ``base`` (``row_mask``: ``[BLOCK_H]``; FULL: all columns < D)."""
    offs = col0 + tl.arange(0, W)
    if FULL:
        return tl.load(base + offs[None, :], mask=row_mask[:, None], other=0.0)  # [BLOCK_H, W]
    else:
        return tl.load(base + offs[None, :], mask=row_mask[:, None] & (offs < D)[None, :], other=0.0)  # [BLOCK_H, W]


@triton.jit
def _dkv_out(dkv_ptr, rows, valid, value, col0, scale_ptr, group, W: tl.constexpr, D: tl.constexpr,
             D_QK: tl.constexpr, FULL: tl.constexpr, DETERMINISTIC: tl.constexpr, NUM_GROUPS: tl.constexpr,
             GROUP_COLS: tl.constexpr):  # fmt: skip
    """Add (atomics) or store (deterministic scratch) a ``[BLOCK_K, W]`` dkv piece at columns ``col0 + [0, W)``; scaled
    fp16 pieces (``NUM_GROUPS > 0``) store each row's scale at ``scale_ptr[row, group + j]`` for each of the tile's
    groups of ``GROUP_COLS`` columns that starts before ``D``."""
    offs = col0 + tl.arange(0, W)
    ptrs = dkv_ptr + rows[:, None] * D_QK + offs[None, :]
    if FULL:
        mask = valid[:, None]
    else:
        mask = valid[:, None] & (offs < D)[None, :]
    if DETERMINISTIC:
        if NUM_GROUPS > 0:
            value, scale = scale_piece_rows(value)  # [BLOCK_K, W], [BLOCK_K]
            for j in tl.static_range(W // GROUP_COLS):
                ok = valid & (rows * 0 + col0 + j * GROUP_COLS < D)
                tl.store(scale_ptr + rows * NUM_GROUPS + group + j, scale, mask=ok)
        tl.store(ptrs, value, mask=mask)
    else:
        tl.atomic_add(ptrs, value, mask=mask, sem="relaxed")


@triton.jit
def _slot_block(idx_row, k0, n_slots, T_k, D_QK: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    in_len = offs_k < n_slots
    idx = tl.load(idx_row + offs_k, mask=in_len, other=-1)  # [BLOCK_K]
    valid = in_len & (idx >= 0) & (idx < T_k)
    keys = tl.where(valid, idx, 0).to(tl.int64)  # [BLOCK_K]
    return offs_k, in_len, valid, keys


@triton.jit
def _row_slots(len_ptr, t, K_slots, HAS_LEN: tl.constexpr):
    if HAS_LEN:
        return tl.minimum(tl.maximum(tl.load(len_ptr + t).to(tl.int32), 0), K_slots)  # scalar
    else:
        return K_slots


@triton.jit(do_not_specialize=["row_offset", "T_k", "K_slots"])
def sparse_mla_bwd_kernel_ds(
    q_ptr, kv_ptr, dout_ptr, idx_ptr, len_ptr, lse2_ptr, delta_ptr, p_ptr, ds_ptr,
    row_offset, T_k, K_slots, sm_scale, qk_scale,
    H: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    HAS_LEN: tl.constexpr, STORE_P: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    D_QK: tl.constexpr = D_V + D_R
    NUM_HB: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    t_local = (pid // NUM_HB).to(tl.int64)
    t = row_offset + t_local
    offs_h = (pid % NUM_HB) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    q_rows = q_ptr + t * (H * D_QK) + offs_h[:, None] * D_QK
    hv_mask = _row_col_mask(mask_h, offs_v, D_V, BLOCK_DV)
    q_v = tl.load(q_rows + offs_v[None, :], mask=hv_mask, other=0.0)  # [BLOCK_H, BLOCK_DV]
    if D_R > 0:
        hr_mask = _row_col_mask(mask_h, offs_r, D_R, BLOCK_DR)
        q_r = tl.load(q_rows + D_V + offs_r[None, :], mask=hr_mask, other=0.0)  # [BLOCK_H, BLOCK_DR]
    do_rows = dout_ptr + t * (H * D_V) + offs_h[:, None] * D_V
    do_v = tl.load(do_rows + offs_v[None, :], mask=hv_mask, other=0.0)  # [BLOCK_H, BLOCK_DV]
    # Rows without keys have lse2 = +inf: every probability below is exactly 0.
    lse2 = tl.load(lse2_ptr + t * H + offs_h, mask=mask_h, other=float("inf"))  # [BLOCK_H]
    delta = tl.load(delta_ptr + t * H + offs_h, mask=mask_h, other=0.0)  # [BLOCK_H]
    n_slots = _row_slots(len_ptr, t, K_slots, HAS_LEN)
    idx_row = idx_ptr + t * K_slots
    scratch_rows = (t_local * H + offs_h.to(tl.int64)) * K_slots
    for k0 in range(0, n_slots, BLOCK_K):
        offs_k, in_len, valid, keys = _slot_block(idx_row, k0, n_slots, T_k, D_QK, BLOCK_K)
        kv_rows = kv_ptr + keys * D_QK
        kvv_mask = _row_col_mask(valid, offs_v, D_V, BLOCK_DV)
        kv_v = tl.load(kv_rows[:, None] + offs_v[None, :], mask=kvv_mask, other=0.0)  # [BLOCK_K, BLOCK_DV]
        s = tl.dot(q_v, tl.trans(kv_v), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_K]
        if D_R > 0:
            kvr_mask = _row_col_mask(valid, offs_r, D_R, BLOCK_DR)
            kv_r = tl.load(kv_rows[:, None] + D_V + offs_r[None, :], mask=kvr_mask, other=0.0)  # [BLOCK_K, BLOCK_DR]
            s = tl.dot(q_r, tl.trans(kv_r), s, input_precision=DOT_PREC)
        dp = tl.dot(do_v, tl.trans(kv_v), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_K]
        p = tl.where(valid[None, :], tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None]) * sm_scale  # [BLOCK_H, BLOCK_K]
        ptrs = scratch_rows[:, None] + offs_k[None, :]
        mask = mask_h[:, None] & in_len[None, :]
        tl.store(ds_ptr + ptrs, ds.to(ds_ptr.dtype.element_ty), mask=mask)
        if STORE_P:
            tl.store(p_ptr + ptrs, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["row_offset", "T_k", "K_slots"])
def sparse_mla_bwd_kernel_ds_stacked(
    q_ptr, kv_ptr, dout_ptr, idx_ptr, len_ptr, lse2_ptr, delta_ptr, p_ptr, ds_ptr,
    row_offset, T_k, K_slots, sm_scale, qk_scale,
    H: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    HAS_LEN: tl.constexpr, STORE_P: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``sparse_mla_bwd_kernel_ds`` with the logits and ``dO V^T`` as one dot of ``2 * BLOCK_H`` stacked rows,
    ``[S; dP] = [Q_v Q_r; dO 0] [K_v K_r]^T`` (they share the gathered rows as B operand): one matmul per slot
    block instead of two, each warpgroup its own 64 rows at 8 warps."""
    D_QK: tl.constexpr = D_V + D_R
    NUM_HB: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    t_local = (pid // NUM_HB).to(tl.int64)
    t = row_offset + t_local
    hb = pid % NUM_HB
    offs_m = tl.arange(0, 2 * BLOCK_H)
    head = hb * BLOCK_H + offs_m % BLOCK_H  # [2 * BLOCK_H]: rows 0..BLOCK_H-1 logits, the rest dO V^T
    is_s = offs_m < BLOCK_H
    ok = head < H
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    in_v = offs_v < D_V
    q_rows = q_ptr + t * (H * D_QK) + head[:, None] * D_QK
    do_rows = dout_ptr + t * (H * D_V) + head[:, None] * D_V
    a_v = tl.load(q_rows + offs_v[None, :], mask=(ok & is_s)[:, None] & in_v[None, :], other=0.0)
    a_v += tl.load(do_rows + offs_v[None, :], mask=(ok & ~is_s)[:, None] & in_v[None, :], other=0.0)  # [2BH, BDV]
    if D_R > 0:
        rmask = (ok & is_s)[:, None] & (offs_r < D_R)[None, :]
        a_r = tl.load(q_rows + D_V + offs_r[None, :], mask=rmask, other=0.0)  # [2 * BLOCK_H, BLOCK_DR]
    # Rows without keys have lse2 = +inf: every probability below is exactly 0.
    lse2 = tl.load(lse2_ptr + t * H + head, mask=ok, other=float("inf"))  # [2 * BLOCK_H]
    delta = tl.load(delta_ptr + t * H + head, mask=ok, other=0.0)  # [2 * BLOCK_H]
    shift = tl.where(is_s, lse2, delta)
    scale = tl.where(is_s, qk_scale, 1.0)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    n_slots = _row_slots(len_ptr, t, K_slots, HAS_LEN)
    idx_row = idx_ptr + t * K_slots
    scratch_rows = (t_local * H + offs_h.to(tl.int64)) * K_slots
    for k0 in range(0, n_slots, BLOCK_K):
        offs_k, in_len, valid, keys = _slot_block(idx_row, k0, n_slots, T_k, D_QK, BLOCK_K)
        kv_rows = kv_ptr + keys * D_QK
        kvv_mask = _row_col_mask(valid, offs_v, D_V, BLOCK_DV)
        kv_v = tl.load(kv_rows[:, None] + offs_v[None, :], mask=kvv_mask, other=0.0)  # [BLOCK_K, BLOCK_DV]
        c = tl.dot(a_v, tl.trans(kv_v), input_precision=DOT_PREC)  # [2 * BLOCK_H, BLOCK_K]
        if D_R > 0:
            kvr_mask = _row_col_mask(valid, offs_r, D_R, BLOCK_DR)
            kv_r = tl.load(kv_rows[:, None] + D_V + offs_r[None, :], mask=kvr_mask, other=0.0)  # [BLOCK_K, BLOCK_DR]
            c = tl.dot(a_r, tl.trans(kv_r), c, input_precision=DOT_PREC)
        # Top rows: P (0 on invalid slots); bottom rows: dP - delta. They meet per (head, slot) through a split.
        x = c * scale[:, None] - shift[:, None]
        x = tl.where(is_s[:, None], tl.where(valid[None, :], tl.math.exp2(x), 0.0), x)  # [2 * BLOCK_H, BLOCK_K]
        p, d = tl.split(tl.permute(tl.reshape(x, [2, BLOCK_H, BLOCK_K]), (1, 2, 0)))  # [BLOCK_H, BLOCK_K] x 2
        ds = p * d * sm_scale
        ptrs = scratch_rows[:, None] + offs_k[None, :]
        mask = mask_h[:, None] & in_len[None, :]
        tl.store(ds_ptr + ptrs, ds.to(ds_ptr.dtype.element_ty), mask=mask)
        if STORE_P:
            tl.store(p_ptr + ptrs, p.to(p_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["row_offset", "T_k", "K_slots"])
def sparse_mla_bwd_kernel_dq(
    kv_ptr, idx_ptr, len_ptr, ds_ptr, dq_ptr,
    row_offset, T_k, K_slots,
    H: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    HAS_LEN: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    D_QK: tl.constexpr = D_V + D_R
    NUM_HB: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    t_local = (pid // NUM_HB).to(tl.int64)
    t = row_offset + t_local
    offs_h = (pid % NUM_HB) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    n_slots = _row_slots(len_ptr, t, K_slots, HAS_LEN)
    idx_row = idx_ptr + t * K_slots
    scratch_rows = (t_local * H + offs_h.to(tl.int64)) * K_slots
    dq_v = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    dq_r = tl.zeros([BLOCK_H, BLOCK_DR], tl.float32)
    for k0 in range(0, n_slots, BLOCK_K):
        offs_k, in_len, valid, keys = _slot_block(idx_row, k0, n_slots, T_k, D_QK, BLOCK_K)
        tile_mask = mask_h[:, None] & in_len[None, :]
        ds = tl.load(ds_ptr + scratch_rows[:, None] + offs_k[None, :], mask=tile_mask, other=0.0)  # [BLOCK_H, BLOCK_K]
        kv_rows = kv_ptr + keys * D_QK
        kvv_mask = _row_col_mask(valid, offs_v, D_V, BLOCK_DV)
        kv_v = tl.load(kv_rows[:, None] + offs_v[None, :], mask=kvv_mask, other=0.0)  # [BLOCK_K, BLOCK_DV]
        dq_v = tl.dot(ds, kv_v, dq_v, input_precision=DOT_PREC)
        if D_R > 0:
            kvr_mask = _row_col_mask(valid, offs_r, D_R, BLOCK_DR)
            kv_r = tl.load(kv_rows[:, None] + D_V + offs_r[None, :], mask=kvr_mask, other=0.0)  # [BLOCK_K, BLOCK_DR]
            dq_r = tl.dot(ds, kv_r, dq_r, input_precision=DOT_PREC)
    dq_rows = dq_ptr + t * (H * D_QK) + offs_h[:, None] * D_QK
    tl.store(
        dq_rows + offs_v[None, :], dq_v.to(dq_ptr.dtype.element_ty), mask=_row_col_mask(mask_h, offs_v, D_V, BLOCK_DV)
    )
    if D_R > 0:
        tl.store(
            dq_rows + D_V + offs_r[None, :],
            dq_r.to(dq_ptr.dtype.element_ty),
            mask=_row_col_mask(mask_h, offs_r, D_R, BLOCK_DR),
        )


@triton.jit(do_not_specialize=["row_offset", "T_k", "K_slots"])
def sparse_mla_bwd_kernel_dkv(
    q_ptr, dout_ptr, idx_ptr, len_ptr, p_ptr, ds_ptr, dkv_ptr, scale_ptr,
    row_offset, T_k, K_slots,
    H: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, NUM_VC: tl.constexpr,
    COL_GROUPS: tl.constexpr, PART: tl.constexpr,
    HAS_LEN: tl.constexpr, DETERMINISTIC: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_K: tl.constexpr, NUM_GROUPS: tl.constexpr = 0, GROUP_COLS: tl.constexpr = 16,
):  # fmt: skip
    """Program ``(g, row x head block)``. PART 0: value columns and rope tail (``COL_GROUPS = 1``); PART 1: value
    columns ``[g * GW, (g + 1) * GW)`` only, ``GW = BLOCK_DV / COL_GROUPS``; PART 2: the rope tail only (grid
    ``(1, ...)``). The value columns go in ``NUM_VC`` chunks of ``VC = GW / NUM_VC``. Scaled fp16 pieces
    (``NUM_GROUPS > 0``): a scale per ``GROUP_COLS`` columns of each chunk and of the rope tail
    (:func:`~longtrain.dsa.triton.sparse_mla_bwd_reduce.piece_group_cols` of widths ``VC`` and ``BLOCK_DR``)."""
    D_QK: tl.constexpr = D_V + D_R
    GW: tl.constexpr = BLOCK_DV // COL_GROUPS
    VC: tl.constexpr = GW // NUM_VC
    FULL: tl.constexpr = BLOCK_DV == D_V
    DO_V: tl.constexpr = PART != 2
    DO_R: tl.constexpr = (PART != 1) & (D_R > 0)
    NUM_HB: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    c0 = tl.program_id(0) * GW
    g0 = c0 // GROUP_COLS  # the first value chunk's first scale group
    GV: tl.constexpr = VC // GROUP_COLS  # scale groups per value chunk
    pid = tl.program_id(1)
    t_local = (pid // NUM_HB).to(tl.int64)
    t = row_offset + t_local
    offs_h = (pid % NUM_HB) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_r = tl.arange(0, BLOCK_DR)
    q_rows = q_ptr + t * (H * D_QK) + offs_h[:, None] * D_QK
    do_rows = dout_ptr + t * (H * D_V) + offs_h[:, None] * D_V
    # Q and dO stay resident: this group's value columns in up to four chunks, and the rope tail.
    if DO_V:
        q0 = _load_cols(q_rows, mask_h, c0, VC, D_V, FULL)  # [BLOCK_H, VC]
        do0 = _load_cols(do_rows, mask_h, c0, VC, D_V, FULL)  # [BLOCK_H, VC]
        if NUM_VC >= 2:
            q1 = _load_cols(q_rows, mask_h, c0 + VC, VC, D_V, FULL)  # [BLOCK_H, VC]
            do1 = _load_cols(do_rows, mask_h, c0 + VC, VC, D_V, FULL)  # [BLOCK_H, VC]
        if NUM_VC >= 4:
            q2 = _load_cols(q_rows, mask_h, c0 + 2 * VC, VC, D_V, FULL)  # [BLOCK_H, VC]
            do2 = _load_cols(do_rows, mask_h, c0 + 2 * VC, VC, D_V, FULL)  # [BLOCK_H, VC]
            q3 = _load_cols(q_rows, mask_h, c0 + 3 * VC, VC, D_V, FULL)  # [BLOCK_H, VC]
            do3 = _load_cols(do_rows, mask_h, c0 + 3 * VC, VC, D_V, FULL)  # [BLOCK_H, VC]
    if DO_R:
        hr_mask = _row_col_mask(mask_h, offs_r, D_R, BLOCK_DR)
        q_r = tl.load(q_rows + D_V + offs_r[None, :], mask=hr_mask, other=0.0)  # [BLOCK_H, BLOCK_DR]
    n_slots = _row_slots(len_ptr, t, K_slots, HAS_LEN)
    idx_row = idx_ptr + t * K_slots
    scratch_rows = (t_local * H + offs_h.to(tl.int64)) * K_slots
    for k0 in range(0, n_slots, BLOCK_K):
        offs_k, in_len, valid, keys = _slot_block(idx_row, k0, n_slots, T_k, D_QK, BLOCK_K)
        tile = scratch_rows[:, None] + offs_k[None, :]
        tile_mask = mask_h[:, None] & in_len[None, :]
        ds_t = tl.trans(tl.load(ds_ptr + tile, mask=tile_mask, other=0.0))  # [BLOCK_K, BLOCK_H]
        # dkv rows: the shared atomic target, or this row's slots in the deterministic scratch.
        if DETERMINISTIC:  # one scratch row per (row, slot, head block): head blocks never overwrite each other
            out_rows = (t_local * K_slots + offs_k.to(tl.int64)) * NUM_HB + pid % NUM_HB
        else:
            out_rows = keys
        if DO_V:
            p_t = tl.trans(tl.load(p_ptr + tile, mask=tile_mask, other=0.0))  # [BLOCK_K, BLOCK_H]
            piece = tl.dot(p_t, do0, input_precision=DOT_PREC)  # [BLOCK_K, VC]
            piece = tl.dot(ds_t, q0, piece, input_precision=DOT_PREC)
            _dkv_out(dkv_ptr, out_rows, valid, piece, c0, scale_ptr, g0, VC, D_V, D_QK, FULL, DETERMINISTIC, NUM_GROUPS,
                     GROUP_COLS)  # fmt: skip
            if NUM_VC >= 2:
                piece = tl.dot(p_t, do1, input_precision=DOT_PREC)
                piece = tl.dot(ds_t, q1, piece, input_precision=DOT_PREC)
                _dkv_out(dkv_ptr, out_rows, valid, piece, c0 + VC, scale_ptr, g0 + 1 * GV, VC, D_V, D_QK,
                         FULL, DETERMINISTIC, NUM_GROUPS, GROUP_COLS)  # fmt: skip
            if NUM_VC >= 4:
                piece = tl.dot(p_t, do2, input_precision=DOT_PREC)
                piece = tl.dot(ds_t, q2, piece, input_precision=DOT_PREC)
                _dkv_out(dkv_ptr, out_rows, valid, piece, c0 + 2 * VC, scale_ptr, g0 + 2 * GV, VC, D_V, D_QK,
                         FULL, DETERMINISTIC, NUM_GROUPS, GROUP_COLS)  # fmt: skip
                piece = tl.dot(p_t, do3, input_precision=DOT_PREC)
                piece = tl.dot(ds_t, q3, piece, input_precision=DOT_PREC)
                _dkv_out(dkv_ptr, out_rows, valid, piece, c0 + 3 * VC, scale_ptr, g0 + 3 * GV, VC, D_V, D_QK,
                         FULL, DETERMINISTIC, NUM_GROUPS, GROUP_COLS)  # fmt: skip
        if DO_R:
            piece = tl.dot(ds_t, q_r, input_precision=DOT_PREC)  # [BLOCK_K, BLOCK_DR]
            _dkv_out(dkv_ptr + D_V, out_rows, valid, piece, 0, scale_ptr, D_V // GROUP_COLS, BLOCK_DR, D_R, D_QK,
                     BLOCK_DR == D_R, DETERMINISTIC, NUM_GROUPS, GROUP_COLS)  # fmt: skip


_AUTOTUNED: dict[str, object] = {}


def _autotuned(name: str, kernel, candidates, reset: list[str] | None = None):
    tuned = _AUTOTUNED.get(name)
    if tuned is None:
        configs = [triton.Config({"BLOCK_K": bk}, num_warps=w, num_stages=s) for bk, w, s in candidates]
        # Static model dims only: token counts never re-trigger tuning.
        tuned = triton.autotune(configs=configs, key=["H", "D_V", "D_R", "BLOCK_H"], reset_to_zero=reset)(kernel)
        _AUTOTUNED[name] = tuned
    return tuned


def _launch(name, kernel, candidates, grid, args, meta, config, reset=None) -> None:
    if config is not None:
        kernel[grid](*args, **meta, BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        _autotuned(name, kernel, candidates, reset)[grid](*args, **meta)


def _dkv_col_groups(config: KernelConfig | None, block_dv: int) -> int:
    """Programs per row of the dkv kernel's value columns: the config's ``col_groups`` (``DKV_COL_GROUPS`` when
    autotuned), at most ``block_dv / 16`` (each group's chunks are at least 16 columns wide)."""
    wanted = config.col_groups if config is not None else DKV_COL_GROUPS
    return max(1, min(wanted, block_dv // 16))


def _num_value_chunks(block_dv: int) -> int:
    return max(1, min(4, block_dv // 128))


def sparse_mla_bwd(
    q: torch.Tensor,
    kv2d: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    idx: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    *,
    deterministic: bool,
    compute_dkv: bool,
    configs: tuple[KernelConfig | None, KernelConfig | None, KernelConfig | None],
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`sparse_mla_fwd`; ``configs`` force the (ds, dq, dkv) kernels (None = autotuned).

    Returns:
        ``(dq [T, H, D_qk]`` in ``q.dtype``, ``dkv [T_k, D_qk]`` in ``kv.dtype`` or None,
        ``dsink [H] fp32`` or None).
    """
    num_tokens, num_heads, d_qk = q.shape
    num_keys = kv2d.shape[0]
    k_slots = idx.shape[1]
    d_r = d_qk - d_v
    dev = q.device
    dq = torch.empty_like(q)
    dkv_acc = torch.zeros((num_keys, d_qk), dtype=torch.float32, device=dev) if compute_dkv else None
    if num_tokens == 0:
        dkv = dkv_acc.to(kv2d.dtype) if compute_dkv else None
        return dq, dkv, (torch.zeros_like(attn_sink) if attn_sink is not None else None)

    dout = dout.contiguous()
    ds_sm90 = sm90_backward_plan(q, d_v, configs[0], compute_dkv=compute_dkv, dkv_forced=configs[2] is not None)
    fused = ds_sm90 is not None and ds_sm90[0] in ("fused", "fused_ws")
    # The warp-specialized kernel forms delta itself (its producer, under the first tile): the preprocess then reads
    # lse alone, not O and dO (0.48 ms of HBM traffic at T = 16384, H = 64). Rows without slots keep delta = 0, exact
    # since their O is 0.
    ws_delta = fused and ds_sm90[0] == "fused_ws"
    delta = (torch.zeros if ws_delta else torch.empty)((num_tokens, num_heads), dtype=torch.float32, device=dev)
    lse2 = torch.empty_like(delta)
    dsink_rows = torch.empty_like(delta) if attn_sink is not None and not ws_delta else delta
    block_h_all = max(16, next_pow2(num_heads))
    sparse_mla_bwd_kernel_preprocess[(num_tokens,)](
        out, dout, lse, attn_sink if attn_sink is not None else lse, delta, lse2, dsink_rows,
        H=num_heads, D_V=d_v, BLOCK_H=block_h_all, BLOCK_DV=next_pow2(d_v), HAS_SINK=attn_sink is not None,
        WITH_DELTA=not ws_delta, num_warps=4 if block_h_all * next_pow2(d_v) <= 8192 else 8,
    )  # fmt: skip
    dq_sm90 = sm90_dq_plan(q, d_v, configs[1])
    if interpreting():
        configs = tuple(c or KernelConfig(block_k=16, num_warps=4, num_stages=1) for c in configs)
    cfg_ds, cfg_dq, cfg_dkv = configs
    # Heads per program, per kernel: its config's block_h (autotuned: 64; 32 for the probabilities kernel was 1.5x
    # slower on the H200, benchmarks/results/dsa_bwd_variants_ds_dc1abc5_2026-12-01.md).
    bh = [fwd_block_h(num_heads, c.block_h if c is not None else 64) for c in configs]
    n_hb = [triton.cdiv(num_heads, b) for b in bh]
    block_dv = next_pow2(d_v)
    dims = dict(
        H=num_heads,
        D_V=d_v,
        D_R=d_r,
        BLOCK_DV=block_dv,
        BLOCK_DR=next_pow2(d_r) if d_r > 0 else 16,
        HAS_LEN=topk_length is not None,
        DOT_PREC=dot_precision(q.dtype),
    )
    len_arg = topk_length if topk_length is not None else idx
    col_groups = _dkv_col_groups(cfg_dkv, block_dv)

    rows_per_chunk = max(1, PDS_SCRATCH_BYTES // (2 * 2 * num_heads * k_slots))
    if compute_dkv and deterministic:
        piece_dtype = _piece_dtype(kv2d.dtype)
        rows_per_chunk = min(rows_per_chunk, max(1, _scratch_elements(piece_dtype) // (k_slots * d_qk * n_hb[2])))
    streams = _dq_streams(fused and dq_sm90 is not None, dev)
    if streams is not None:  # two dS buffers (the fused kernels keep no P) in the budget of dS and P
        rows_per_chunk = min(rows_per_chunk, triton.cdiv(num_tokens, DQ_OVERLAP_MIN_CHUNKS))
    if ds_sm90 is not None and dev.type == "cuda":
        rows_per_chunk = _whole_waves(num_tokens, rows_per_chunk, triton.cdiv(num_heads, 64), dev)
    rows_per_chunk = min(rows_per_chunk, num_tokens)
    if rows_per_chunk == num_tokens:
        streams = None
    partition = streams is not None and DQ_OVERLAP == "partition"
    reserve_sms = _partition_sms(dev) if partition else 0
    if partition:  # the kernel's stream starts after everything the caller's stream has queued (the inputs)
        streams[0].wait_stream(streams[1])
    ds_bufs = [torch.empty((rows_per_chunk, num_heads, k_slots), dtype=q.dtype, device=dev)
               for _ in range(1 if streams is None else 2)]  # fmt: skip
    ds_buf = ds_bufs[0]
    p_buf = torch.empty_like(ds_buf) if compute_dkv and not fused else ds_buf
    dq_done: list[torch.cuda.Event] = []
    contrib = None
    # With the partition the reductions always follow dq on the caller's stream: the kernel's own stream runs ahead.
    reduce_side = streams is not None and fused and compute_dkv and deterministic and (DET_REDUCE_OVERLAP or partition)
    scales, group_cols = None, 0  # scaled fp16 pieces: scales, columns per scale group
    if compute_dkv and deterministic:
        batch = _reduce_batch(piece_dtype, n_hb[2])
        warps = _reduce_warps()
        n_pieces = rows_per_chunk * k_slots * n_hb[2]
        bufs = 2 if reduce_side else 1
        contribs = [torch.empty((n_pieces, d_qk), dtype=piece_dtype, device=dev) for _ in range(bufs)]
        contrib = contribs[0]
        if piece_dtype == torch.float16:
            if fused and ds_sm90[0] == "fused_ws":  # one scale per piece row, from a bound (_scale_slots)
                group_cols = min(1024, next_pow2(d_qk))  # the reduction's column block: one group per block
            else:  # each tile's own scale: the two-warpgroup kernel's halves, the portable kernel's chunks
                value_cols = d_v // 2 if fused else block_dv // col_groups // _num_value_chunks(block_dv // col_groups)
                group_cols = piece_group_cols(d_v, d_r, value_cols, d_r if fused else dims["BLOCK_DR"])
            n_groups = triton.cdiv(d_qk, group_cols)
            scale_bufs = [torch.empty((n_pieces, n_groups), dtype=torch.float32, device=dev) for _ in range(bufs)]
            scales = scale_bufs[0]
        chunks = [(r0, min(rows_per_chunk, num_tokens - r0)) for r0 in range(0, num_tokens, rows_per_chunk)]
        chunk_runs = ChunkRuns(idx, topk_length, num_keys, k_slots, chunks, _runs_stream(dev))

        def reduce_chunk(row0: int, rows: int) -> None:  # the current chunk's pieces (and scales) into dkv_acc
            runs = chunk_runs.take(row0 // rows_per_chunk)
            dkv_reduce_chunk(runs, k_slots, contrib, dkv_acc, rows, d_qk, n_hb[2], batch, warps, scales, group_cols)

    for chunk, row0 in enumerate(range(0, num_tokens, rows_per_chunk)):
        rows = min(rows_per_chunk, num_tokens - row0)
        if streams is not None:
            ds_buf = ds_bufs[chunk % 2]
            if reduce_side:
                contrib = contribs[chunk % 2]
                scales = scale_bufs[chunk % 2] if scales is not None else None
            if chunk >= 2:  # the second stream's work of two chunks ago has read these buffers
                streams[0].wait_event(dq_done[chunk - 2])
        common = (idx, len_arg)
        ds_args = (q, kv2d, dout, *common, lse2, delta, p_buf, ds_buf, row0, num_keys, k_slots, softmax_scale,
                   softmax_scale * LOG2E)  # fmt: skip
        if fused and ds_sm90[0] == "fused_ws":
            from longtrain.dsa.triton import sparse_mla_bwd_sm90_ws as ws

            head_blocks = triton.cdiv(num_heads, 64)
            programs, run = ws.ws_bwd_schedule(rows * head_blocks, head_blocks, dev, deterministic=deterministic,
                                               reserve_sms=reserve_sms)  # fmt: skip
            with torch.cuda.stream(streams[0]) if partition else contextlib.nullcontext():
                ws.sparse_mla_bwd_sm90_ws_kernel[(programs,)](
                    q, kv2d, dout, out, *common, lse2, delta, ds_buf, contrib if deterministic else dkv_acc,
                    scales if scales is not None else lse2, row0, rows, num_keys, k_slots, softmax_scale,
                    softmax_scale * LOG2E, H=num_heads, D_V=d_v, D_R=d_r,
                    HAS_LEN=topk_length is not None, DETERMINISTIC=deterministic, REGS_PROB=ws.WS_BWD_NUM_REGS[0],
                    REGS_PRODUCER=ws.WS_BWD_NUM_REGS[1], PREFETCH_IDX=ws.WS_BWD_PREFETCH_IDX,
                    STAGED_DS=ws.WS_BWD_STAGED_DS, RUN=run, SCALED=scales is not None, GROUP_COLS=group_cols or 64,
                    num_warps=4, maxnreg=ws.WS_BWD_MAXNREG,
                )  # fmt: skip
        elif fused:
            from longtrain.dsa.triton.sparse_mla_bwd_sm90 import sparse_mla_bwd_sm90_kernel_ds_dkv

            sparse_mla_bwd_sm90_kernel_ds_dkv[(rows * triton.cdiv(num_heads, 64),)](
                q, kv2d, dout, *common, lse2, delta, ds_buf, contrib if deterministic else dkv_acc,
                scales if scales is not None else lse2, row0, num_keys, k_slots, softmax_scale, softmax_scale * LOG2E,
                H=num_heads, D_V=d_v, D_R=d_r, HAS_LEN=topk_length is not None, DETERMINISTIC=deterministic,
                SCALED=scales is not None, GROUP_COLS=group_cols or 64, num_warps=8,
            )  # fmt: skip
        elif ds_sm90 is not None:
            from longtrain.dsa.triton.sparse_mla_bwd_sm90 import sparse_mla_bwd_sm90_kernel_ds

            sparse_mla_bwd_sm90_kernel_ds[(rows * triton.cdiv(num_heads, 64),)](
                *ds_args, H=num_heads, D_V=d_v, D_R=d_r, HAS_LEN=topk_length is not None, STORE_P=compute_dkv,
                BLOCK_K=ds_sm90[1], NUM_BUF=ds_sm90[2], num_warps=8,
            )  # fmt: skip
        else:
            meta = dict(dims, BLOCK_H=bh[0], STORE_P=compute_dkv)
            stacked = cfg_ds is not None and cfg_ds.layout == "stacked"
            kernel = sparse_mla_bwd_kernel_ds_stacked if stacked else sparse_mla_bwd_kernel_ds
            _launch("ds", kernel, _DS_CANDIDATES, (rows * n_hb[0],), ds_args, meta, cfg_ds)
        if streams is not None:  # this chunk's dq on the second stream, once its dS is written
            main, side = streams
            side.wait_stream(main)
            with torch.cuda.stream(side):
                _dq_sm90(dq_sm90, kv2d, common, ds_buf, dq, row0, rows, num_keys, k_slots, num_heads, d_v, d_r,
                         topk_length is not None)  # fmt: skip
                if reduce_side:
                    reduce_chunk(row0, rows)
                dq_done.append(torch.cuda.Event())
                dq_done[-1].record(side)
        elif dq_sm90 is not None:
            _dq_sm90(dq_sm90, kv2d, common, ds_buf, dq, row0, rows, num_keys, k_slots, num_heads, d_v, d_r,
                     topk_length is not None)  # fmt: skip
        else:
            _launch(
                "dq", sparse_mla_bwd_kernel_dq, _DQ_CANDIDATES, (rows * n_hb[1],),
                (kv2d, *common, ds_buf, dq, row0, num_keys, k_slots), dict(dims, BLOCK_H=bh[1]), cfg_dq,
            )  # fmt: skip
        if fused and deterministic and compute_dkv and not reduce_side:
            reduce_chunk(row0, rows)
        if not compute_dkv or fused:
            continue
        target = contrib if deterministic else dkv_acc
        dkv_args = (q, dout, *common, p_buf, ds_buf, target, scales if scales is not None else target, row0, num_keys,
                    k_slots)  # fmt: skip
        reset = None if deterministic else ["dkv_ptr"]
        meta = dict(dims, BLOCK_H=bh[2], NUM_VC=_num_value_chunks(block_dv // col_groups), COL_GROUPS=col_groups,
                    PART=0 if col_groups == 1 else 1, DETERMINISTIC=deterministic,
                    NUM_GROUPS=0 if scales is None else scales.shape[1], GROUP_COLS=group_cols or 16)  # fmt: skip
        grid = (col_groups, rows * n_hb[2])
        _launch("dkv", sparse_mla_bwd_kernel_dkv, _DKV_CANDIDATES, grid, dkv_args, meta, cfg_dkv, reset)
        if col_groups > 1 and d_r > 0:  # the rope tail: its own launch (the same tuned config)
            meta = dict(meta, NUM_VC=1, COL_GROUPS=1, PART=2)
            grid = (1, rows * n_hb[2])
            _launch("dkv", sparse_mla_bwd_kernel_dkv, _DKV_CANDIDATES, grid, dkv_args, meta, cfg_dkv, reset)
        if deterministic:
            reduce_chunk(row0, rows)
    if streams is not None:  # dq is complete before anything after the backward reads it (or frees the buffers)
        streams[0].wait_stream(streams[1])
    dsink = None
    if attn_sink is not None:
        dsink = sink_grad(attn_sink, lse2, delta) if ws_delta else dsink_rows.sum(0)
    dkv = dkv_acc.to(kv2d.dtype) if compute_dkv else None
    return dq, dkv, dsink


def _dq_streams(applies: bool, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream] | None:
    """``(main, side)`` streams when :data:`DQ_OVERLAP` is on and ``applies`` (the SM90 fused probabilities kernel and
    the SM90 dq kernel) on CUDA outside the interpreter, else None: ``main`` runs the probabilities kernels, ``side``
    the dq kernels (the current stream and a second one; with ``"partition"`` a high-priority stream of the kernel's
    own and the current stream)."""
    if DQ_OVERLAP not in DQ_OVERLAP_MODES:
        raise ValueError(f"sparse_mla_bwd.DQ_OVERLAP must be one of {DQ_OVERLAP_MODES}, got {DQ_OVERLAP!r}")
    if DQ_OVERLAP is None or not applies or device.type != "cuda" or interpreting():
        return None
    # Lower numbers are higher priorities; -1 is valid on every device and torch version this library supports.
    side = _side_stream(device, DQ_OVERLAP, -1 if DQ_OVERLAP in ("high", "partition") else 0)
    if DQ_OVERLAP == "partition":  # the kernel's own high-priority stream, then the caller's for everything else
        return side, torch.cuda.current_stream(device)
    return torch.cuda.current_stream(device), side


def _runs_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream on which the deterministic reduction's runs are formed ahead (:data:`DET_RUNS_AHEAD`, CUDA
    outside the interpreter), else None."""
    if not isinstance(DET_RUNS_AHEAD, bool):
        raise ValueError(f"sparse_mla_bwd.DET_RUNS_AHEAD must be True or False, got {DET_RUNS_AHEAD!r}")
    if not DET_RUNS_AHEAD or device.type != "cuda" or interpreting():
        return None
    return _side_stream(device, "runs")


def _side_stream(device: torch.device, name: str, priority: int = 0) -> torch.cuda.Stream:
    """``device``'s side stream ``name`` (created once, with ``priority``, and kept in :data:`_SIDE_STREAMS`)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), name)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=key[0], priority=priority)
    return _SIDE_STREAMS[key]


def _partition_sms(device: torch.device) -> int:
    """:data:`DQ_PARTITION_SMS`, checked against ``device``'s SM count."""
    sms = sm_count(device)
    if not isinstance(DQ_PARTITION_SMS, int) or isinstance(DQ_PARTITION_SMS, bool) or not 0 < DQ_PARTITION_SMS < sms:
        raise ValueError(f"sparse_mla_bwd.DQ_PARTITION_SMS must be an int from 1 to {sms - 1} (this GPU has {sms} "
                         f"SMs), got {DQ_PARTITION_SMS!r}")  # fmt: skip
    return DQ_PARTITION_SMS


_SIDE_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def _piece_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The deterministic mode's piece dtype from :data:`DET_PIECES` (checked at each call); ``None``: bf16 pieces for
    bf16 keys, fp32 pieces otherwise."""
    if DET_PIECES is not None and DET_PIECES not in DET_PIECES_MODES:
        raise ValueError(f"sparse_mla_bwd.DET_PIECES must be None (bf16 pieces for bf16 inputs, else fp32) or one of "
                         f"{DET_PIECES_MODES}, got {DET_PIECES!r}")  # fmt: skip
    if DET_PIECES is None:
        return torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[DET_PIECES]


def _scratch_elements(piece_dtype: torch.dtype) -> int:
    """:data:`DETERMINISTIC_SCRATCH_ELEMENTS`, checked, or :data:`DETERMINISTIC_SCRATCH_BYTES` of ``piece_dtype``."""
    elements = DETERMINISTIC_SCRATCH_ELEMENTS
    if elements is None:
        elements = DETERMINISTIC_SCRATCH_BYTES // piece_dtype.itemsize
        what = f"DETERMINISTIC_SCRATCH_BYTES // {piece_dtype.itemsize}"
    else:
        what = "DETERMINISTIC_SCRATCH_ELEMENTS"
    if not isinstance(elements, int) or isinstance(elements, bool) or elements < 1:
        raise ValueError(f"sparse_mla_bwd.{what} must be an int >= 1 (None: DETERMINISTIC_SCRATCH_BYTES of pieces), "
                         f"got {elements!r}")  # fmt: skip
    return elements


def _dq_sm90(plan, kv2d, common, ds_buf, dq, row0, rows, num_keys, k_slots, num_heads, d_v, d_r, has_len) -> None:
    """Launch the SM90 dq kernel for rows ``[row0, row0 + rows)`` (``plan``: its ``(block_k, num_buf, heads)``)."""
    from longtrain.dsa.triton.sparse_mla_bwd_sm90 import sparse_mla_bwd_sm90_kernel_dq

    dq_block_k, dq_num_buf, dq_heads = plan
    # 128 heads per program: two programs per block of heads, each half of the columns.
    dq_programs = triton.cdiv(num_heads, dq_heads) * (dq_heads // 64)
    sparse_mla_bwd_sm90_kernel_dq[(rows * dq_programs,)](
        kv2d, *common, ds_buf, dq, row0, num_keys, k_slots, H=num_heads, D_V=d_v, D_R=d_r, HAS_LEN=has_len,
        BLOCK_K=dq_block_k, NUM_BUF=dq_num_buf, HEADS=dq_heads, DS_SMEM=bwd_plan.SM90_DQ_DS_SMEM and k_slots % 8 == 0,
        num_warps=8, STAGED_STORE=bwd_plan.SM90_DQ_STAGED_STORE,
    )  # fmt: skip


def sink_grad(attn_sink: torch.Tensor, lse2: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``dsink [H] fp32 = -sum_t exp2(sink2 - lse2[t]) * delta[t]`` from the preprocess's ``lse2 [T, H]`` (sink
    folded in) and ``delta [T, H]``: the preprocess's per-row terms, summed, where a kernel formed delta."""
    return (-torch.exp2(attn_sink.float() * LOG2E - lse2) * delta).sum(0)


def _whole_waves(num_tokens: int, rows: int, programs_per_row: int, device: torch.device) -> int:
    """The row chunk for ``num_tokens`` rows in chunks of about ``rows``: as many chunks as ``rows`` gives, each
    rounded up to a row count whose programs fill whole waves of the GPU's SMs (one SM90 program per SM), so no
    launch ends on a partial wave but the last (1024-row chunks at 64 heads are 7.76 waves on 132 SMs, 1056 rows 8)."""
    sms = sm_count(device)
    step = sms // math.gcd(sms, programs_per_row)
    per_chunk = triton.cdiv(num_tokens, triton.cdiv(num_tokens, rows))
    return triton.cdiv(per_chunk, step) * step


def _reduce_warps() -> int:
    """:data:`DKV_REDUCE_NUM_WARPS`, checked."""
    w = DKV_REDUCE_NUM_WARPS
    if not isinstance(w, int) or isinstance(w, bool) or w not in (1, 2, 4, 8, 16):
        raise ValueError(f"sparse_mla_bwd.DKV_REDUCE_NUM_WARPS must be a power of two from 1 to 16, got {w!r}")
    return w


def _reduce_batch(piece_dtype: torch.dtype, head_blocks: int = 1) -> int:
    """:data:`DKV_REDUCE_BATCH`, checked, or its measured choice for ``piece_dtype``'s pieces, ``head_blocks`` per
    slot."""
    batch = DKV_REDUCE_BATCH
    if batch is None:
        if piece_dtype.itemsize == 4:
            return 1
        return 16 if head_blocks > 1 else 8
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1 or batch & (batch - 1):
        raise ValueError(f"sparse_mla_bwd.DKV_REDUCE_BATCH must be None (the measured choice) or a power of two >= 1, "
                         f"got {batch!r}")  # fmt: skip
    return batch
