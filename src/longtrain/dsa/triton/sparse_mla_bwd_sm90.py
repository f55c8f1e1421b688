"""Sparse MLA backward probabilities kernel for Hopper (SM90) in Gluon: the forward's cp.async ring + wgmma.

Same contract as :func:`longtrain.dsa.triton.sparse_mla_bwd.sparse_mla_bwd_kernel_ds` (one program per (query row,
block of 64 heads); stores ``P = exp2(S * qk_scale - lse2)`` and ``dS = sm_scale * P * (dO V^T - delta)`` in the
input dtype, zeros on invalid slots), with the forward SM90 kernel's schedule
(:mod:`longtrain.dsa.triton.sparse_mla_fwd_sm90`):

* the queries ``[64, D_qk]`` stay in shared memory; ``dO [64, d_v]``, the A operand of ``dP = dO V^T``, in
  registers with ``BLOCK_K = 64`` slots per step (it is staged once through the first ring buffer, which is
  ``[64, d_v]`` too) or in shared memory with ``BLOCK_K = 32``;
* the row's gathered latent rows stream through a ring of ``NUM_BUF`` tiles of ``BLOCK_K`` rows (``cp.async``),
  the copy of tile ``i + NUM_BUF - 1`` issued at the top of step ``i`` so it runs under step ``i``'s matmuls;
* ``S = Q K^T`` (latent + rope) and ``dP`` run as wgmma with the two warpgroups splitting the keys.

Gluon kernels do not run in Triton's CPU interpreter; :func:`longtrain.dsa.triton.sparse_mla_bwd.sparse_mla_bwd`
uses this kernel where the forward SM90 kernel applies (see
:func:`longtrain.dsa.triton.sparse_mla_fwd_sm90.sm90_unsupported_reason`) and the ring fits in shared memory.
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
    _issue_tile,
    _load_idx,
)

__all__ = ["sm90_ds_smem_bytes", "sparse_mla_bwd_sm90_kernel_ds"]


def sm90_ds_smem_bytes(block_k: int, num_buf: int, d_qk: int, d_v: int, itemsize: int) -> int:
    """Shared memory of the kernel: the queries, the ring, and dO where it is not held in registers."""
    return (64 * d_qk + num_buf * block_k * d_qk + (0 if block_k == 64 else 64 * d_v)) * itemsize


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
    gl.static_assert(num_warps == 8, "two consumer warpgroups")
    # 64 slots per step: dO lives in registers (staged through ring buffer 0, [64, D_V] too); 32: in shared memory.
    DO_IN_REGS: gl.constexpr = BLOCK_K == BLOCK_H
    gl.static_assert((BLOCK_K == 64) or (BLOCK_K == 32), "BLOCK_K is 64 (dO in registers) or 32 (dO in smem)")

    # Register layouts: gathers, S / dP [heads, keys] with the warpgroups splitting the keys, dO as wgmma A operand.
    LV: gl.constexpr = _gather_layout(D_V, num_warps)
    LR: gl.constexpr = _gather_layout(D_R, num_warps)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_K // 2, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    # Shared memory: resident queries and the ring of gathered tiles.
    qv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_V], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_V], dtype)
    q_v = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], qv_sl)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, D_V], kv_sl)
    if D_R > 0:
        qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_R], dtype)
        kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_R], dtype)
        q_r = gl.allocate_shared_memory(dtype, [BLOCK_H, D_R], qr_sl)
        r_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, D_R], kr_sl)
    else:
        q_r = q_v
        r_bufs = v_bufs
    if DO_IN_REGS:
        do_s = v_bufs.index(0)
    else:
        do_s = gl.allocate_shared_memory(dtype, [BLOCK_H, D_V], qv_sl)

    pid = gl.program_id(0)
    t_local = (pid // NUM_HB).to(gl.int64)
    t = row_offset + t_local
    hb = pid % NUM_HB

    # Queries and dO (heads past H are zero-filled) in one copy group.
    q_row = q_ptr + t * (H * D_QK)
    hv = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LV))
    cv = gl.arange(0, D_V, layout=gl.SliceLayout(0, LV))
    _async_load(q_v, q_row + hv[:, None] * D_QK + cv[None, :], mask=(hv < H)[:, None])  # [BLOCK_H, D_V]
    do_row = dout_ptr + t * (H * D_V)
    _async_load(do_s, do_row + hv[:, None] * D_V + cv[None, :], mask=(hv < H)[:, None])  # [BLOCK_H, D_V]
    if D_R > 0:
        hr = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LR))
        cr = gl.arange(0, D_R, layout=gl.SliceLayout(0, LR))
        _async_load(q_r, q_row + D_V + hr[:, None] * D_QK + cr[None, :], mask=(hr < H)[:, None])  # [BLOCK_H, D_R]
    cp.commit_group()
    cp.wait_group(0)
    fence_async_shared()
    _cta_barrier()
    if DO_IN_REGS:
        do_op = do_s.load(a_layout)  # [BLOCK_H, D_V]
        # Every warp holds its dO before buffer 0 is refilled.
        _cta_barrier()
    else:
        do_op = do_s

    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
    mask_h = offs_h < H
    # Rows without keys have lse2 = +inf: every probability below is exactly 0.
    lse2 = gl.load(lse2_ptr + t * H + offs_h, mask=mask_h, other=float("inf"))  # [BLOCK_H]
    delta = gl.load(delta_ptr + t * H + offs_h, mask=mask_h, other=0.0)  # [BLOCK_H]
    scratch_rows = (t_local * H + offs_h.to(gl.int64)) * K_slots  # [BLOCK_H]

    if HAS_LEN:
        n_slots = gl.minimum(gl.maximum(gl.load(len_ptr + t).to(gl.int32), 0), K_slots)  # scalar
    else:
        n_slots = K_slots
    idx_row = idx_ptr + t * K_slots
    rl_v: gl.constexpr = gl.SliceLayout(1, LV)
    rl_r: gl.constexpr = gl.SliceLayout(1, LR)

    # Prologue: tiles 0 .. NUM_BUF-2 in flight, indices of tile NUM_BUF-1 in registers.
    for j in gl.static_range(NUM_BUF - 1):
        iv, mv = _load_idx(idx_row, j * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
        ir, mr = _load_idx(idx_row, j * BLOCK_K, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
        _issue_tile(kv_ptr, iv, mv, ir, mr, v_bufs.index(j), r_bufs.index(j), D_V, D_R, LV, LR)
    nxt_v, nxt_mv = _load_idx(idx_row, (NUM_BUF - 1) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
    nxt_r, nxt_mr = _load_idx(idx_row, (NUM_BUF - 1) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2

    s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)
    n_tiles = gl.cdiv(n_slots, BLOCK_K)
    for i in range(n_tiles):
        buf = i % NUM_BUF
        # Tile i has landed (this thread's copies, then everyone's); every warp has finished step i-1, so the
        # buffer it read is free for tile i + NUM_BUF - 1.
        cp.wait_group(NUM_BUF - 2)
        fence_async_shared()
        _cta_barrier()
        nb = (i + NUM_BUF - 1) % NUM_BUF
        _issue_tile(kv_ptr, nxt_v, nxt_mv, nxt_r, nxt_mr, v_bufs.index(nb), r_bufs.index(nb), D_V, D_R, LV, LR)
        k_next = (i + NUM_BUF) * BLOCK_K
        nxt_v, nxt_mv = _load_idx(idx_row, k_next, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
        nxt_r, nxt_mr = _load_idx(idx_row, k_next, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2

        v_t = v_bufs.index(buf).permute((1, 0))  # [D_V, BLOCK_K]
        s = warpgroup_mma(q_v, v_t, s_zero, use_acc=False, is_async=True)  # [BLOCK_H, BLOCK_K]
        if D_R > 0:
            s = warpgroup_mma(q_r, r_bufs.index(buf).permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(do_op, v_t, s_zero, use_acc=False, is_async=True)  # [BLOCK_H, BLOCK_K]
        offs_k = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=col_s)
        in_len = offs_k < n_slots
        _, valid = _load_idx(idx_row, i * BLOCK_K, n_slots, T_k, BLOCK_K, col_s)  # [BLOCK_K]
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))

        p = gl.where(valid[None, :], gl.exp2(s * qk_scale - lse2[:, None]), 0.0)  # [BLOCK_H, BLOCK_K]
        ds = p * (dp - delta[:, None]) * sm_scale  # [BLOCK_H, BLOCK_K]
        ptrs = scratch_rows[:, None] + offs_k[None, :]
        mask = mask_h[:, None] & in_len[None, :]
        gl.store(ds_ptr + ptrs, ds.to(ds_ptr.dtype.element_ty), mask=mask)
        if STORE_P:
            gl.store(p_ptr + ptrs, p.to(p_ptr.dtype.element_ty), mask=mask)
    cp.wait_group(0)
