"""Sparse MLA backward kernels for Hopper (SM90) in Gluon (with :mod:`.sparse_mla_bwd_sm90_ws`, the backward's default
on SM90 GPUs).

- :func:`sparse_mla_bwd_sm90_kernel_ds_dkv`: probabilities and dkv in one pass, two warpgroups in lockstep (fp32
  atomics, or per-slot pieces in deterministic mode); forced with ``layout="fused"`` (the default whenever dkv is
  wanted is its warp-specialized twin, :mod:`.sparse_mla_bwd_sm90_ws`).
- :func:`sparse_mla_bwd_sm90_kernel_dq`: ``dq = dS K`` on the forward kernel's cp.async ring; the default dq kernel.
- :func:`sparse_mla_bwd_sm90_kernel_ds`, below: the probabilities alone (P and dS stored for the portable dkv
  kernel), used when no dkv is wanted or the dkv kernel is forced.

Which runs when: :mod:`longtrain.dsa.triton.sparse_mla_bwd_plan` (with each kernel's shared-memory budget). On the
H200 at T = 16384, H = 64, K = 2048 the backward takes 49.95 ms with the first two, 37.33 with the warp-specialized
kernel and the dq kernel (``benchmarks/results/dsa_mla_920af72_2026-12-02.md``).

The probabilities kernel has the same contract as
:func:`longtrain.dsa.triton.sparse_mla_bwd.sparse_mla_bwd_kernel_ds` (one program per (query row, block of 64 heads);
stores ``P = exp2(S * qk_scale - lse2)`` and ``dS = sm_scale * P * (dP - delta)`` in the input
dtype, zeros on invalid slots). ``S = Q K^T`` (K-depth ``D_qk``) and ``dP = dO V^T`` (K-depth ``d_v``) share their
B operand, the gathered latent rows, so the kernel computes both as one wgmma of ``M = 128`` stacked rows::

    [ S  ]   [ Q_v  Q_r ]   [ K_v^T ]
    [ dP ] = [ dO   0   ] x [ K_r^T ]      (128 x BLOCK_K, one warpgroup per 64 rows, N = BLOCK_K)

with the latent A operand held in registers for the whole row and the rope one in shared memory (the rope
columns of the ``dO`` rows are zeros: 6% of the FLOPs). Each warpgroup's wgmma is ``N = BLOCK_K`` wide, where
splitting the keys between two warpgroups (the forward kernel's way) gave ``N = BLOCK_K / 2`` (a port in that
style was slower than the portable kernel). The stacked rows are turned into P (top half) and ``dP - delta``
(bottom half) in registers, meet through one shared-memory tile, and ``P`` / ``dS`` are stored from a blocked
layout. The gathered rows stream through a ring of ``NUM_BUF`` tiles of ``BLOCK_K`` rows (``cp.async``, invalid
slots zero-filled), the copy of tile ``i + NUM_BUF - 1`` issued at the top of step ``i``, as in
:mod:`longtrain.dsa.triton.sparse_mla_fwd_sm90`. Compiled for sm_90a by Triton 3.6 it keeps 255 registers and
spills 128 bytes per thread (``block_k = 64``), reloaded from local memory in the loop.

Gluon kernels do not run in Triton's CPU interpreter: on CPU their routing and their sm_90a compilation are tested;
their numerics are checked on the GPU (``tests/gpu/test_dsa_triton_gpu.py``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from longtrain.dsa.triton.sparse_mla_fwd_sm90 import (
    _async_load,
    _cta_barrier,
    _gather_layout,
    _half_n_mma_layout,
    _issue_tile,
    _load_idx,
    _ring_advance,
    _ring_start,
)

__all__ = [
    "sparse_mla_bwd_sm90_kernel_dq",
    "sparse_mla_bwd_sm90_kernel_ds",
    "sparse_mla_bwd_sm90_kernel_ds_dkv",
]


@gluon.jit
def _row_slots(len_ptr, t, K_slots, HAS_LEN: gl.constexpr):
    """Slots of row ``t``: its ``topk_length`` clamped to ``[0, K_slots]``, or all ``K_slots``."""
    if HAS_LEN:
        return gl.minimum(gl.maximum(gl.load(len_ptr + t).to(gl.int32), 0), K_slots)  # scalar
    else:
        return K_slots


@gluon.jit
def _stacked_rows(q_row, do_row, hb, H: gl.constexpr, D_QK: gl.constexpr, D_V: gl.constexpr, col0: gl.constexpr,
                  W: gl.constexpr, layout: gl.constexpr, INTERLEAVED: gl.constexpr):  # fmt: skip
    """``[128, W]`` stacked operand at columns ``col0 + [0, W)``: the block's queries and its dO (zeros past ``D_V``,
    and for heads past ``H``), rows 0-63 queries and 64-127 dO, or ``INTERLEAVED`` as in ``_interleaved_rows``."""
    m = gl.arange(0, 128, layout=gl.SliceLayout(1, layout))
    c = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, layout))
    if INTERLEAVED:
        head, is_q = _interleaved_rows(m, hb)
    else:
        head = hb * 64 + (m % 64)
        is_q = m < 64
    ok = head < H
    a = gl.load(q_row + head[:, None] * D_QK + c[None, :], mask=(ok & is_q)[:, None], other=0.0)  # [128, W]
    in_v = c < D_V
    b = gl.load(do_row + head[:, None] * D_V + c[None, :], mask=(ok & ~is_q)[:, None] & in_v[None, :], other=0.0)
    return a + b  # [128, W]: one of the two is 0 at every element


@gluon.jit(do_not_specialize=["row_offset", "T_k", "K_slots"])
def sparse_mla_bwd_sm90_kernel_ds(
    q_ptr, kv_ptr, dout_ptr, idx_ptr, len_ptr, lse2_ptr, delta_ptr, p_ptr, ds_ptr,
    row_offset, T_k, K_slots, sm_scale, qk_scale,
    H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
    HAS_LEN: gl.constexpr, STORE_P: gl.constexpr,
    BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    BLOCK_H: gl.constexpr = 64
    D_QK: gl.constexpr = D_V + D_R
    NUM_HB: gl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    gl.static_assert(num_warps == 8, "two warpgroups, one per 64 stacked rows")

    # Layouts: gathers, the stacked result [128, BLOCK_K] (8 warps along M), its A operands, and the blocked
    # layout P / dS are combined and stored in.
    LV: gl.constexpr = _gather_layout(D_V, num_warps)
    LR: gl.constexpr = _gather_layout(D_R, num_warps)
    c_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_K, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=c_layout, k_width=2)
    out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (BLOCK_K // 4), BLOCK_K // 4], [num_warps, 1], [1, 0])

    # Shared memory: the ring of gathered tiles and the fp32 tile where the halves meet.
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_V], dtype)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, D_V], kv_sl)
    if D_R > 0:
        kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_R], dtype)
        r_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, D_R], kr_sl)
    else:
        r_bufs = v_bufs
    x_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    x_smem = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_H, BLOCK_K], x_sl)

    pid = gl.program_id(0)
    t_local = (pid // NUM_HB).to(gl.int64)
    t = row_offset + t_local
    hb = pid % NUM_HB

    # The stacked A operands, in registers for the whole row: [Q_v; dO] and [Q_r; 0].
    q_row = q_ptr + t * (H * D_QK)
    do_row = dout_ptr + t * (H * D_V)
    a_v = _stacked_rows(q_row, do_row, hb, H, D_QK, D_V, 0, D_V, a_layout, False)  # [128, D_V]
    if D_R > 0:  # the rope part's A operand waits in shared memory (registers are the scarce resource here)
        ar_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D_R], dtype)
        a_r = gl.allocate_shared_memory(dtype, [2 * BLOCK_H, D_R], ar_sl)
        a_r.store(_stacked_rows(q_row, do_row, hb, H, D_QK, D_V, D_V, D_R, LR, False))  # [128, D_R]
        fence_async_shared()
    else:
        a_r = a_v

    # Per stacked row: rows 0-63 turn logits into P with lse2, rows 64-127 dP into dP - delta.
    m = gl.arange(0, 2 * BLOCK_H, layout=gl.SliceLayout(1, c_layout))
    head_m = hb * BLOCK_H + (m % BLOCK_H)
    is_s = m < BLOCK_H
    # Rows without keys have lse2 = +inf: every probability below is exactly 0.
    lse2 = gl.load(lse2_ptr + t * H + head_m, mask=head_m < H, other=float("inf"))  # [128]
    delta = gl.load(delta_ptr + t * H + head_m, mask=head_m < H, other=0.0)  # [128]
    shift = gl.where(is_s, lse2, delta)  # [128]
    scale = gl.where(is_s, qk_scale, 1.0)  # [128]

    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, out_layout))
    mask_h = offs_h < H
    scratch_rows = (t_local * H + offs_h.to(gl.int64)) * K_slots  # [BLOCK_H]

    n_slots = _row_slots(len_ptr, t, K_slots, HAS_LEN)  # scalar
    idx_row = idx_ptr + t * K_slots

    # Prologue: tiles 0 .. NUM_BUF-2 in flight, indices of tile NUM_BUF-1 in registers.
    nxt_v, nxt_mv, nxt_r, nxt_mr = _ring_start(kv_ptr, 0, D_V, D_QK, idx_row, n_slots, T_k, v_bufs, r_bufs,
                                               D_V, D_R, BLOCK_K, NUM_BUF, LV, LR)  # fmt: skip

    c_zero = gl.zeros([2 * BLOCK_H, BLOCK_K], gl.float32, layout=c_layout)
    n_tiles = gl.cdiv(n_slots, BLOCK_K)
    for i in range(n_tiles):
        buf = i % NUM_BUF
        # (Also: every warp has finished step i-1's reads of the meeting tile.)
        nxt_v, nxt_mv, nxt_r, nxt_mr = _ring_advance(kv_ptr, 0, D_V, D_QK, idx_row, n_slots, T_k, i, nxt_v, nxt_mv,
                                                     nxt_r, nxt_mr, v_bufs, r_bufs, D_V, D_R, BLOCK_K, NUM_BUF, LV,
                                                     LR)  # fmt: skip

        c = warpgroup_mma(a_v, v_bufs.index(buf).permute((1, 0)), c_zero, use_acc=False, is_async=True)
        if D_R > 0:
            c = warpgroup_mma(a_r, r_bufs.index(buf).permute((1, 0)), c, is_async=True)  # [128, BLOCK_K]
        _, valid = _load_idx(idx_row, i * BLOCK_K, n_slots, T_k, BLOCK_K, gl.SliceLayout(0, c_layout))  # [BLOCK_K]
        c = warpgroup_mma_wait(num_outstanding=0, deps=(c,))

        # Top half: P (0 on invalid slots); bottom half: dP - delta.
        x = c * scale[:, None] - shift[:, None]
        x = gl.where(is_s[:, None], gl.where(valid[None, :], gl.exp2(x), 0.0), x)  # [128, BLOCK_K]
        x_smem.store(x)
        _cta_barrier()
        p = x_smem.slice(0, BLOCK_H, dim=0).load(out_layout)  # [BLOCK_H, BLOCK_K]
        d = x_smem.slice(BLOCK_H, BLOCK_H, dim=0).load(out_layout)  # [BLOCK_H, BLOCK_K]
        ds = p * d * sm_scale  # [BLOCK_H, BLOCK_K]
        offs_k = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, out_layout))
        ptrs = scratch_rows[:, None] + offs_k[None, :]
        mask = mask_h[:, None] & (offs_k < n_slots)[None, :]
        gl.store(ds_ptr + ptrs, ds.to(ds_ptr.dtype.element_ty), mask=mask)
        if STORE_P:
            gl.store(p_ptr + ptrs, p.to(p_ptr.dtype.element_ty), mask=mask)
    cp.wait_group(0)


@gluon.jit
def _alias_36(buf, dtype: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
    return buf._reinterpret(dtype, [ROWS, COLS], layout)


@gluon.jit
def _alias_39(buf, dtype: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr, layout: gl.constexpr):
    return buf.reinterpret(dtype, [ROWS, COLS], layout)


# A ``[ROWS, COLS]`` view of a shared-memory buffer's start: Triton 3.6 names it ``_reinterpret``, later releases
# ``reinterpret``.
_alias = _alias_39 if hasattr(gl.shared_memory_descriptor, "reinterpret") else _alias_36


@gluon.jit
def _interleaved_rows(m, hb):
    """Head and kind of stacked row ``m``: rows ``16 b + j`` (``j < 8``) are the queries of head ``8 b + j``, rows
    ``16 b + 8 + j`` its ``dO``: in a wgmma accumulator one thread holds rows ``r`` and ``r + 8`` of its warp's 16, so
    every thread holds a head's logits and ``dO V^T`` side by side."""
    j = m % 16
    return hb * 64 + (m // 16) * 8 + j % 8, j < 8


@gluon.jit
def _dkv_out(ptrs, value, mask, scale_ptrs, row_ok, DETERMINISTIC: gl.constexpr, SCALED: gl.constexpr,
             N_SCALES: gl.constexpr):  # fmt: skip
    """Add a dkv piece (fp32 atomics), or store it (the deterministic mode's per-slot scratch); ``SCALED``: as scaled
    fp16 rows, each row's scale at ``scale_ptrs + j`` for the tile's ``N_SCALES`` column groups (see
    :mod:`longtrain.dsa.triton.sparse_mla_bwd_reduce`)."""
    if DETERMINISTIC:
        if SCALED:
            value, scale = _scale_piece_rows(value)
            for j in gl.static_range(N_SCALES):
                gl.store(scale_ptrs + j, scale, mask=row_ok)
        gl.store(ptrs, value, mask=mask)
    else:
        gl.atomic_add(ptrs, value, mask=mask, sem="relaxed")


@gluon.jit
def _scale_piece_rows(value):
    """Gluon's :func:`longtrain.dsa.triton.sparse_mla_bwd_reduce.scale_piece_rows`: ``(value / scale[:, None],
    scale)``, a power of two per row putting its largest finite magnitude in ``[2**14, 2**15)``."""
    mag = gl.abs(value)
    top = gl.max(gl.where(mag < float("inf"), mag, 0.0), axis=1)  # [R]: NaN and infinities take no part
    bits = gl.maximum((top.to(gl.int32, bitcast=True) & 0x7F800000) - (14 << 23), 1 << 23)  # [R]
    inv = ((254 << 23) - bits).to(gl.float32, bitcast=True)  # [R]: 1 / scale, a normal power of two
    return value * inv[:, None], bits.to(gl.float32, bitcast=True)


@gluon.jit(do_not_specialize=["row_offset", "T_k", "K_slots"])
def sparse_mla_bwd_sm90_kernel_ds_dkv(
    q_ptr, kv_ptr, dout_ptr, idx_ptr, len_ptr, lse2_ptr, delta_ptr, ds_ptr, dkv_ptr, scale_ptr,
    row_offset, T_k, K_slots, sm_scale, qk_scale,
    H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_LEN: gl.constexpr, DETERMINISTIC: gl.constexpr,
    num_warps: gl.constexpr, SCALED: gl.constexpr = False, GROUP_COLS: gl.constexpr = 64,
):  # fmt: skip
    """Probabilities and dkv in one pass (the dq kernel then reads ``dS``), one program per (query row, block of 64
    heads), 64 gathered slots per step:

    1. ``[S; dP] = [Q; dO 0] K^T``: one wgmma of 128 stacked rows (interleaved per head, see ``_interleaved_rows``)
       with both operands in shared memory;
    2. in registers, each head's ``P`` and ``dS = sm_scale * P * (dP - delta)``; ``dS`` is stored for the dq kernel;
    3. ``dkv[idx] += [dS; P]^T [Q; dO 0]``: the stacked operand is the B operand of a second wgmma (K = 128), fed
       ``[dS; P]^T`` from registers (transposed through the gathered tile's buffer, which step 1 has finished with);
       the value columns in two halves (the first half's fp32 atomics run under the second half's wgmma), then the
       rope columns.

    The next tile's gather is issued into the freed buffer before step 3, so it runs under the dkv matmuls and
    atomics. ``DETERMINISTIC``: each slot's dkv piece is stored instead, at scratch row
    ``(t_local * K_slots + slot) * NUM_HB + hb`` of ``dkv_ptr`` (the dkv kernel's deterministic layout, summed per key
    in a fixed order by ``sparse_mla_bwd_kernel_dkv_reduce``); ``SCALED``: as scaled fp16 rows, their scales at
    ``scale_ptr[scratch row, group]`` for each group of ``GROUP_COLS`` columns (each value half's and the rope
    columns' one scale repeated over their groups).
    """
    BLOCK_K: gl.constexpr = 64
    D_QK: gl.constexpr = D_V + D_R
    NUM_HB: gl.constexpr = (H + 63) // 64
    HALF: gl.constexpr = D_V // 2
    NUM_GROUPS: gl.constexpr = (D_QK + GROUP_COLS - 1) // GROUP_COLS  # scaled fp16 pieces' scales per piece row
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    gl.static_assert(num_warps == 8, "two warpgroups")
    gl.static_assert(D_V >= 128, "the [dS; P] tile lives in the gathered tile's value buffer")

    LV: gl.constexpr = _gather_layout(D_V, num_warps)
    LR: gl.constexpr = _gather_layout(D_R, num_warps)
    # [S; dP]: [128, BLOCK_K], 8 warps along M. dkv pieces: [BLOCK_K, n], the warpgroups splitting n.
    c_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_K, 16]
    )
    dv_layout: gl.constexpr = _half_n_mma_layout(HALF)
    a2_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
    row_c: gl.constexpr = gl.SliceLayout(1, c_layout)
    col_c: gl.constexpr = gl.SliceLayout(0, c_layout)
    row_d: gl.constexpr = gl.SliceLayout(1, dv_layout)

    stack_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, D_V], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_V], dtype)
    y_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, BLOCK_K], dtype)
    a_v = gl.allocate_shared_memory(dtype, [128, D_V], stack_sl)
    v_buf = gl.allocate_shared_memory(dtype, [BLOCK_K, D_V], kv_sl)
    if D_R > 0:
        stack_r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, D_R], dtype)
        kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_R], dtype)
        a_r = gl.allocate_shared_memory(dtype, [128, D_R], stack_r_sl)
        r_buf = gl.allocate_shared_memory(dtype, [BLOCK_K, D_R], kr_sl)
    else:
        a_r = a_v
        r_buf = v_buf
    y_smem = _alias(v_buf, dtype, 128, BLOCK_K, y_sl)

    pid = gl.program_id(0)
    t_local = (pid // NUM_HB).to(gl.int64)
    t = row_offset + t_local
    hb = pid % NUM_HB

    # The stacked operand (heads past H zero-filled), in the first copy group with tile 0.
    q_row = q_ptr + t * (H * D_QK)
    do_row = dout_ptr + t * (H * D_V)
    # (Staged through registers: a cp.async from a per-row choice of two tensors is not vectorised by every Triton.)
    a_v.store(_stacked_rows(q_row, do_row, hb, H, D_QK, D_V, 0, D_V, LV, True))  # [128, D_V]
    if D_R > 0:
        head_r, is_q_r = _interleaved_rows(gl.arange(0, 128, layout=gl.SliceLayout(1, LR)), hb)
        cr = gl.arange(0, D_R, layout=gl.SliceLayout(0, LR))
        src_r = q_row + head_r * D_QK + D_V  # [128]
        _async_load(a_r, src_r[:, None] + cr[None, :], mask=((head_r < H) & is_q_r)[:, None])  # [128, D_R]

    n_slots = _row_slots(len_ptr, t, K_slots, HAS_LEN)  # scalar
    idx_row = idx_ptr + t * K_slots

    # Per stacked row: query rows turn logits into P with lse2, dO rows dP into dP - delta.
    head_c, is_q = _interleaved_rows(gl.arange(0, 128, layout=row_c), hb)
    ok_c = head_c < H
    # Rows without keys have lse2 = +inf: every probability below is exactly 0.
    lse2 = gl.load(lse2_ptr + t * H + head_c, mask=ok_c, other=float("inf"))  # [128]
    delta = gl.load(delta_ptr + t * H + head_c, mask=ok_c, other=0.0)  # [128]
    shift = gl.where(is_q, lse2, delta)  # [128]
    scale = gl.where(is_q, qk_scale, 1.0)  # [128]
    ds_rows = (t_local * H + head_c.to(gl.int64)) * K_slots  # [128]
    store_rows = is_q & ok_c  # [128]

    iv, mv = _load_idx(idx_row, 0, n_slots, T_k, BLOCK_K, gl.SliceLayout(1, LV))  # [BLOCK_K] x 2
    ir, mr = _load_idx(idx_row, 0, n_slots, T_k, BLOCK_K, gl.SliceLayout(1, LR))  # [BLOCK_K] x 2
    _issue_tile(kv_ptr, 0, D_V, iv, mv, ir, mr, v_buf, r_buf, D_QK, D_V, D_R, LV, LR)

    c_zero = gl.zeros([128, BLOCK_K], gl.float32, layout=c_layout)
    dv_zero = gl.zeros([BLOCK_K, HALF], gl.float32, layout=dv_layout)
    cols_d = gl.arange(0, HALF, layout=gl.SliceLayout(0, dv_layout))
    if D_R > 0:
        dr_layout: gl.constexpr = _half_n_mma_layout(D_R)
        a2r_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dr_layout, k_width=2)
        dr_zero = gl.zeros([BLOCK_K, D_R], gl.float32, layout=dr_layout)
        cols_r = gl.arange(0, D_R, layout=gl.SliceLayout(0, dr_layout))
    n_tiles = gl.cdiv(n_slots, BLOCK_K)
    for i in range(n_tiles):
        k0 = i * BLOCK_K
        cp.wait_group(0)
        fence_async_shared()
        _cta_barrier()
        c = warpgroup_mma(a_v, v_buf.permute((1, 0)), c_zero, use_acc=False, is_async=True)  # [128, BLOCK_K]
        if D_R > 0:
            c = warpgroup_mma(a_r, r_buf.permute((1, 0)), c, is_async=True)
        _, valid = _load_idx(idx_row, k0, n_slots, T_k, BLOCK_K, col_c)  # [BLOCK_K]
        keys, valid_d = _load_idx(idx_row, k0, n_slots, T_k, BLOCK_K, row_d)  # [BLOCK_K] x 2
        nv, nmv = _load_idx(idx_row, k0 + BLOCK_K, n_slots, T_k, BLOCK_K, gl.SliceLayout(1, LV))  # [BLOCK_K] x 2
        nr, nmr = _load_idx(idx_row, k0 + BLOCK_K, n_slots, T_k, BLOCK_K, gl.SliceLayout(1, LR))  # [BLOCK_K] x 2
        c = warpgroup_mma_wait(num_outstanding=0, deps=(c,))

        # Query rows: P (0 on invalid slots); dO rows: dP - delta. Each thread holds both for its heads.
        x = c * scale[:, None] - shift[:, None]
        x = gl.where(is_q[:, None], gl.where(valid[None, :], gl.exp2(x), 0.0), x)  # [128, BLOCK_K]
        p, d = gl.split(gl.permute(gl.reshape(x, [8, 2, 8, BLOCK_K]), (0, 2, 3, 1)))  # [8, 8, BLOCK_K] x 2
        y = gl.reshape(gl.permute(gl.join(p * d * sm_scale, p), (0, 3, 1, 2)), [128, BLOCK_K])
        y = gl.convert_layout(y, c_layout, assert_trivial=True).to(dtype)  # [128, BLOCK_K]: dS rows, P rows
        offs_k = k0 + gl.arange(0, BLOCK_K, layout=col_c)
        gl.store(ds_ptr + ds_rows[:, None] + offs_k[None, :], y, mask=store_rows[:, None] & (offs_k < n_slots)[None, :])

        _cta_barrier()  # both warpgroups' step-1 wgmma are done with the tile: its buffer holds [dS; P] now
        y_smem.store(y)
        _cta_barrier()
        a2 = y_smem.permute((1, 0)).load(a2_layout)  # [BLOCK_K, 128]
        if D_R > 0:
            a2r = y_smem.permute((1, 0)).load(a2r_layout)  # [BLOCK_K, 128]
        _cta_barrier()
        if i + 1 < n_tiles:
            _issue_tile(kv_ptr, 0, D_V, nv, nmv, nr, nmr, v_buf, r_buf, D_QK, D_V, D_R, LV, LR)

        if DETERMINISTIC:  # this row's slots in the per-slot scratch (one row per slot and head block)
            slots = k0 + gl.arange(0, BLOCK_K, layout=row_d)
            piece_rows = (t_local * K_slots + slots.to(gl.int64)) * NUM_HB + hb  # [BLOCK_K]
            rows = piece_rows * D_QK
        else:
            piece_rows = gl.where(valid_d, keys, 0).to(gl.int64)  # [BLOCK_K] (unused)
            rows = piece_rows * D_QK  # [BLOCK_K]
        scales = scale_ptr + piece_rows * NUM_GROUPS  # [BLOCK_K]
        acc = warpgroup_mma(a2, a_v.slice(0, HALF, dim=1), dv_zero, use_acc=False, is_async=True)  # [BLOCK_K, HALF]
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc2 = warpgroup_mma(a2, a_v.slice(HALF, HALF, dim=1), dv_zero, use_acc=False, is_async=True)
        _dkv_out(dkv_ptr + rows[:, None] + cols_d[None, :], acc, valid_d[:, None], scales, valid_d, DETERMINISTIC,
                 SCALED, HALF // GROUP_COLS)  # fmt: skip
        acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc2,))
        if D_R > 0:
            accr = warpgroup_mma(a2r, a_r, dr_zero, use_acc=False, is_async=True)  # [BLOCK_K, D_R]
        _dkv_out(dkv_ptr + rows[:, None] + HALF + cols_d[None, :], acc2, valid_d[:, None],
                 scales + HALF // GROUP_COLS, valid_d, DETERMINISTIC, SCALED, HALF // GROUP_COLS)  # fmt: skip
        if D_R > 0:
            accr = warpgroup_mma_wait(num_outstanding=0, deps=(accr,))
            rows_r = gl.convert_layout(rows, gl.SliceLayout(1, dr_layout))
            valid_r = gl.convert_layout(valid_d, gl.SliceLayout(1, dr_layout))
            scales_r = gl.convert_layout(scales, gl.SliceLayout(1, dr_layout)) + D_V // GROUP_COLS
            _dkv_out(dkv_ptr + rows_r[:, None] + D_V + cols_r[None, :], accr, valid_r[:, None], scales_r, valid_r,
                     DETERMINISTIC, SCALED, (D_R + GROUP_COLS - 1) // GROUP_COLS)  # fmt: skip
    cp.wait_group(0)


@gluon.jit
def _ds_copy(dst, ds_ptr, ds_rows, rows_ok, k0, BLOCK_K: gl.constexpr, layout: gl.constexpr):
    """cp.async ``dS`` of slots ``k0 + [0, BLOCK_K)`` for the program's heads into ``dst`` ``[heads, BLOCK_K]``, rows
    where ``rows_ok`` (zero-filled elsewhere: the mask is per row, so the copies stay 16 bytes wide). Not committed:
    it joins the copy group of the tile issued next."""
    offs = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    _async_load(dst, ds_ptr + ds_rows[:, None] + offs[None, :], mask=rows_ok[:, None])  # [heads, BLOCK_K]


@gluon.jit
def _ds_tile(ds_ptr, ds_rows, mask_h, k0, n_slots, BLOCK_K: gl.constexpr, layout: gl.constexpr):
    """``dS`` of slots ``k0 + [0, BLOCK_K)`` for the program's heads (0 past ``n_slots``): ``[heads, BLOCK_K]``."""
    offs = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    mask = mask_h[:, None] & (offs < n_slots)[None, :]
    return gl.load(ds_ptr + ds_rows[:, None] + offs[None, :], mask=mask, other=0.0)  # [heads, BLOCK_K]


@gluon.constexpr_function
def _dq_acc_layout(heads, n):
    """The dq kernel's accumulator ``[heads, n]``: 64 heads, the two warpgroups splitting ``n``; 128 heads, each
    warpgroup 64 of them."""
    if heads == 64:
        return _half_n_mma_layout(n)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, n, 16])


@gluon.jit(do_not_specialize=["row_offset", "T_k", "K_slots"])
def sparse_mla_bwd_sm90_kernel_dq(
    kv_ptr, idx_ptr, len_ptr, ds_ptr, dq_ptr,
    row_offset, T_k, K_slots,
    H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_LEN: gl.constexpr,
    BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, HEADS: gl.constexpr, DS_SMEM: gl.constexpr,
    num_warps: gl.constexpr, STAGED_STORE: gl.constexpr = False,
):  # fmt: skip
    """``dq = dS K`` over a row's gathered slots: the gathered rows stream through the forward's cp.async ring of
    ``NUM_BUF`` tiles of ``BLOCK_K`` rows, each step one wgmma per part (latent, rope). Same contract as
    :func:`longtrain.dsa.triton.sparse_mla_bwd.sparse_mla_bwd_kernel_dq`.

    ``DS_SMEM`` (``K_slots`` a multiple of 8, so that a row of ``dS`` starts on 16 bytes): each tile's ``dS`` rides
    in the ring with its gathered rows (the same cp.async group) and is the wgmma's A operand from shared memory.
    The probabilities kernels store ``dS`` for slots below ``n_slots`` only, so a row's last, partial tile is loaded
    with a per-slot mask through registers instead (the unwritten scratch past ``n_slots`` may hold anything, NaN
    included, and NaN times the zero-filled rows of invalid slots is NaN). Otherwise (``DS_SMEM`` off) every tile's
    ``dS`` is loaded one step ahead into registers and fed from there.

    ``HEADS = 64``: one program per (query row, block of 64 heads), every column, the two warpgroups splitting the
    columns. ``HEADS = 128`` (``H`` a multiple of 128): two programs per (query row, block of 128 heads), each owning
    half of the value columns and half of the rope columns for all 128 heads, a warpgroup per 64 heads. A row's
    gathered bytes are then read once per 128 heads instead of once per 64 (half the gather traffic, twice the ``dS``
    reads: 1664 against 2560 bytes per slot at 128 heads, ``D_qk = 576``)."""
    D_QK: gl.constexpr = D_V + D_R
    PARTS: gl.constexpr = 1 if HEADS == 64 else 2
    WV: gl.constexpr = D_V // PARTS  # value columns per program
    WR: gl.constexpr = D_R // PARTS  # rope columns per program
    NUM_HB: gl.constexpr = (H + HEADS - 1) // HEADS
    gl.static_assert(num_warps == 8, "two warpgroups")
    gl.static_assert(HEADS == 64 or HEADS == 128, "64 or 128 heads per program")

    LV: gl.constexpr = _gather_layout(WV, num_warps)
    LR: gl.constexpr = _gather_layout(max(WR, 8), num_warps)
    LS: gl.constexpr = _gather_layout(BLOCK_K, num_warps)
    o_layout: gl.constexpr = _dq_acc_layout(HEADS, WV)

    dtype: gl.constexpr = kv_ptr.dtype.element_ty
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, WV], dtype)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, WV], kv_sl)
    if DS_SMEM:
        ds_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEADS, BLOCK_K], dtype)
        ds_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, HEADS, BLOCK_K], ds_sl)
    else:
        ds_bufs = v_bufs
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    if D_R > 0:
        kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, WR], dtype)
        r_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, WR], kr_sl)
        r_layout: gl.constexpr = _dq_acc_layout(HEADS, WR)
        if not DS_SMEM:
            ar_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=r_layout, k_width=2)
        acc_r = gl.zeros([HEADS, WR], gl.float32, layout=r_layout)
    else:
        r_bufs = v_bufs

    pid = gl.program_id(0)
    part = pid % PARTS
    t_local = (pid // (PARTS * NUM_HB)).to(gl.int64)
    t = row_offset + t_local
    hb = (pid // PARTS) % NUM_HB
    n_slots = _row_slots(len_ptr, t, K_slots, HAS_LEN)  # scalar
    idx_row = idx_ptr + t * K_slots
    offs_h = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, LS))
    mask_h = offs_h < H
    ds_rows = (t_local * H + offs_h.to(gl.int64)) * K_slots  # [HEADS]
    if DS_SMEM:
        ds_rows = gl.multiple_of(ds_rows, 8)  # K_slots % 8 == 0 (the host's choice): 16-byte copies

    v_off = part * WV  # this program's first value column
    r_off = D_V + part * WR  # ... and rope column
    # The ring of the forward kernel; with DS_SMEM each tile's dS in the same copy group as its gathered rows.
    rl_v: gl.constexpr = gl.SliceLayout(1, LV)
    rl_r: gl.constexpr = gl.SliceLayout(1, LR)
    for j in gl.static_range(NUM_BUF - 1):
        iv, mv = _load_idx(idx_row, j * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
        ir, mr = _load_idx(idx_row, j * BLOCK_K, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
        if DS_SMEM:
            _ds_copy(ds_bufs.index(j), ds_ptr, ds_rows, mask_h & ((j + 1) * BLOCK_K <= n_slots), j * BLOCK_K, BLOCK_K,
                     LS)  # fmt: skip
        _issue_tile(kv_ptr, v_off, r_off, iv, mv, ir, mr, v_bufs.index(j), r_bufs.index(j), D_QK, WV, WR, LV, LR)
    nxt_v, nxt_mv = _load_idx(idx_row, (NUM_BUF - 1) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
    nxt_r, nxt_mr = _load_idx(idx_row, (NUM_BUF - 1) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
    if not DS_SMEM:
        ds_cur = _ds_tile(ds_ptr, ds_rows, mask_h, 0, n_slots, BLOCK_K, LS)  # [HEADS, BLOCK_K]
    acc = gl.zeros([HEADS, WV], gl.float32, layout=o_layout)
    n_tiles = gl.cdiv(n_slots, BLOCK_K)
    for i in range(n_tiles):
        buf = i % NUM_BUF
        # Tile i has landed (this thread's copies, then everyone's: every warp has also finished step i-1, so the
        # buffer it read is free for tile i + NUM_BUF - 1).
        cp.wait_group(NUM_BUF - 2)
        fence_async_shared()
        _cta_barrier()
        nb = (i + NUM_BUF - 1) % NUM_BUF
        if DS_SMEM:
            k_nb = (i + NUM_BUF - 1) * BLOCK_K
            _ds_copy(ds_bufs.index(nb), ds_ptr, ds_rows, mask_h & (k_nb + BLOCK_K <= n_slots), k_nb, BLOCK_K, LS)
        _issue_tile(kv_ptr, v_off, r_off, nxt_v, nxt_mv, nxt_r, nxt_mr, v_bufs.index(nb), r_bufs.index(nb), D_QK, WV,
                    WR, LV, LR)  # fmt: skip
        nxt_v, nxt_mv = _load_idx(idx_row, (i + NUM_BUF) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
        nxt_r, nxt_mr = _load_idx(idx_row, (i + NUM_BUF) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
        if DS_SMEM:
            if (i + 1) * BLOCK_K > n_slots:  # the row's last, partial tile (its copy was zero-filled)
                ds_bufs.index(buf).store(_ds_tile(ds_ptr, ds_rows, mask_h, i * BLOCK_K, n_slots, BLOCK_K, LS))
                fence_async_shared()
                _cta_barrier()
            acc = warpgroup_mma(ds_bufs.index(buf), v_bufs.index(buf), acc, is_async=True)  # [HEADS, WV]
            if D_R > 0:
                acc_r = warpgroup_mma(ds_bufs.index(buf), r_bufs.index(buf), acc_r, is_async=True)  # [HEADS, WR]
        else:
            a = gl.convert_layout(ds_cur, a_layout)  # [HEADS, BLOCK_K]
            acc = warpgroup_mma(a, v_bufs.index(buf), acc, is_async=True)  # [HEADS, WV]
            if D_R > 0:
                acc_r = warpgroup_mma(gl.convert_layout(a, ar_layout), r_bufs.index(buf), acc_r, is_async=True)
            ds_cur = _ds_tile(ds_ptr, ds_rows, mask_h, (i + 1) * BLOCK_K, n_slots, BLOCK_K, LS)  # under the wgmma
        if D_R > 0:
            acc, acc_r = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_r))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    cp.wait_group(0)

    dq_row = dq_ptr + t * (H * D_QK)
    # Staged through the ring only where it holds the program's [HEADS, W] tile (not 128 heads on a 32 x 2 ring).
    STAGED: gl.constexpr = STAGED_STORE and NUM_BUF * BLOCK_K >= HEADS
    if STAGED:
        # Through the ring, now free: whole 16-byte row segments per thread instead of the accumulator's 4-byte
        # pairs, which write every 32-byte sector in two halves.
        _cta_barrier()  # every warp's last wgmma has read the ring
        _staged_store(dq_row, acc.to(dq_ptr.dtype.element_ty), v_bufs, hb * HEADS, v_off, H, D_QK, num_warps)
        if D_R > 0:
            _staged_store(dq_row, acc_r.to(dq_ptr.dtype.element_ty), r_bufs, hb * HEADS, r_off, H, D_QK, num_warps)
    else:
        oh = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, o_layout))
        oc = v_off + gl.arange(0, WV, layout=gl.SliceLayout(0, o_layout))
        gl.store(dq_row + oh[:, None] * D_QK + oc[None, :], acc.to(dq_ptr.dtype.element_ty), mask=(oh < H)[:, None])
        if D_R > 0:
            rh = hb * HEADS + gl.arange(0, HEADS, layout=gl.SliceLayout(1, r_layout))
            rc = r_off + gl.arange(0, WR, layout=gl.SliceLayout(0, r_layout))
            gl.store(dq_row + rh[:, None] * D_QK + rc[None, :], acc_r.to(dq_ptr.dtype.element_ty),
                     mask=(rh < H)[:, None])  # fmt: skip


@gluon.jit
def _staged_store(row_ptr, value, buf, h0, col0, H: gl.constexpr, D_QK: gl.constexpr, num_warps: gl.constexpr):
    """Store ``value`` ``[heads, W]`` (any layout) at heads ``h0 + [0, heads)``, columns ``col0 + [0, W)`` of a
    ``[H, D_QK]`` row through the shared buffer ``buf`` (at least ``heads * W`` elements, free): each thread then
    writes 16-byte pieces of whole row segments."""
    ROWS: gl.constexpr = value.type.shape[0]
    W: gl.constexpr = value.type.shape[1]
    L: gl.constexpr = _gather_layout(W, num_warps)  # 16-byte vectors of 16-bit elements, a warp along a row
    view = _alias(buf, value.dtype, ROWS, W, gl.SwizzledSharedLayout(8, 1, min(8, W // 8), order=[1, 0]))
    view.store(value)
    _cta_barrier()
    out = view.load(L)  # [ROWS, W]
    oh = h0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L))
    oc = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, L))
    gl.store(row_ptr + oh[:, None] * D_QK + oc[None, :], out, mask=(oh < H)[:, None])
