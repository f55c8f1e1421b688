"""The persistent SM90 dq kernel (Gluon): ``dq = dS K`` for a chunk's (query row, block of 64 heads) items, one
program per SM, its cp.async ring running on from one item into the next.

:func:`longtrain.dsa.triton.sparse_mla_bwd_sm90.sparse_mla_bwd_sm90_kernel_dq` is one program per item: each fills
its ring before its first wgmma and stores its ``dq`` with nothing in flight. With short rows (``K = 512``: 8 tiles
of 64 slots per item) those two ends are a large part of an item. Here a program takes items ``pid, pid + G, ...``
(``G`` programs) as one stream of tiles: the copies of the next item's first tiles are in flight while the current
item's last wgmma runs and its ``dq`` is stored, and each item's first wgmma starts a fresh accumulator
(``use_acc=False``), so nothing of one item (a NaN of another document included) reaches the next. Every item has
at least one tile (a row without slots gives one all-invalid, zero-filled tile and stores zeros).

Same contract and numerics as the per-item kernel with ``HEADS = 64`` and ``dS`` in registers (the same wgmma
operands in the same order: ``dq`` equal bit for bit). Used where ``sparse_mla_bwd_plan.SM90_DQ_PERSISTENT`` says
so; its GPU test is ``tests/gpu/test_dsa_triton_gpu.py -k dq_persistent``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from longtrain.dsa.triton.sparse_mla_bwd_sm90 import _ds_tile, _row_slots
from longtrain.dsa.triton.sparse_mla_fwd_sm90 import (
    _cta_barrier,
    _gather_layout,
    _half_n_mma_layout,
    _issue_tile,
    _load_idx,
)

__all__ = ["sparse_mla_bwd_sm90_kernel_dq_persistent"]

_HEADS = gl.constexpr(64)


@gluon.jit
def _item_slots(len_ptr, item, n_items, row_offset, K_slots, NUM_HB: gl.constexpr, HAS_LEN: gl.constexpr):
    """Slots of an item's row (0 past the last item: its tiles are all invalid)."""
    t = row_offset + (gl.minimum(item, n_items - 1) // NUM_HB).to(gl.int64)
    return gl.where(item < n_items, _row_slots(len_ptr, t, K_slots, HAS_LEN), 0)  # scalar


@gluon.jit
def _next_tile(item, tile, n_slots, step, len_ptr, n_items, row_offset, K_slots, BLOCK_K: gl.constexpr,
               NUM_HB: gl.constexpr, HAS_LEN: gl.constexpr):  # fmt: skip
    """A cursor ``(item, tile, n_slots)`` moved to the next tile of the program's stream."""
    tile += 1
    done = tile >= gl.maximum(gl.cdiv(n_slots, BLOCK_K), 1)
    item = gl.where(done, item + step, item)
    tile = gl.where(done, 0, tile)
    n_slots = gl.where(done, _item_slots(len_ptr, item, n_items, row_offset, K_slots, NUM_HB, HAS_LEN), n_slots)
    return item, tile, n_slots


@gluon.jit(do_not_specialize=["row_offset", "T_k", "K_slots", "n_items"])
def sparse_mla_bwd_sm90_kernel_dq_persistent(
    kv_ptr, idx_ptr, len_ptr, ds_ptr, dq_ptr,
    row_offset, T_k, K_slots, n_items,
    H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_LEN: gl.constexpr,
    BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """``dq`` of items ``pid, pid + G, ...`` of the chunk (item = local row * head blocks + head block); ``n_items``
    items from row ``row_offset``. ``dS``: ``[rows, H, K_slots]`` of the chunk (zeros on invalid slots)."""
    D_QK: gl.constexpr = D_V + D_R
    NUM_HB: gl.constexpr = (H + _HEADS - 1) // _HEADS
    gl.static_assert(num_warps == 8, "two warpgroups")
    gl.static_assert(NUM_BUF >= 2, "a ring of at least two tiles")

    LV: gl.constexpr = _gather_layout(D_V, num_warps)
    LR: gl.constexpr = _gather_layout(max(D_R, 8), num_warps)
    LS: gl.constexpr = _gather_layout(BLOCK_K, num_warps)
    o_layout: gl.constexpr = _half_n_mma_layout(D_V)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rl_v: gl.constexpr = gl.SliceLayout(1, LV)
    rl_r: gl.constexpr = gl.SliceLayout(1, LR)

    dtype: gl.constexpr = kv_ptr.dtype.element_ty
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_V], dtype)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, D_V], kv_sl)
    if D_R > 0:
        kr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_R], dtype)
        r_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, D_R], kr_sl)
        r_layout: gl.constexpr = _half_n_mma_layout(D_R)
        ar_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=r_layout, k_width=2)
        acc_r = gl.zeros([_HEADS, D_R], gl.float32, layout=r_layout)
    else:
        r_bufs = v_bufs

    pid = gl.program_id(0)
    step = gl.num_programs(0)
    total = gl.to_tensor(0)  # tiles of this program's items
    for item in range(pid, n_items, step):
        total += gl.maximum(gl.cdiv(_item_slots(len_ptr, item, n_items, row_offset, K_slots, NUM_HB, HAS_LEN),
                                    BLOCK_K), 1)  # fmt: skip
    first = _item_slots(len_ptr, pid, n_items, row_offset, K_slots, NUM_HB, HAS_LEN)
    offs_h = gl.arange(0, _HEADS, layout=gl.SliceLayout(1, LS))

    # Three cursors over the stream: the tile consumed (c_*), the tile whose dS is loaded into registers one step
    # ahead (d_*) and the tile whose slot indices are loaded next (l_*, NUM_BUF steps ahead).
    l_item, l_tile, l_slots = pid, gl.to_tensor(0), first
    for j in gl.static_range(NUM_BUF - 1):
        idx_row = idx_ptr + (row_offset + (gl.minimum(l_item, n_items - 1) // NUM_HB).to(gl.int64)) * K_slots
        iv, mv = _load_idx(idx_row, l_tile * BLOCK_K, l_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
        ir, mr = _load_idx(idx_row, l_tile * BLOCK_K, l_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
        _issue_tile(kv_ptr, 0, D_V, iv, mv, ir, mr, v_bufs.index(j), r_bufs.index(j), D_QK, D_V, D_R, LV, LR)
        l_item, l_tile, l_slots = _next_tile(l_item, l_tile, l_slots, step, len_ptr, n_items, row_offset, K_slots,
                                             BLOCK_K, NUM_HB, HAS_LEN)  # fmt: skip
    idx_row = idx_ptr + (row_offset + (gl.minimum(l_item, n_items - 1) // NUM_HB).to(gl.int64)) * K_slots
    nxt_v, nxt_mv = _load_idx(idx_row, l_tile * BLOCK_K, l_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
    nxt_r, nxt_mr = _load_idx(idx_row, l_tile * BLOCK_K, l_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
    l_item, l_tile, l_slots = _next_tile(l_item, l_tile, l_slots, step, len_ptr, n_items, row_offset, K_slots,
                                         BLOCK_K, NUM_HB, HAS_LEN)  # fmt: skip

    d_item, d_tile, d_slots = pid, gl.to_tensor(0), first
    d_t = gl.minimum(d_item, n_items - 1) // NUM_HB
    d_h = (d_item % NUM_HB) * _HEADS + offs_h
    ds_cur = _ds_tile(ds_ptr, (d_t.to(gl.int64) * H + d_h) * K_slots, d_h < H, 0, d_slots, BLOCK_K, LS)
    d_item, d_tile, d_slots = _next_tile(d_item, d_tile, d_slots, step, len_ptr, n_items, row_offset, K_slots,
                                         BLOCK_K, NUM_HB, HAS_LEN)  # fmt: skip

    c_item, c_tile, c_slots = pid, gl.to_tensor(0), first
    acc = gl.zeros([_HEADS, D_V], gl.float32, layout=o_layout)
    for g in range(total):
        buf = g % NUM_BUF
        # Tile g has landed (this thread's copies, then everyone's: every warp has also finished step g-1, so the
        # buffer it read is free for tile g + NUM_BUF - 1).
        cp.wait_group(NUM_BUF - 2)
        fence_async_shared()
        _cta_barrier()
        nb = (g + NUM_BUF - 1) % NUM_BUF
        _issue_tile(kv_ptr, 0, D_V, nxt_v, nxt_mv, nxt_r, nxt_mr, v_bufs.index(nb), r_bufs.index(nb), D_QK, D_V, D_R,
                    LV, LR)  # fmt: skip
        idx_row = idx_ptr + (row_offset + (gl.minimum(l_item, n_items - 1) // NUM_HB).to(gl.int64)) * K_slots
        nxt_v, nxt_mv = _load_idx(idx_row, l_tile * BLOCK_K, l_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
        nxt_r, nxt_mr = _load_idx(idx_row, l_tile * BLOCK_K, l_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
        l_item, l_tile, l_slots = _next_tile(l_item, l_tile, l_slots, step, len_ptr, n_items, row_offset, K_slots,
                                             BLOCK_K, NUM_HB, HAS_LEN)  # fmt: skip

        keep = c_tile != 0  # an item's first tile starts a fresh accumulator
        a = gl.convert_layout(ds_cur, a_layout)  # [64, BLOCK_K]
        acc = warpgroup_mma(a, v_bufs.index(buf), acc, use_acc=keep, is_async=True)  # [64, D_V]
        if D_R > 0:
            acc_r = warpgroup_mma(gl.convert_layout(a, ar_layout), r_bufs.index(buf), acc_r, use_acc=keep,
                                  is_async=True)  # [64, D_R]  # fmt: skip
        d_t = gl.minimum(d_item, n_items - 1) // NUM_HB
        d_h = (d_item % NUM_HB) * _HEADS + offs_h
        ds_cur = _ds_tile(ds_ptr, (d_t.to(gl.int64) * H + d_h) * K_slots, d_h < H, d_tile * BLOCK_K, d_slots,
                          BLOCK_K, LS)  # [64, BLOCK_K] under the wgmma  # fmt: skip
        d_item, d_tile, d_slots = _next_tile(d_item, d_tile, d_slots, step, len_ptr, n_items, row_offset, K_slots,
                                             BLOCK_K, NUM_HB, HAS_LEN)  # fmt: skip
        if D_R > 0:
            acc, acc_r = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_r))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        if c_tile + 1 >= gl.maximum(gl.cdiv(c_slots, BLOCK_K), 1):  # the item's last tile: store its dq
            dq_row = dq_ptr + (row_offset + (c_item // NUM_HB).to(gl.int64)) * (H * D_QK)
            hb = c_item % NUM_HB
            oh = hb * _HEADS + gl.arange(0, _HEADS, layout=gl.SliceLayout(1, o_layout))
            oc = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
            gl.store(dq_row + oh[:, None] * D_QK + oc[None, :], acc.to(dq_ptr.dtype.element_ty),
                     mask=(oh < H)[:, None])  # fmt: skip
            if D_R > 0:
                rh = hb * _HEADS + gl.arange(0, _HEADS, layout=gl.SliceLayout(1, r_layout))
                rc = D_V + gl.arange(0, D_R, layout=gl.SliceLayout(0, r_layout))
                gl.store(dq_row + rh[:, None] * D_QK + rc[None, :], acc_r.to(dq_ptr.dtype.element_ty),
                         mask=(rh < H)[:, None])  # fmt: skip
        c_item, c_tile, c_slots = _next_tile(c_item, c_tile, c_slots, step, len_ptr, n_items, row_offset, K_slots,
                                             BLOCK_K, NUM_HB, HAS_LEN)  # fmt: skip
    cp.wait_group(0)
