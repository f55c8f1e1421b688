"""Sparse MLA backward for Hopper (SM90) in Gluon, warp-specialized: the probabilities and dkv in one pass, with a
producer warpgroup for the gathers, one warpgroup for the probabilities and one for dkv and its fp32 atomics.

Same contract as :func:`longtrain.dsa.triton.sparse_mla_bwd_sm90.sparse_mla_bwd_sm90_kernel_ds_dkv` (one item
per (query row, block of 64 heads); ``dS`` stored for the dq kernel; ``dkv[idx] += [dS; P]^T [Q; dO 0]`` with fp32
atomics, or each slot's piece stored in deterministic mode at scratch row ``(t_local * K_slots + slot) * NUM_HB +
hb``). The two-warpgroup kernel runs each step in lockstep (wgmma, softmax, transpose, wgmma, atomics), so the
tensor cores wait while the atomics drain and the atomics wait while the tensor cores work. Here the roles run on
different warps:

* the **producer** (4 warps, few registers) cp.asyncs, per item, its first tile of ``BLOCK_K`` gathered latent rows
  into one buffer, signalled by ``cp.async.mbarrier.arrive`` (every producer thread arrives when its own copies have
  landed); while it lands it forms ``delta = rowsum(O * dO)`` for the block's heads from global memory, stores it (for
  ``dsink``) and hands it over in shared memory, so no preprocess pass reads ``O`` and ``dO``; then the stacked
  operand ``[Q_v; dO]`` (``[128, D_V]``) in column chunks of 64 and the rope queries ``Q_r`` (``[64, D_R]``), each as
  soon as the previous item's last tile has read it (``col_free``); with scaled fp16 pieces it then forms the
  item's per-head ``max|Q|`` and ``max|dO|`` for the dkv warpgroup (``max_bar``); then the item's other tiles;
* the **probabilities warpgroup** (a worker) computes ``S = Q K^T`` (``[64, BLOCK_K]``: the value and rope parts,
  one wgmma chain) and ``dP = dO V^T`` (a second chain on the same tile), releases the tile to the producer as soon
  as both have completed, forms ``P = exp2(S * qk_scale - lse2)`` and ``dS = sm_scale * P * (dP - delta)`` in
  registers (the two accumulators hold the same (head, slot) pairs in the same threads), stores ``dS`` (the dq
  kernel's input) and hands ``y = [dS; P]`` (``[128, BLOCK_K]``) to the dkv warpgroup through shared memory;
* the **dkv warpgroup** (the default partition) loads ``y^T`` into registers, releases ``y``, and computes
  ``dkv = y^T [Q_v; dO]`` in column chunks of 64 (K = 128) and ``y[:64]^T Q_r`` for the rope columns, each chunk's
  atomics issued while the next chunk's wgmma runs. Its atomics run while the other warps compute the next tile.
  On an item's last tile it hands each column chunk back to the producer as soon as its wgmma has completed.

A program runs ``RUN`` consecutive items (query row, block of 64 heads), or with ``RUN = 0`` every G-th item for G
programs: the tile barriers' phases run on across items, the column barriers' once per item with tiles, so the next
item's first tile, delta and queries load under the current item's last reductions.

Shared memory at the GLM shape (64 heads, D_qk 576, one tile of 64 rows): 128 + 8 + 72 + 16 KiB and delta's 256
bytes (with scaled fp16 pieces 1 KiB more: two items' head maxima).

Gluon kernels do not run in Triton's CPU interpreter; ``sparse_mla_bwd_plan.sm90_backward_plan`` says where this
kernel applies; its routing and sm_90a compilation are tested on CPU, its numerics on the GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from longtrain.dsa.triton._common import gpu_name, sm_count
from longtrain.dsa.triton.sparse_mla_bwd_sm90 import _alias, _dkv_out
from longtrain.dsa.triton.sparse_mla_fwd_sm90 import _cta_barrier, _gather_layout, _load_idx
from longtrain.dsa.triton.sparse_mla_fwd_sm90_items import _items
from longtrain.dsa.triton.sparse_mla_fwd_sm90_ws import _gather, _mma_layout

__all__ = [
    "WS_BWD_MAXNREG",
    "WS_BWD_NUM_REGS",
    "WS_BWD_PREFETCH_IDX",
    "WS_BWD_RUN",
    "WS_BWD_RUN_MULTI_BLOCK_BY_GPU",
    "WS_BWD_STAGED_DS",
    "sparse_mla_bwd_sm90_ws_kernel",
    "ws_bwd_schedule",
]

_HEADS = 64  # heads per program (one wgmma tile of M)
_BLOCK_H = gl.constexpr(_HEADS)
_SLOTS = 64  # gathered slots per tile
_BLOCK_K = gl.constexpr(_SLOTS)
_CHUNK = gl.constexpr(64)  # columns of [Q_v; dO] per dkv wgmma, and per hand-back to the producer
# setmaxnreg budgets of the worker partitions (probabilities, producer); the dkv warpgroup gets the rest of the
# 168 x 3 per thread that one 384-thread program may hold on an SM (64K registers).
WS_BWD_NUM_REGS = (152, 96)
WS_BWD_MAXNREG = 168
# Whether the producer loads a tile's slot indices one tile ahead, before it waits for the buffer (True), or after
# (False). False: one tile ahead was slower on an H100 (T = 4096, H = 128, K = 512: 5.95 / 5.99 ms against 5.70 /
# 5.75; T = 16384 within 1 %; benchmarks/results/dsa_ws_prefetch_0a9b2ae_h100_2026-12-06.md), where the forward's
# producer gains from it. Read at each launch.
WS_BWD_PREFETCH_IDX = False
# Whether the probabilities warpgroup stores dS (the dq kernel's input) from the [dS; P] tile it hands over, as whole
# 16-byte row segments per thread (True), instead of straight from the wgmma accumulator's 4-byte pairs (each 32-byte
# sector written in two halves). True: with dq through the dq kernel's ring, the backward on an H100 took 39.25 ms
# against 39.94-40.36 at T = 16384, H = 64, K = 2048, 77.66-77.78 against 79.77-79.92 at H = 128 and 7.92-7.93
# against 8.10-8.11 at T = 4096, H = 64; at T = 4096, H = 128, K = 512 5.45-5.54 against 5.45-5.51 (the same)
# (benchmarks/results/dsa_bwd_staged_1332b69_h100_2026-12-06.md, python benchmarks/dsa_bwd_dq.py --staged-store;
# tests/gpu/test_dsa_triton_gpu.py -k staged_ds). The dkv warpgroup storing it from the tile it has loaded instead was
# slower than either (40.18-40.20 ms at T = 16384, H = 64; code in f317c5f,
# benchmarks/results/dsa_bwd_staged_modes_f317c5f_h100_2026-12-06.md). Read at each launch.
WS_BWD_STAGED_DS = True
# Items (query row, block of 64 heads) per program: a program runs WS_BWD_RUN consecutive items (1: one program per
# item), or with 0 one program per SM takes the items pid, pid + G, ... Within a program the next item's first tile,
# delta and [Q_v; dO] load under the current item's last tile (each column chunk as soon as that tile's dkv wgmma has
# read it). None (the default): runs of 2 where a row is one item (at most 64 heads), one item per program otherwise
# (on an H200, one program per SM: WS_BWD_RUN_MULTI_BLOCK_BY_GPU).
# Measured on an H100 in one run (benchmarks/results/dsa_bwd_item_runs_da4fc54_h100_2026-12-06.md): at T = 16384,
# H = 64, K = 2048 the backward 36.76 / 37.05 ms with runs of 2 against 39.32 / 39.54 with one item per program (37.46-
# 37.96 with 4 or 8), at T = 4096, H = 64 7.72 / 7.77 against 8.04 / 8.02; at T = 4096, H = 128, K = 512 runs of 2
# were slower (5.60 / 5.63 against 5.56 / 5.57), and at T = 16384, H = 128 runs of 4 or one program per SM no faster
# (dsa_bwd_item_runs_all_da4fc54_h100_2026-12-06.md). The deterministic mode keeps one item per program: its row
# chunks are sized as whole waves of one-item programs (the per-slot scratch bounds them), and runs of 2 left half
# of the SMs idle in each chunk's launch: 97.85 ms against 77.88 at T = 16384, H = 64 on an H100
# (dsa_bwd_deterministic_1c6aa75_h100_2026-12-06.md against dsa_bwd_deterministic_1081fc0_h100_2026-12-06.md).
# Read at each launch.
WS_BWD_RUN: int | None = None
# WS_BWD_RUN's default where a row has more than one head block, by GPU (a substring of the device's name; the first
# that matches; 1 where none does). On the H200 at 34a525d one program per SM (0) was the fastest at both 128-head
# shapes of issue 17, in two rounds each: 5.158 / 5.164 ms at T = 4096, K = 512 against 5.276 / 5.263 with one item
# per program, and 71.09 / 71.48 at T = 16384, K = 2048 against 72.58 / 72.00
# (benchmarks/results/dsa_bwd_item_runs_34a525d_h200_2026-12-07.md). On H100s one item per program stayed as fast or
# faster (5.545 / 5.540 ms against 5.580 / 5.562 at K = 512, dsa_bwd_item_runs_4e418b7_h100_2026-12-07.md). Read at
# each launch.
WS_BWD_RUN_MULTI_BLOCK_BY_GPU: tuple[tuple[str, int], ...] = (("H200", 0),)


@gluon.jit
def _item(idx_ptr, len_ptr, row_offset, K_slots, item, H: gl.constexpr, HAS_LEN: gl.constexpr):
    """Work item ``item`` of the launch (query-major, head blocks fastest): its row in the launch (``t_local``), its
    row in the batch (``t``), head block, index row and slot count."""
    NUM_HB: gl.constexpr = (H + _BLOCK_H - 1) // _BLOCK_H
    t_local = (item // NUM_HB).to(gl.int64)
    t = row_offset + t_local
    hb = item % NUM_HB
    if HAS_LEN:
        n_slots = gl.minimum(gl.maximum(gl.load(len_ptr + t).to(gl.int32), 0), K_slots)  # scalar
    else:
        n_slots = K_slots
    return t, t_local, hb, idx_ptr + t * K_slots, n_slots


@gluon.jit
def _producer(ptrs, sc, sm, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_K: gl.constexpr,
              HAS_LEN: gl.constexpr, RUN: gl.constexpr, PREFETCH_IDX: gl.constexpr, SCALED: gl.constexpr):  # fmt: skip
    """Worker partition: per item, its first tile, delta, then ``[Q_v; dO]`` and ``Q_r`` column chunk by column chunk
    as the previous item's last tile releases them, then the item's other tiles."""
    q_ptr, kv_ptr, dout_ptr, out_ptr, idx_ptr, len_ptr, ds_ptr, dkv_ptr, lse2_ptr, delta_ptr = ptrs
    row_offset, n_rows, T_k, K_slots, sm_scale, qk_scale = sc
    s_v, q_r, v_buf, r_buf, y_smem, delta_smem, bound_smem = sm[:7]
    ready, free, y_ready, y_free, q_ready, col_free, delta_bar, max_bar = sm[7:]
    s_v, q_r, v_buf, r_buf = s_v.index(0), q_r.index(0), v_buf.index(0), r_buf.index(0)
    D_QK: gl.constexpr = D_V + D_R
    NUM_C: gl.constexpr = D_V // _CHUNK
    LV: gl.constexpr = _gather_layout(D_V, 4)
    LC: gl.constexpr = _gather_layout(_CHUNK, 4)
    LR: gl.constexpr = _gather_layout(max(D_R, 16), 4)
    rl_v: gl.constexpr = gl.SliceLayout(1, LV)
    rl_c: gl.constexpr = gl.SliceLayout(1, LC)
    rl_r: gl.constexpr = gl.SliceLayout(1, LR)

    g = 0  # tiles of this program's earlier items: the tile barriers' phase
    k = 0  # this program's earlier items with tiles: the column barriers' phase
    first, stop, step = _items(n_rows, H, RUN)
    for item in range(first, stop, step):
        t, t_local, hb, idx_row, n_slots = _item(idx_ptr, len_ptr, row_offset, K_slots, item, H, HAS_LEN)
        n_tiles = gl.cdiv(n_slots, BLOCK_K)
        # A tile's slot indices, -1 past the row's slots (validity below, after the wait, from the indices alone).
        if PREFETCH_IDX:  # loaded one tile ahead, before the wait for the buffer: tile 0's here
            idx, _ = _load_idx(idx_row, 0, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K]
            if D_R > 0:
                idx_r, _ = _load_idx(idx_row, 0, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K]
        for i in range(n_tiles):
            r = g + i
            if PREFETCH_IDX:
                # Tile i+1's indices now, under the wait below and tile i's copies: with one buffer, the gather of
                # tile i+1 then starts as soon as the buffer is free instead of a global load's latency later.
                nxt, _ = _load_idx(idx_row, (i + 1) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K]
                if D_R > 0:
                    nxt_r, _ = _load_idx(idx_row, (i + 1) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K]
            mbarrier.wait(free, (r & 1) ^ 1)
            if not PREFETCH_IDX:  # loaded once the buffer is free
                idx, _ = _load_idx(idx_row, i * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K]
                if D_R > 0:
                    idx_r, _ = _load_idx(idx_row, i * BLOCK_K, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K]
            valid = (idx >= 0) & (idx < T_k)
            _gather(v_buf, kv_ptr, gl.where(valid, idx, 0).to(gl.int64) * D_QK, valid, 0, D_V, LV)  # [BLOCK_K, D_V]
            if D_R > 0:
                valid_r = (idx_r >= 0) & (idx_r < T_k)
                _gather(r_buf, kv_ptr, gl.where(valid_r, idx_r, 0).to(gl.int64) * D_QK, valid_r, D_V, D_R, LR)
            cp.mbarrier_arrive(ready, increment_count=False)
            if PREFETCH_IDX:
                idx = nxt
                if D_R > 0:
                    idx_r = nxt_r
            if i == 0:  # while the first tile lands
                # delta from global memory: the staged dO may still hold the previous item's columns.
                delta, max_do = _row_delta(
                    out_ptr + t * (H * D_V), dout_ptr + t * (H * D_V), hb, H, D_V, SCALED
                )  # [64] x 2
                offs_h = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=delta.type.layout)
                gl.store(delta_ptr + t * H + offs_h, delta, mask=offs_h < H)
                delta_smem.store(delta)
                _cta_barrier()  # every producer thread's part is in shared memory
                mbarrier.arrive(delta_bar)
                # [Q_v; dO] a column chunk at a time, each as soon as the previous item's last tile has read it.
                hc = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=rl_c)
                for c in gl.static_range(NUM_C):
                    mbarrier.wait(col_free.index(c), (k & 1) ^ 1)
                    cols = s_v.slice(c * _CHUNK, _CHUNK, dim=1)
                    _gather(cols.slice(0, _BLOCK_H, dim=0), q_ptr + t * (H * D_QK), hc * D_QK, hc < H, c * _CHUNK,
                            _CHUNK, LC)  # fmt: skip
                    _gather(cols.slice(_BLOCK_H, _BLOCK_H, dim=0), dout_ptr + t * (H * D_V), hc * D_V, hc < H,
                            c * _CHUNK, _CHUNK, LC)  # fmt: skip
                if D_R > 0:
                    mbarrier.wait(col_free.index(NUM_C), (k & 1) ^ 1)
                    hr = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=rl_r)
                    _gather(q_r, q_ptr + t * (H * D_QK), hr * D_QK, hr < H, D_V, D_R, LR)  # [64, D_R]
                cp.mbarrier_arrive(q_ready, increment_count=False)
                if SCALED:  # the head maxima, once the queries are on their way: the dkv warpgroup needs them later
                    maxima = bound_smem.index(k & 1)  # one slot per item parity, read during the whole item
                    maxima.slice(0, _BLOCK_H).store(_row_max(q_ptr + t * (H * D_QK), hb, H, D_QK))
                    maxima.slice(_BLOCK_H, _BLOCK_H).store(max_do)
                    _cta_barrier()
                    mbarrier.arrive(max_bar)
        g += n_tiles
        k += (n_tiles > 0).to(gl.int32)


@gluon.jit
def _row_delta(o_row, do_row, hb, H: gl.constexpr, D_V: gl.constexpr, MAX_DO: gl.constexpr):
    """``delta[h] = sum_d O[h, d] dO[h, d]`` (fp32) for the block's 64 heads, from global memory in column chunks of
    64 (heads past ``H`` give 0); with ``MAX_DO`` also each head's ``max|dO[h]|`` (at least ``2**-100``, see
    :func:`_row_max`)."""
    L: gl.constexpr = _gather_layout(64, 4)
    hh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    acc = gl.zeros([_BLOCK_H], gl.float32, layout=gl.SliceLayout(1, L))
    max_do = gl.full([_BLOCK_H], 2.0**-100, gl.float32, layout=gl.SliceLayout(1, L))
    for c in range(D_V // 64):  # not unrolled: 16 chunk loads in flight spilled the producer's 96 registers
        offs = hh[:, None] * D_V + (c * 64 + cols)[None, :]
        o = gl.load(o_row + offs, mask=(hh < H)[:, None], other=0.0)  # [64, 64]
        d = gl.load(do_row + offs, mask=(hh < H)[:, None], other=0.0)  # [64, 64]
        acc += gl.sum(o.to(gl.float32) * d.to(gl.float32), axis=1)
        if MAX_DO:
            max_do = gl.maximum(max_do, gl.max(gl.abs(d.to(gl.float32)), axis=1))
    return acc, max_do


@gluon.jit
def _row_max(q_row, hb, H: gl.constexpr, D_QK: gl.constexpr):
    """Each of the block's 64 heads' ``max|Q[h]|`` over every column (fp32), at least ``2**-100`` (also for heads past
    ``H``) so that a slot's scale stays finite: the scaled fp16 pieces' bounds."""
    L: gl.constexpr = _gather_layout(64, 4)
    hh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    max_q = gl.full([_BLOCK_H], 2.0**-100, gl.float32, layout=gl.SliceLayout(1, L))
    for c in range(gl.cdiv(D_QK, 64)):
        col = c * 64 + cols
        x = gl.load(
            q_row + hh[:, None] * D_QK + col[None, :], mask=(hh < H)[:, None] & (col < D_QK)[None, :], other=0.0
        )  # [64, 64]
        max_q = gl.maximum(max_q, gl.max(gl.abs(x.to(gl.float32)), axis=1))
    return max_q


@gluon.jit
def _probabilities(ptrs, sc, sm, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_K: gl.constexpr,
                   HAS_LEN: gl.constexpr, RUN: gl.constexpr, STAGED_DS: gl.constexpr):  # fmt: skip
    """Worker partition: per tile, ``S`` and ``dP``, then ``P`` and ``dS``; ``dS`` stored, ``[dS; P]`` handed over."""
    q_ptr, kv_ptr, dout_ptr, out_ptr, idx_ptr, len_ptr, ds_ptr, dkv_ptr, lse2_ptr, delta_ptr = ptrs
    row_offset, n_rows, T_k, K_slots, sm_scale, qk_scale = sc
    s_v, q_r, v_buf, r_buf, y_smem, delta_smem, bound_smem = sm[:7]
    ready, free, y_ready, y_free, q_ready, col_free, delta_bar, max_bar = sm[7:]
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    s_layout: gl.constexpr = _mma_layout(BLOCK_K)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    LB: gl.constexpr = _gather_layout(BLOCK_K, 4)  # 16-byte vectors, a warp along a row
    zero = gl.zeros([_BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)

    g = 0
    k = 0
    first, stop, step = _items(n_rows, H, RUN)
    for item in range(first, stop, step):
        t, t_local, hb, idx_row, n_slots = _item(idx_ptr, len_ptr, row_offset, K_slots, item, H, HAS_LEN)
        n_tiles = gl.cdiv(n_slots, BLOCK_K)
        offs_h = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=row_s)
        mask_h = offs_h < H
        # Rows without keys have lse2 = +inf: every probability below is exactly 0.
        lse2 = gl.load(lse2_ptr + t * H + offs_h, mask=mask_h, other=float("inf"))  # [64]
        delta = gl.zeros([_BLOCK_H], gl.float32, layout=row_s)  # the producer's, from the first tile on
        # dS rows as 32-bit offsets from the item's scalar base: fewer 64-bit values live across the tile loop.
        ds_item = ds_ptr + t_local * (H * K_slots)
        ds_rows = offs_h * K_slots  # [64]
        offs_hb = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, LB))
        mask_hb = offs_hb < H
        ds_rows_b = offs_hb * K_slots  # [64]
        for i in range(n_tiles):
            r = g + i
            mbarrier.wait(ready, r & 1)
            if i == 0:  # the item's [Q_v; dO] and Q_r
                mbarrier.wait(q_ready, k & 1)
            fence_async_shared()
            # The buffers through an index that is 0 but changes with the tile as far as the compiler knows: with
            # fixed views Triton 3.6 hoisted every wgmma descriptor out of the item loop and spilled them (720 bytes
            # of stack, reloaded each tile; the backward 22 % slower on an H100).
            z = r >> 30  # 0 (fewer than 2^30 tiles per program)
            sv = s_v.index(z)
            vb = v_buf.index(z).permute((1, 0))
            s = warpgroup_mma(sv.slice(0, _BLOCK_H, dim=0), vb, zero, use_acc=False, is_async=True)
            if D_R > 0:
                s = warpgroup_mma(q_r.index(z), r_buf.index(z).permute((1, 0)), s, is_async=True)  # [64, BLOCK_K]
            dp = warpgroup_mma(sv.slice(_BLOCK_H, _BLOCK_H, dim=0), vb, zero, use_acc=False, is_async=True)
            _, valid = _load_idx(idx_row, i * BLOCK_K, n_slots, T_k, BLOCK_K, col_s)  # [BLOCK_K]
            s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
            if i == 0:  # read before the tile is released: the producer writes the next item's after that
                mbarrier.wait(delta_bar, k & 1)
                delta = delta_smem.load(row_s)  # [64]
            mbarrier.arrive(free)

            p = gl.where(valid[None, :], gl.exp2(s * qk_scale - lse2[:, None]), 0.0)  # [64, BLOCK_K]
            ds = (p * (dp - delta[:, None]) * sm_scale).to(dtype)  # [64, BLOCK_K]
            if not STAGED_DS:
                offs_k = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=col_s)
                mask = mask_h[:, None] & (offs_k < n_slots)[None, :]
                gl.store(ds_item + (ds_rows[:, None] + offs_k[None, :]), ds, mask=mask)
            mbarrier.wait(y_free, (r & 1) ^ 1)
            y_smem.slice(0, _BLOCK_H, dim=0).store(ds)
            y_smem.slice(_BLOCK_H, _BLOCK_H, dim=0).store(p.to(dtype))
            if STAGED_DS:
                # dS for the dq kernel read back from the tile, as whole 16-byte row segments per thread (the
                # accumulator's 4-byte pairs write every 32-byte sector in two halves). Read before the hand-over: the
                # dkv warpgroup stages its fp32 pieces in this buffer once it has loaded the tile.
                _cta_barrier()  # every warp's dS is in shared memory
                d = y_smem.slice(0, _BLOCK_H, dim=0).load(LB)  # [64, BLOCK_K]
                _cta_barrier()  # ... and read back by every warp
            fence_async_shared()
            mbarrier.arrive(y_ready)
            if STAGED_DS:
                offs_kb = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LB))
                mask_b = mask_hb[:, None] & (offs_kb < n_slots)[None, :]
                gl.store(ds_item + (ds_rows_b[:, None] + offs_kb[None, :]), d, mask=mask_b)
        g += n_tiles
        k += (n_tiles > 0).to(gl.int32)


@gluon.jit
def _staged_out(dkv_ptr, acc, stage, rows, valid, col0, DETERMINISTIC: gl.constexpr, inv, SCALED: gl.constexpr):
    """Add (or store) a ``[BLOCK_K, W]`` dkv piece through shared memory: the wgmma accumulator's threads hold 8
    rows x 32 bytes per warp-wide access, a blocked layout one whole row segment, which the L2 reduces faster.
    ``SCALED``: each row multiplied by its ``inv`` (``[BLOCK_K]``, a power of two) first."""
    W: gl.constexpr = acc.type.shape[1]
    BLOCK_K: gl.constexpr = acc.type.shape[0]
    if SCALED:
        acc = acc * gl.convert_layout(inv, gl.SliceLayout(1, acc.type.layout))[:, None]
    L: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // W, W // 4], [4, 1], [1, 0])
    # 32-byte vectors, row r's XOR-ed by r % 8: the accumulator's 8 rows x 32 bytes per store and the blocked
    # layout's row segments per load each hit distinct banks (8-byte vectors conflicted 4-way on the store, ncu).
    view = _alias(stage, gl.float32, BLOCK_K, W, gl.SwizzledSharedLayout(8, 1, min(8, W // 8), order=[1, 0]))
    _cta_barrier()  # the previous piece has been read back by every warp
    view.store(acc)
    _cta_barrier()
    piece = view.load(L)  # [BLOCK_K, W]
    r = gl.convert_layout(rows, gl.SliceLayout(1, L))
    ok = gl.convert_layout(valid, gl.SliceLayout(1, L))
    cols = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, L))
    _dkv_out(dkv_ptr + r[:, None] + cols[None, :], piece, ok[:, None], r, ok, DETERMINISTIC, False, 1)


@gluon.jit
def _scale_slots(a, maxima, scale_rows, valid, NUM_GROUPS: gl.constexpr):
    """Scaled fp16 pieces: each slot's scale, a power of two stored at ``scale_rows + g`` for every group ``g``, and
    its inverse (``[BLOCK_K]`` fp32, returned), by which ``_staged_out`` multiplies the slot's row of each fp32 piece
    before it is rounded to fp16. The scale puts a bound on the slot's whole dkv piece in ``[2**14, 2**15)``:
    ``|sum_h dS[h] Q[h, c] + P[h] dO[h, c]| <= sum_h |dS[h]| max|Q[h]| + P[h] max|dO[h]|``, from the dkv operand
    ``a = [dS; P]^T`` (``[BLOCK_K, 128]`` in registers, the wgmma's A layout: a row lives in one quad of a warp, so the
    sums need no shared memory) and the item's head maxima ``maxima = [max|Q[h]|; max|dO[h]|]`` (``[128]`` fp32 in
    shared memory, from the producer). No element of the piece is inspected, and a power of two commutes with every
    rounding, so the stored value is the fp32 piece's, scaled and rounded once."""
    x = a.to(gl.float32)  # [BLOCK_K, 128]: dS columns, then P columns
    weight = maxima.load(gl.SliceLayout(0, a.type.layout))  # [128]
    bound = gl.sum(gl.abs(x) * weight[None, :], axis=1)  # [BLOCK_K]
    bits = gl.maximum((bound.to(gl.int32, bitcast=True) & 0x7F800000) - (14 << 23), 1 << 23)  # [BLOCK_K]
    bits = gl.convert_layout(bits, valid.type.layout)
    scale = bits.to(gl.float32, bitcast=True)
    for g in gl.static_range(NUM_GROUPS):
        gl.store(scale_rows + g, scale, mask=valid)
    return ((254 << 23) - bits).to(gl.float32, bitcast=True)


@gluon.jit
def _dkv(ptrs, sc, sm, scale_ptr, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
         BLOCK_K: gl.constexpr, HAS_LEN: gl.constexpr, RUN: gl.constexpr, DETERMINISTIC: gl.constexpr,
         SCALED: gl.constexpr, GROUP_COLS: gl.constexpr):  # fmt: skip
    """Default partition: per tile, ``dkv[idx] += [dS; P]^T [Q_v; dO]`` (value columns) and ``dS^T Q_r`` (rope
    columns) in column chunks of 64, each chunk's wgmma issued before the previous chunk's piece is turned into whole
    row segments through the ``[dS; P]`` buffer (read into registers first, released at the end of the tile) and
    added. On an item's last tile each column chunk of ``[Q_v; dO]`` (and ``Q_r``) goes back to the producer as soon
    as its wgmma has read it. ``SCALED``: each slot's scale formed while the first chunk's wgmma runs
    (``_scale_slots``), each fp32 piece row multiplied by its inverse before it is rounded to fp16."""
    q_ptr, kv_ptr, dout_ptr, out_ptr, idx_ptr, len_ptr, ds_ptr, dkv_ptr, lse2_ptr, delta_ptr = ptrs
    row_offset, n_rows, T_k, K_slots, sm_scale, qk_scale = sc
    s_v, q_r, v_buf, r_buf, y_smem, delta_smem, bound_smem = sm[:7]
    ready, free, y_ready, y_free, q_ready, col_free, delta_bar, max_bar = sm[7:]
    s_v, q_r = s_v.index(0), q_r.index(0)
    D_QK: gl.constexpr = D_V + D_R
    NUM_HB: gl.constexpr = (H + _BLOCK_H - 1) // _BLOCK_H
    NUM_C: gl.constexpr = D_V // _CHUNK
    NUM_GROUPS: gl.constexpr = (D_QK + GROUP_COLS - 1) // GROUP_COLS  # scaled fp16 pieces' scales per piece row
    c_layout: gl.constexpr = _mma_layout(_CHUNK)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=c_layout, k_width=2)
    row_c: gl.constexpr = gl.SliceLayout(1, c_layout)
    zero = gl.zeros([BLOCK_K, _CHUNK], gl.float32, layout=c_layout)
    if D_R > 0:
        RW: gl.constexpr = D_R if D_R < _CHUNK else _CHUNK
        NUM_R: gl.constexpr = D_R // RW
        r_layout: gl.constexpr = _mma_layout(RW)
        ar_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=r_layout, k_width=2)
        zero_r = gl.zeros([BLOCK_K, RW], gl.float32, layout=r_layout)

    g = 0
    k = 0
    first, stop, step = _items(n_rows, H, RUN)
    for item in range(first, stop, step):
        t, t_local, hb, idx_row, n_slots = _item(idx_ptr, len_ptr, row_offset, K_slots, item, H, HAS_LEN)
        n_tiles = gl.cdiv(n_slots, BLOCK_K)
        for i in range(n_tiles):
            r = g + i
            last = i == n_tiles - 1  # its column chunks go back to the producer as they are read
            k0 = i * BLOCK_K
            keys, valid = _load_idx(idx_row, k0, n_slots, T_k, BLOCK_K, row_c)  # [BLOCK_K] x 2
            if DETERMINISTIC:  # this row's slots in the per-slot scratch (one row per slot and head block)
                slots = k0 + gl.arange(0, BLOCK_K, layout=row_c)
                piece_rows = (t_local * K_slots + slots.to(gl.int64)) * NUM_HB + hb  # [BLOCK_K]
                rows = piece_rows * D_QK
            else:
                piece_rows = gl.where(valid, keys, 0).to(gl.int64)  # [BLOCK_K]
                rows = piece_rows * D_QK
            scales = scale_ptr + piece_rows * NUM_GROUPS  # [BLOCK_K]: scaled fp16 pieces' scales (else unused)
            mbarrier.wait(y_ready, r & 1)
            if i == 0:  # the item's [Q_v; dO] and Q_r
                mbarrier.wait(q_ready, k & 1)
                fence_async_shared()
            a = y_smem.permute((1, 0)).load(a_layout)  # [BLOCK_K, 128]: [dS; P]^T
            if D_R > 0:
                a_r = y_smem.slice(0, _BLOCK_H, dim=0).permute((1, 0)).load(ar_layout)  # [BLOCK_K, 64]: dS^T

            acc = warpgroup_mma(a, s_v.slice(0, _CHUNK, dim=1), zero, use_acc=False, is_async=True)  # [BLOCK_K, 64]
            inv = 1.0
            if SCALED:  # while the first chunk's wgmma runs
                if i == 0:  # the item's head maxima
                    mbarrier.wait(max_bar, k & 1)
                inv = _scale_slots(a, bound_smem.index(k & 1), scales, valid, NUM_GROUPS)
            for c in gl.static_range(1, NUM_C):
                nxt = warpgroup_mma(a, s_v.slice(c * _CHUNK, _CHUNK, dim=1), zero, use_acc=False, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                if last:
                    mbarrier.arrive(col_free.index(c - 1))
                _staged_out(dkv_ptr, acc, y_smem, rows, valid, (c - 1) * _CHUNK, DETERMINISTIC, inv, SCALED)
                acc = nxt
            if D_R > 0:
                acc_r = zero_r
                for c in gl.static_range(NUM_R):
                    nxt_r = warpgroup_mma(a_r, q_r.slice(c * RW, RW, dim=1), zero_r, use_acc=False, is_async=True)
                    if c == 0:
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                        if last:
                            mbarrier.arrive(col_free.index(NUM_C - 1))
                        _staged_out(dkv_ptr, acc, y_smem, rows, valid, (NUM_C - 1) * _CHUNK, DETERMINISTIC, inv, SCALED)
                    else:
                        acc_r = warpgroup_mma_wait(num_outstanding=1, deps=(acc_r,))
                        _staged_out(dkv_ptr, acc_r, y_smem, rows, valid, D_V + (c - 1) * RW, DETERMINISTIC, inv, SCALED)
                    acc_r = nxt_r
                acc_r = warpgroup_mma_wait(num_outstanding=0, deps=(acc_r,))
                if last:
                    mbarrier.arrive(col_free.index(NUM_C))
                _staged_out(dkv_ptr, acc_r, y_smem, rows, valid, D_V + (NUM_R - 1) * RW, DETERMINISTIC, inv, SCALED)
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                if last:
                    mbarrier.arrive(col_free.index(NUM_C - 1))
                _staged_out(dkv_ptr, acc, y_smem, rows, valid, (NUM_C - 1) * _CHUNK, DETERMINISTIC, inv, SCALED)
            _cta_barrier()  # every warp has read back its last piece
            mbarrier.arrive(y_free)
        g += n_tiles
        k += (n_tiles > 0).to(gl.int32)


@gluon.jit(do_not_specialize=["row_offset", "n_rows", "T_k", "K_slots"])
def sparse_mla_bwd_sm90_ws_kernel(
    q_ptr, kv_ptr, dout_ptr, out_ptr, idx_ptr, len_ptr, lse2_ptr, delta_ptr, ds_ptr, dkv_ptr, scale_ptr,
    row_offset, n_rows, T_k, K_slots, sm_scale, qk_scale,
    H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_LEN: gl.constexpr, DETERMINISTIC: gl.constexpr,
    REGS_PROB: gl.constexpr, REGS_PRODUCER: gl.constexpr, num_warps: gl.constexpr, PREFETCH_IDX: gl.constexpr = False,
    STAGED_DS: gl.constexpr = False, RUN: gl.constexpr = 1, SCALED: gl.constexpr = False,
    GROUP_COLS: gl.constexpr = 64,
):  # fmt: skip
    """Items ``(row of the launch, block of 64 heads)``, ``n_rows * ceil(H / 64)`` of them, query-major: program
    ``pid`` takes the ``RUN`` items from ``pid * RUN`` (``RUN = 1``: one program per item), or with ``RUN = 0`` the
    items ``pid, pid + G, ...`` for ``G`` programs (see :func:`ws_bwd_schedule`). ``SCALED`` (deterministic mode):
    the pieces as scaled fp16 rows, one scale per piece row (repeated at ``scale_ptr[scratch row, group]`` for each
    group of ``GROUP_COLS`` columns), from a bound on the piece with the item's per-head ``max|Q|`` and ``max|dO|``
    (``_scale_slots``; the producer forms them, ``_row_max`` and ``_row_delta``)."""
    BLOCK_K: gl.constexpr = _BLOCK_K
    NUM_COLS: gl.constexpr = D_V // _CHUNK + (1 if D_R > 0 else 0)  # column chunks of [Q_v; dO], then Q_r
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")
    gl.static_assert(D_V >= 128, "dkv's value columns go in chunks of up to 128")

    sv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * _BLOCK_H, D_V], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_V], dtype)
    y_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * _BLOCK_H, BLOCK_K], dtype)
    # One buffer each, allocated as [1, ...]: the probabilities warpgroup indexes them with a per-tile 0 (below).
    s_v = gl.allocate_shared_memory(dtype, [1, 2 * _BLOCK_H, D_V], sv_sl)
    v_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_K, D_V], kv_sl)
    if D_R > 0:
        qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, D_R], dtype)
        kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_R], dtype)
        q_r = gl.allocate_shared_memory(dtype, [1, _BLOCK_H, D_R], qr_sl)
        r_buf = gl.allocate_shared_memory(dtype, [1, BLOCK_K, D_R], kr_sl)
    else:
        q_r = s_v
        r_buf = v_buf
    y_smem = gl.allocate_shared_memory(dtype, [2 * _BLOCK_H, BLOCK_K], y_sl)
    delta_smem = gl.allocate_shared_memory(gl.float32, [_BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    y_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    y_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    col_free = gl.allocate_shared_memory(gl.int64, [NUM_COLS, 1], mbarrier.MBarrierLayout())
    delta_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=128)  # every producer thread, when its copies have landed
    mbarrier.init(free, count=1)  # the probabilities warpgroup
    mbarrier.init(y_ready, count=1)
    mbarrier.init(y_free, count=1)  # the dkv warpgroup
    mbarrier.init(q_ready, count=128)  # every producer thread, when its column copies have landed
    for c in gl.static_range(NUM_COLS):
        mbarrier.init(col_free.index(c), count=1)  # the dkv warpgroup, once the item's last tile has read the chunk
    mbarrier.init(delta_bar, count=1)  # the producer, once delta is in shared memory
    if SCALED:  # the item's head maxima [max|Q|; max|dO|], one slot per item parity
        bound_smem = gl.allocate_shared_memory(gl.float32, [2, 2 * _BLOCK_H], delta_smem.layout)  # indexed: 1-D
        max_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(max_bar, count=1)  # the producer, once the maxima are in shared memory
    else:  # unused
        bound_smem = delta_smem
        max_bar = delta_bar

    ptrs = (q_ptr, kv_ptr, dout_ptr, out_ptr, idx_ptr, len_ptr, ds_ptr, dkv_ptr, lse2_ptr, delta_ptr)
    sc = (row_offset, n_rows, T_k, K_slots, sm_scale, qk_scale)
    sm = (s_v, q_r, v_buf, r_buf, y_smem, delta_smem, bound_smem, ready, free, y_ready, y_free, q_ready, col_free,
          delta_bar, max_bar)  # fmt: skip
    gl.warp_specialize(
        [
            (_dkv, (ptrs, sc, sm, scale_ptr, H, D_V, D_R, BLOCK_K, HAS_LEN, RUN, DETERMINISTIC, SCALED,
                    GROUP_COLS)),
            (_probabilities, (ptrs, sc, sm, H, D_V, D_R, BLOCK_K, HAS_LEN, RUN, STAGED_DS)),
            (_producer, (ptrs, sc, sm, H, D_V, D_R, BLOCK_K, HAS_LEN, RUN, PREFETCH_IDX, SCALED)),
        ],
        [4, 4],
        [REGS_PROB, REGS_PRODUCER],
    )  # fmt: skip


def _multi_block_run(device: torch.device) -> int:
    """:data:`WS_BWD_RUN`'s measured default for rows of several head blocks on ``device``."""
    name = gpu_name(device)
    return next((run for key, run in WS_BWD_RUN_MULTI_BLOCK_BY_GPU if key in name), 1)


def ws_bwd_schedule(
    num_items: int, head_blocks: int, device: torch.device, deterministic: bool = False, reserve_sms: int = 0
) -> tuple[int, int]:
    """``(programs, RUN)`` of a launch over ``num_items`` items, ``head_blocks`` per row (``WS_BWD_RUN``): one program
    per run of ``RUN`` consecutive items, or with ``RUN = 0`` one program per SM (never more than items) taking every
    G-th item. One program fits an SM. The default is one item per program in ``deterministic`` mode, whose row
    chunks fill whole waves of one-item programs, runs of 2 where a row is one item, and otherwise
    :data:`WS_BWD_RUN_MULTI_BLOCK_BY_GPU`'s entry for the GPU (one item per program where none matches).
    ``reserve_sms > 0`` (the backward's SM partition): ``RUN = 0`` over all SMs but ``reserve_sms``, which stay free
    for the kernels of another stream."""
    if reserve_sms:
        programs = sm_count(device) - reserve_sms
        return max(min(num_items, programs), 1), 0
    run = WS_BWD_RUN
    if run is None:
        run = 1 if deterministic else 2 if head_blocks == 1 else _multi_block_run(device)
    if not isinstance(run, int) or isinstance(run, bool) or run < 0:
        raise ValueError(f"WS_BWD_RUN must be None (the measured default) or an int >= 0 (0: one program per SM), "
                         f"got {run!r}")  # fmt: skip
    if run == 0:
        return max(min(num_items, sm_count(device)), 1), 0
    return max(-(-num_items // run), 1), run
