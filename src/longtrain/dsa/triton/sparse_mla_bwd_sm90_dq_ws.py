"""Sparse MLA backward ``dq = dS K`` for Hopper (SM90) in Gluon, warp-specialized: a producer warpgroup fills a ring
of gathered tiles and their ``dS``, and two consumer warpgroups keep a wgmma in flight from one tile into the next.

Same contract as :func:`longtrain.dsa.triton.sparse_mla_bwd_sm90.sparse_mla_bwd_sm90_kernel_dq` with 64 heads per
program (one program per (query row, block of 64 heads)). That kernel runs each step in lockstep on all its warps
(wait for the tile's copies, a CTA barrier, issue the next tile's copies, load the next ``dS``, convert it, one
wgmma, wait for it): ncu shows it latency-bound, its tensor pipe 24 % busy at K = 512
(``benchmarks/results/logs/ncu_dsa_dq_T4096_H128_K512_3fe6a15_h100_details.txt``). Here the roles run on different
warps:

* the **producer** (4 warps, few registers) loads a tile's slot indices and its ``dS`` (``[64, BLOCK_K]``, masked
  to the row's slots and heads, zeros elsewhere) into registers, waits for the tile's buffer, cp.asyncs the gathered
  latent rows (values ``[BLOCK_K, D_V]`` and rope tail ``[BLOCK_K, D_R]``, invalid slots zero-filled; signalled by
  ``cp.async.mbarrier.arrive`` on ``ready``) and stores ``dS`` into the buffer's ``dS`` tile (``ds_ready``);
* the **left consumer** (a worker) accumulates ``dq[:, :D_V/2] += dS K[:, :D_V/2]``, the **right consumer** (the
  default partition) ``dq[:, D_V/2:D_V]`` and the rope columns, both with ``dS`` from shared memory as the wgmma's A
  operand; each issues tile i's wgmma before it waits for tile i-1's and only then releases tile i-1's buffer, so
  the tensor cores never wait for the barrier and issue work between tiles.

Every column's sum runs over the same tiles in the same order, with the same wgmma K steps, as the lockstep kernel:
dq is the same bit for bit (``tests/gpu/test_dsa_triton_gpu.py -k dq_ws``). Shared memory at the GLM shape (D_qk 576,
two tiles of 64 rows): 144 KiB of rows and 16 KiB of ``dS``.

Gluon kernels do not run in Triton's CPU interpreter; :func:`dq_ws_unsupported_reason` says where this kernel applies,
and its sm_90a compilation is tested on CPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from longtrain.dsa.triton.sparse_mla_bwd_sm90 import _row_slots
from longtrain.dsa.triton.sparse_mla_fwd_sm90 import _gather_layout, _load_idx
from longtrain.dsa.triton.sparse_mla_fwd_sm90_ws import _gather, _mma_layout

__all__ = [
    "DQ_WS_MAXNREG",
    "DQ_WS_NUM_REGS",
    "DQ_WS_RING",
    "dq_ws_smem_bytes",
    "dq_ws_unsupported_reason",
    "sparse_mla_bwd_sm90_dq_ws_kernel",
]

_BLOCK_H = gl.constexpr(64)  # heads per program (one wgmma tile of M)
# setmaxnreg budgets of the workers (the left consumer, the producer); the right consumer, the default partition, gets
# the rest of the 168 x 3 per thread that one 384-thread program may hold on an SM: 232. At (152, 96) ptxas spills
# 208 bytes and serializes the left consumer's wgmmas (C7512) at the GLM shape.
DQ_WS_NUM_REGS = (160, 112)
DQ_WS_MAXNREG = 168
# The ring: tiles of 64 gathered rows, two of them (a third does not fit beside the dS tiles at D_qk = 576).
DQ_WS_RING = (64, 2)


@gluon.jit
def _producer(args, sm, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_K: gl.constexpr,
              NUM_BUF: gl.constexpr):  # fmt: skip
    """Worker partition: per tile, its slot indices and ``dS`` into registers, then (once the buffer is free) its
    gathered rows by cp.async and its ``dS`` into shared memory."""
    kv_ptr, ds_ptr, dq_ptr, idx_row, t, t_local, hb, n_slots, T_k, K_slots = args
    kv_bufs, kt_bufs, ds_bufs, ready, ds_ready, free = sm
    D_QK: gl.constexpr = D_V + D_R
    LV: gl.constexpr = _gather_layout(D_V, 4)
    LT: gl.constexpr = _gather_layout(max(D_R, 16), 4)
    LS: gl.constexpr = _gather_layout(BLOCK_K, 4)
    rl_v: gl.constexpr = gl.SliceLayout(1, LV)
    rl_t: gl.constexpr = gl.SliceLayout(1, LT)
    offs_h = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, LS))
    mask_h = offs_h < H
    ds_rows = (t_local * H + offs_h.to(gl.int64)) * K_slots  # [64]
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LS))
    for i in range(gl.cdiv(n_slots, BLOCK_K)):
        b = i % NUM_BUF
        k0 = i * BLOCK_K
        idx, _ = _load_idx(idx_row, k0, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K]
        if D_R > 0:
            idx_t, _ = _load_idx(idx_row, k0, n_slots, T_k, BLOCK_K, rl_t)  # [BLOCK_K]
        # dS exists below n_slots only (the probabilities kernels write no further): zeros past it, and for heads
        # past H.
        in_row = mask_h[:, None] & ((k0 + cols) < n_slots)[None, :]
        ds = gl.load(ds_ptr + ds_rows[:, None] + (k0 + cols)[None, :], mask=in_row, other=0.0)  # [64, BLOCK_K]
        mbarrier.wait(free.index(b), ((i // NUM_BUF) & 1) ^ 1)
        valid = (idx >= 0) & (idx < T_k)
        _gather(kv_bufs.index(b), kv_ptr, gl.where(valid, idx, 0).to(gl.int64) * D_QK, valid, 0, D_V, LV)
        if D_R > 0:
            valid_t = (idx_t >= 0) & (idx_t < T_k)
            _gather(kt_bufs.index(b), kv_ptr, gl.where(valid_t, idx_t, 0).to(gl.int64) * D_QK, valid_t, D_V, D_R,
                    LT)  # fmt: skip
        cp.mbarrier_arrive(ready.index(b), increment_count=False)
        ds_bufs.index(b).store(ds)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(b))


@gluon.jit
def _consume(args, sm, C0: gl.constexpr, WIDTH: gl.constexpr, ROPE: gl.constexpr, H: gl.constexpr,
             D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr):  # fmt: skip
    """``dq[:, C0:C0+WIDTH] = sum_i dS_i K_i[:, C0:C0+WIDTH]`` (and with ``ROPE`` the rope columns), tile i's wgmma
    issued before tile i-1's is waited for; tile i-1's buffer released after it."""
    kv_ptr, ds_ptr, dq_ptr, idx_row, t, t_local, hb, n_slots, T_k, K_slots = args
    kv_bufs, kt_bufs, ds_bufs, ready, ds_ready, free = sm
    D_QK: gl.constexpr = D_V + D_R
    o_layout: gl.constexpr = _mma_layout(WIDTH)
    acc = gl.zeros([_BLOCK_H, WIDTH], gl.float32, layout=o_layout)
    if ROPE:
        r_layout: gl.constexpr = _mma_layout(D_R)
        acc_r = gl.zeros([_BLOCK_H, D_R], gl.float32, layout=r_layout)
    n_tiles = gl.cdiv(n_slots, BLOCK_K)
    for i in range(n_tiles):
        b = i % NUM_BUF
        phase = (i // NUM_BUF) & 1
        mbarrier.wait(ready.index(b), phase)
        mbarrier.wait(ds_ready.index(b), phase)
        # The rows came by cp.async (the generic proxy): order them before the wgmma's reads (the async proxy), as
        # the forward's softmax warpgroup does; dS was fenced by the producer after its store.
        fence_async_shared()
        acc = warpgroup_mma(ds_bufs.index(b), kv_bufs.index(b).slice(C0, WIDTH, dim=1), acc, is_async=True)
        if ROPE:
            acc_r = warpgroup_mma(ds_bufs.index(b), kt_bufs.index(b), acc_r, is_async=True)  # [64, D_R]
            # Tile i's two wgmmas stay in flight; tile i-1's have completed.
            acc, acc_r = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_r))
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if i > 0:
            mbarrier.arrive(free.index((i - 1) % NUM_BUF))
    if ROPE:
        acc, acc_r = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_r))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if n_tiles > 0:
        mbarrier.arrive(free.index((n_tiles - 1) % NUM_BUF))

    dq_row = dq_ptr + t * (H * D_QK)
    oh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    oc = C0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, o_layout))
    gl.store(dq_row + oh[:, None] * D_QK + oc[None, :], acc.to(dq_ptr.dtype.element_ty), mask=(oh < H)[:, None])
    if ROPE:
        rh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, r_layout))
        rc = D_V + gl.arange(0, D_R, layout=gl.SliceLayout(0, r_layout))
        gl.store(dq_row + rh[:, None] * D_QK + rc[None, :], acc_r.to(dq_ptr.dtype.element_ty), mask=(rh < H)[:, None])


@gluon.jit
def _left(args, sm, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_K: gl.constexpr,
          NUM_BUF: gl.constexpr):  # fmt: skip
    """Worker partition: the left half of the value columns."""
    _consume(args, sm, 0, D_V // 2, False, H, D_V, D_R, BLOCK_K, NUM_BUF)


@gluon.jit
def _right(args, sm, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_K: gl.constexpr,
           NUM_BUF: gl.constexpr):  # fmt: skip
    """Default partition: the right half of the value columns and the rope columns."""
    _consume(args, sm, D_V // 2, D_V // 2, D_R > 0, H, D_V, D_R, BLOCK_K, NUM_BUF)


@gluon.jit(do_not_specialize=["row_offset", "T_k", "K_slots"])
def sparse_mla_bwd_sm90_dq_ws_kernel(
    kv_ptr, idx_ptr, len_ptr, ds_ptr, dq_ptr,
    row_offset, T_k, K_slots,
    H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_LEN: gl.constexpr,
    BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, REGS_LEFT: gl.constexpr, REGS_PRODUCER: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """One program per (query row ``row_offset + pid // NUM_HB``, block of 64 heads); the launch signature of the
    lockstep dq kernel (``kv [T_k, D_qk]``, ``idx [T, K] int32``, ``topk_length``, ``dS [rows, H, K]`` of this row
    chunk, ``dq [T, H, D_qk]``)."""
    NUM_HB: gl.constexpr = (H + _BLOCK_H - 1) // _BLOCK_H
    dtype: gl.constexpr = kv_ptr.dtype.element_ty
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")

    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_V], dtype)
    kv_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, D_V], kv_sl)
    if D_R > 0:
        kt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_R], dtype)
        kt_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, D_R], kt_sl)
    else:
        kt_bufs = kv_bufs
    ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, BLOCK_K], dtype)
    ds_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, _BLOCK_H, BLOCK_K], ds_sl)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(j), count=128)  # every producer thread, when its copies have landed
        mbarrier.init(ds_ready.index(j), count=1)  # the producer, once dS is in shared memory
        mbarrier.init(free.index(j), count=2)  # both consumers

    pid = gl.program_id(0)
    t_local = (pid // NUM_HB).to(gl.int64)
    t = row_offset + t_local
    hb = pid % NUM_HB
    n_slots = _row_slots(len_ptr, t, K_slots, HAS_LEN)  # scalar
    args = (kv_ptr, ds_ptr, dq_ptr, idx_ptr + t * K_slots, t, t_local, hb, n_slots, T_k, K_slots)
    sm = (kv_bufs, kt_bufs, ds_bufs, ready, ds_ready, free)
    gl.warp_specialize(
        [
            (_right, (args, sm, H, D_V, D_R, BLOCK_K, NUM_BUF)),
            (_left, (args, sm, H, D_V, D_R, BLOCK_K, NUM_BUF)),
            (_producer, (args, sm, H, D_V, D_R, BLOCK_K, NUM_BUF)),
        ],
        [4, 4],
        [REGS_LEFT, REGS_PRODUCER],
    )


def dq_ws_smem_bytes(block_k: int, num_buf: int, d_qk: int, itemsize: int) -> int:
    """Shared memory of one program: the ring of gathered rows, its dS tiles and the barriers."""
    return num_buf * block_k * (d_qk + 64) * itemsize + 512


def dq_ws_unsupported_reason(num_heads: int, d_qk: int, d_v: int) -> str | None:
    """``None`` where this kernel computes dq for ``H`` heads of ``D_qk`` with value width ``d_v`` (on top of the
    lockstep dq kernel's rules), else why not: halves of ``d_v`` of 64 to 256 columns (one wgmma each) and a rope tail
    of 0 or 16..256 columns in multiples of 16."""
    d_r = d_qk - d_v
    if d_v % 128 or not 128 <= d_v <= 512:
        return f"it splits d_v into two halves of 64..256 columns, got d_v={d_v}"
    if d_r and (d_r % 16 or not 16 <= d_r <= 256):
        return f"its rope tail is one wgmma of 16..256 columns in multiples of 16, got D_qk - d_v={d_r}"
    if num_heads < 64:
        return f"it needs at least 64 heads, got H={num_heads}"
    return None
