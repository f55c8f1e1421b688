"""Which items (query row, block of 64 heads) a program of the warp-specialized SM90 sparse MLA forward
(:mod:`longtrain.dsa.triton.sparse_mla_fwd_sm90_ws`) takes, and how its producer hands them to its consumers.

Items are query-major, head blocks fastest. ``RUN >= 1``: program ``pid`` takes the run of ``RUN`` items from
``pid * RUN``; ``RUN = 0``: the items ``pid, pid + G, ...`` for ``G`` programs; ``RUN = -1``: item ``pid``, then
while any is left ``G + atomic_add(counter, 1)``, taken by the producer and handed to both consumers through a ring
of two shared-memory slots (``item_ready`` / ``item_free``); an item past the last ends the program.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from longtrain.dsa.triton.sparse_mla_fwd_sm90 import _cta_barrier

_BLOCK_H = gl.constexpr(64)  # heads per item


@gluon.jit
def _item(idx_ptr, len_ptr, K_slots, item, H: gl.constexpr, HAS_LEN: gl.constexpr):
    """Work item ``item`` (query-major, head blocks fastest): its query row, head block, index row and slot count."""
    NUM_HB: gl.constexpr = (H + _BLOCK_H - 1) // _BLOCK_H
    t = (item // NUM_HB).to(gl.int64)
    hb = item % NUM_HB
    if HAS_LEN:
        n_slots = gl.minimum(gl.maximum(gl.load(len_ptr + t).to(gl.int32), 0), K_slots)  # scalar
    else:
        n_slots = K_slots
    return t, hb, idx_ptr + t * K_slots, n_slots


@gluon.jit
def _items(T_q, H: gl.constexpr, RUN: gl.constexpr):
    """This program's items as ``range(first, stop, step)``: with ``RUN == 0`` (persistent) every G-th item from
    ``pid`` for ``G`` programs, else the contiguous run ``pid * RUN ..`` of at most ``RUN`` items."""
    NUM_HB: gl.constexpr = (H + _BLOCK_H - 1) // _BLOCK_H
    num_items = T_q * NUM_HB
    if RUN == 0:
        first = gl.program_id(0)
        stop = num_items
        step = gl.num_programs(0)
    else:
        first = gl.program_id(0) * RUN
        stop = gl.minimum(first + RUN, num_items)
        step = 1
    return first, stop, step


@gluon.jit
def _send_item(it, k, item):
    """Hand the program's ``k``-th item to both consumers (a ring of two slots)."""
    cnt_ptr, items, item_ready, item_free = it
    j = k % 2
    mbarrier.wait(item_free.index(j), ((k // 2) & 1) ^ 1)
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    items.index(j).store(gl.zeros([1], gl.int32, layout=L) + item)
    _cta_barrier()  # every producer thread's store is done before the arrive
    mbarrier.arrive(item_ready.index(j))


@gluon.jit
def _recv_item(it, k):
    """A consumer's ``k``-th item, from the producer."""
    cnt_ptr, items, item_ready, item_free = it
    j = k % 2
    mbarrier.wait(item_ready.index(j), (k // 2) & 1)
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    item = gl.max(items.index(j).load(L), axis=0)
    _cta_barrier()  # every thread has read the slot before it is released
    mbarrier.arrive(item_free.index(j))
    return item


@gluon.jit
def _prefetch_queries(q_ptr, item, stop, H: gl.constexpr, D_QK: gl.constexpr):
    """``prefetch.global.L2`` of item ``item``'s query block (its heads are one contiguous run of rows), if it is one
    of this program's (``item < stop``)."""
    NUM_HB: gl.constexpr = (H + _BLOCK_H - 1) // _BLOCK_H
    HEADS: gl.constexpr = _BLOCK_H if H > _BLOCK_H else H
    LINES: gl.constexpr = (HEADS * D_QK * 2 + 127) // 128  # 128-byte lines (16-bit queries)
    L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if item < stop:
        t = (item // NUM_HB).to(gl.int64)
        hb = item % NUM_HB
        # The last block of a head count that is not a multiple of 64 has fewer rows: no line past them.
        last = (gl.minimum(H - hb * _BLOCK_H, _BLOCK_H) * (D_QK * 2) - 1) // 128
        base = (q_ptr + t * (H * D_QK) + hb * (_BLOCK_H * D_QK)).to(gl.pointer_type(gl.int8), bitcast=True)
        for c in gl.static_range(0, LINES, 128):
            line = gl.minimum(c + gl.arange(0, 128, layout=L), last)
            gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [base + line * 128],
                                      dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
