"""Sparse MLA backward ``dq = dS K`` for Hopper (SM90) in Gluon, one program per run of ``RUN`` consecutive (query
row, block of 64 heads) items, the ring of gathered tiles flowing from one item into the next.

Same contract as :func:`longtrain.dsa.triton.sparse_mla_bwd_sm90.sparse_mla_bwd_sm90_kernel_dq` at its default (64
heads per program, a ring of two 64-row tiles, ``dS`` loaded one step ahead into registers), and the same steps in
the same order: per tile, wait for its copies and a CTA barrier, issue the next tile's copies, load the indices of the
tile after, one wgmma per part (latent, rope) with ``dS`` from registers, the next ``dS`` loaded under it, wait.
The difference is what "next" is: past an item's last tile it is the next item's first, so the next item's first
gather, its indices and its ``dS`` are in flight while this item's last tile computes and its dq is stored. The
lockstep kernel, one program per item, starts every item with an empty ring: at K = 512 (8 tiles a row) its fill
and drain cost about 5 tile-steps a row, its tensor pipe 24 % busy
(``benchmarks/results/logs/ncu_dsa_dq_T4096_H128_K512_3fe6a15_h100_details.txt``).

A row without slots is one tile of zero-filled rows and zero ``dS``: its dq is stored as zeros. Every dq element is
the same sum of the same wgmma steps as in the lockstep kernel: equal bit for bit
(``tests/gpu/test_dsa_triton_gpu.py -k dq_runs``).

Gluon kernels do not run in Triton's CPU interpreter; :func:`sparse_mla_bwd_plan.sm90_dq_runs_applies` says where
this kernel applies, and its sm_90a compilation is tested on CPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from longtrain.dsa.triton.sparse_mla_bwd_sm90 import _dq_acc_layout, _ds_tile, _row_slots
from longtrain.dsa.triton.sparse_mla_fwd_sm90 import _cta_barrier, _gather_layout, _issue_tile, _load_idx

__all__ = ["DQ_RUN_RING", "sparse_mla_bwd_sm90_dq_runs_kernel"]

_BLOCK_H = gl.constexpr(64)  # heads per item (one wgmma tile of M)
#: The ring: two tiles of 64 gathered rows (the lockstep kernel's default).
DQ_RUN_RING = (64, 2)


@gluon.jit
def _item_slots(item, last, len_ptr, row_offset, K_slots, HAS_LEN: gl.constexpr, NUM_HB: gl.constexpr):
    """Slots of ``item``'s row; 0 past the run's ``last`` item (its row is not read)."""
    t = row_offset + (gl.minimum(item, last - 1) // NUM_HB).to(gl.int64)
    return gl.where(item < last, _row_slots(len_ptr, t, K_slots, HAS_LEN), 0)  # scalar


@gluon.jit
def _next_tile(item, tile, n_tiles, last, len_ptr, row_offset, K_slots, HAS_LEN: gl.constexpr,
               NUM_HB: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
    """The step after tile ``tile`` of ``item`` (``n_tiles`` tiles): ``(item, tile, slots, tiles)``; an item has at
    least one tile (a row without slots: one of zeros)."""
    stay = tile + 1 < n_tiles
    item = gl.where(stay, item, item + 1)
    tile = gl.where(stay, tile + 1, 0)
    n_slots = _item_slots(item, last, len_ptr, row_offset, K_slots, HAS_LEN, NUM_HB)
    return item, tile, n_slots, gl.maximum(gl.cdiv(n_slots, BLOCK_K), 1)


@gluon.jit
def _item_rows(item, idx_ptr, row_offset, K_slots, H: gl.constexpr, NUM_HB: gl.constexpr, layout: gl.constexpr):
    """``item``'s row of slot indices, its ``dS`` rows ``[64]`` (of the chunk's scratch) and its heads' mask."""
    t_local = (item // NUM_HB).to(gl.int64)
    offs_h = (item % NUM_HB) * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, layout))
    return idx_ptr + (row_offset + t_local) * K_slots, (t_local * H + offs_h.to(gl.int64)) * K_slots, offs_h < H


@gluon.jit(do_not_specialize=["row_offset", "T_k", "K_slots", "n_items"])
def sparse_mla_bwd_sm90_dq_runs_kernel(
    kv_ptr, idx_ptr, len_ptr, ds_ptr, dq_ptr,
    row_offset, T_k, K_slots, n_items,
    H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_LEN: gl.constexpr, BLOCK_K: gl.constexpr,
    RUN: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Items ``pid * RUN + [0, RUN)`` below ``n_items`` (item ``i``: row ``row_offset + i // NUM_HB``, heads block
    ``i % NUM_HB``); ``kv [T_k, D_qk]``, ``idx [T, K] int32``, ``topk_length [T]``, ``dS [rows, H, K]`` of this row
    chunk, ``dq [T, H, D_qk]``."""
    D_QK: gl.constexpr = D_V + D_R
    NUM_HB: gl.constexpr = (H + _BLOCK_H - 1) // _BLOCK_H
    gl.static_assert(num_warps == 8, "two warpgroups")

    LV: gl.constexpr = _gather_layout(D_V, num_warps)
    LR: gl.constexpr = _gather_layout(max(D_R, 8), num_warps)
    LS: gl.constexpr = _gather_layout(BLOCK_K, num_warps)
    rl_v: gl.constexpr = gl.SliceLayout(1, LV)
    rl_r: gl.constexpr = gl.SliceLayout(1, LR)
    o_layout: gl.constexpr = _dq_acc_layout(_BLOCK_H, D_V)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = kv_ptr.dtype.element_ty
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_V], dtype)
    v_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_K, D_V], kv_sl)
    if D_R > 0:
        kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_R], dtype)
        r_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_K, D_R], kr_sl)
        r_layout: gl.constexpr = _dq_acc_layout(_BLOCK_H, D_R)
        ar_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=r_layout, k_width=2)
        acc_r = gl.zeros([_BLOCK_H, D_R], gl.float32, layout=r_layout)
    else:
        r_bufs = v_bufs
    acc = gl.zeros([_BLOCK_H, D_V], gl.float32, layout=o_layout)

    first = gl.program_id(0) * RUN
    last = gl.minimum(first + RUN, n_items)
    # Three cursors (item, tile, slots, tiles): the tile computed this step (c), the one whose copies are issued
    # this step (n: the next), the one whose indices are loaded this step (x: the one after).
    c_item = first
    c_tile = 0
    c_n = _item_slots(c_item, last, len_ptr, row_offset, K_slots, HAS_LEN, NUM_HB)
    c_nt = gl.maximum(gl.cdiv(c_n, BLOCK_K), 1)
    idx_row, ds_rows, mask_h = _item_rows(c_item, idx_ptr, row_offset, K_slots, H, NUM_HB, LS)
    iv, mv = _load_idx(idx_row, 0, c_n, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
    ir, mr = _load_idx(idx_row, 0, c_n, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
    _issue_tile(kv_ptr, 0, D_V, iv, mv, ir, mr, v_bufs.index(0), r_bufs.index(0), D_QK, D_V, D_R, LV, LR)
    ds_cur = _ds_tile(ds_ptr, ds_rows, mask_h, 0, c_n, BLOCK_K, LS)  # [64, BLOCK_K]
    n_item, n_tile, n_n, n_nt = _next_tile(c_item, c_tile, c_nt, last, len_ptr, row_offset, K_slots, HAS_LEN,
                                           NUM_HB, BLOCK_K)  # fmt: skip
    idx_row, ds_rows, mask_h = _item_rows(n_item, idx_ptr, row_offset, K_slots, H, NUM_HB, LS)
    iv, mv = _load_idx(idx_row, n_tile * BLOCK_K, n_n, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
    ir, mr = _load_idx(idx_row, n_tile * BLOCK_K, n_n, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
    step = 0
    while c_item < last:
        buf = step % 2
        # Tile c has landed (this thread's copies, then everyone's: every warp has also finished the previous step,
        # so the buffer it read is free for tile n).
        cp.wait_group(0)
        fence_async_shared()
        _cta_barrier()
        _issue_tile(kv_ptr, 0, D_V, iv, mv, ir, mr, v_bufs.index(1 - buf), r_bufs.index(1 - buf), D_QK, D_V, D_R, LV,
                    LR)  # fmt: skip
        x_item, x_tile, x_n, x_nt = _next_tile(n_item, n_tile, n_nt, last, len_ptr, row_offset, K_slots, HAS_LEN,
                                               NUM_HB, BLOCK_K)  # fmt: skip
        x_idx_row, _, _ = _item_rows(x_item, idx_ptr, row_offset, K_slots, H, NUM_HB, LS)
        iv, mv = _load_idx(x_idx_row, x_tile * BLOCK_K, x_n, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
        ir, mr = _load_idx(x_idx_row, x_tile * BLOCK_K, x_n, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
        a = gl.convert_layout(ds_cur, a_layout)  # [64, BLOCK_K]
        acc = warpgroup_mma(a, v_bufs.index(buf), acc, use_acc=c_tile > 0, is_async=True)  # [64, D_V]
        if D_R > 0:
            acc_r = warpgroup_mma(gl.convert_layout(a, ar_layout), r_bufs.index(buf), acc_r, use_acc=c_tile > 0,
                                  is_async=True)  # [64, D_R]  # fmt: skip
        _, ds_rows, mask_h = _item_rows(n_item, idx_ptr, row_offset, K_slots, H, NUM_HB, LS)
        ds_cur = _ds_tile(ds_ptr, ds_rows, mask_h, n_tile * BLOCK_K, n_n, BLOCK_K, LS)  # under the wgmma
        if D_R > 0:
            acc, acc_r = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_r))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        if c_tile + 1 == c_nt:  # the item's last tile: its dq
            t = row_offset + (c_item // NUM_HB).to(gl.int64)
            hb = c_item % NUM_HB
            dq_row = dq_ptr + t * (H * D_QK)
            oh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, o_layout))
            oc = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
            gl.store(dq_row + oh[:, None] * D_QK + oc[None, :], acc.to(dq_ptr.dtype.element_ty),
                     mask=(oh < H)[:, None])  # fmt: skip
            if D_R > 0:
                rh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, r_layout))
                rc = D_V + gl.arange(0, D_R, layout=gl.SliceLayout(0, r_layout))
                gl.store(dq_row + rh[:, None] * D_QK + rc[None, :], acc_r.to(dq_ptr.dtype.element_ty),
                         mask=(rh < H)[:, None])  # fmt: skip
        c_item, c_tile, c_n, c_nt = n_item, n_tile, n_n, n_nt
        n_item, n_tile, n_n, n_nt = x_item, x_tile, x_n, x_nt
        step += 1
    cp.wait_group(0)
