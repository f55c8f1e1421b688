"""Sparse MLA forward for Hopper (SM90) in Gluon, warp-specialized: a producer warpgroup gathers, one warpgroup owns
the logits, the softmax and the left half of the values, another the right half.

Same contract and math as :func:`longtrain.dsa.triton.sparse_mla_fwd.sparse_mla_fwd_kernel` (per item (query row,
block of 64 heads), fp32 online softmax in base 2, invalid slots masked, exact zeros for rows without keys). The
schedule is the one the best public Hopper kernels use for this op (1 producer + 2 consumer warpgroups, ``d_v`` split
between the consumers); the code is ours:

* the **producer** (4 warps, few registers) cp.asyncs the queries once and then the row's gathered latent rows into
  a ring of ``NUM_BUF`` tiles of ``BLOCK_K`` rows, each tile kept as two shared-memory blocks (values ``[BLOCK_K,
  D_V]``, rope tail ``[BLOCK_K, D_R]``); a tile's completion is signalled by ``cp.async.mbarrier.arrive`` (every
  producer thread arrives when its own copies have landed), and a buffer is refilled once both consumers have
  released it;
* the **softmax warpgroup** (the default partition) computes ``S = Q K^T`` for all ``BLOCK_K`` keys as two wgmma
  chains (values, rope tail: each chain boundary drains the tensor pipe, so the value halves are one block, not two),
  the online softmax, writes ``P`` (bf16/fp16) and the rescale factors to shared memory for the other consumer, then
  ``O_left += P V[:, :D_V/2]`` with ``P`` in registers (with 3 tiles deferred under the next tile's logits, with 4 or
  more tiles paired, see :func:`_softmax_left`);
* the **right warpgroup** rescales its accumulator and computes ``O_right += P V[:, D_V/2:]`` (a column slice of the
  value block) from the shared ``P``, so it runs under the softmax warpgroup's next logits.

A launch has one program per run of ``WS_RUN`` (4) consecutive items (query row, block of 64 heads) by default (1:
one program per item), or (``WS_SCHEDULE``) one per SM taking the items ``pid, pid + G, ...`` (persistent) or taking
items from a counter as it is ready for them (dynamic: the producer takes each next item and hands it to the consumers
through a ring of two shared-memory slots, ``item_ready`` / ``item_free``); it is the same code, one loop trip per
item. The ring and the ``P`` handovers run on across a program's items, and the producer loads an item's queries as
soon as the softmax warpgroup has computed the previous item's last logits (``q_ready`` / ``q_free``), so that a
program loads its next item's queries and first tiles under the current item's last softmax, ``P V`` and output
store.

Barriers: ``ready[b]`` (the producer's 128 threads), ``free[b]`` (one arrive per consumer), ``p_ready[j]`` /
``p_free[j]`` (the shared ``P`` and its factors, one buffer, or two with a ring of three or more tiles, so that the
softmax warpgroup can hand over tile i+1 before the right warpgroup has finished tile i; after an item's tiles
``p_ready`` once more hands over ``1 / denominator``; ring positions and handover indices count on across items),
``q_ready`` (the producer's 128 threads: the item's queries landed) / ``q_free`` (the softmax warpgroup: its last
logits of the item have completed).
Shared memory at the GLM shape (64 heads, D_qk 576, 2 tiles of 64 rows): 72 + 144 + 8 KiB.

Gluon kernels do not run in Triton's CPU interpreter; ``sparse_mla_fwd`` uses this kernel only where
:func:`ws_unsupported_reason` returns ``None``.
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

from longtrain.dsa.triton._common import sm_count
from longtrain.dsa.triton.sparse_mla_fwd_sm90 import (
    _async_load,
    _cta_barrier,
    _gather_layout,
    _load_idx,
    sm90_unsupported_reason,
)
from longtrain.dsa.triton.sparse_mla_fwd_sm90_items import (
    _BLOCK_H,
    _item,
    _items,
    _prefetch_queries,
    _recv_item,
    _send_item,
)

__all__ = [
    "WS_MAXNREG",
    "WS_NUM_REGS",
    "WS_PREFETCH_IDX",
    "WS_PREFETCH_Q",
    "WS_STAGED_OUT",
    "WS_RUN",
    "WS_SCHEDULE",
    "WS_SCHEDULES",
    "sparse_mla_fwd_sm90_ws_kernel",
    "ws_schedule",
    "ws_smem_bytes",
    "ws_unsupported_reason",
]

_HEADS = _BLOCK_H.value  # heads per item (one wgmma tile of M)
# setmaxnreg budgets of the worker partitions (the right half, the producer); the softmax warpgroup gets the rest
# of the 168 x 3 per thread that one 384-thread program may hold on an SM (64K registers): 248. With the producer at
# 96, ptxas keeps one 64-bit value of the persistent producer on the stack (reloaded once per item); 112 registers
# avoid it but leave the softmax warpgroup 232, and that ran slower on an H100 (benchmarks/results/
# dsa_fwd_persistent_regs_160_112_b25c3c0_h100_2026-12-06.md against ..._regs_160_96_...).
WS_NUM_REGS = (160, 96)
WS_MAXNREG = 168
# Whether the producer loads a tile's slot indices one tile ahead, before it waits for the tile's buffer (True), or
# after (False). ncu showed the producer stalled on that load after every free while the consumers waited for tiles;
# one tile ahead was 1-3 % faster in every pair of an alternating H100 run (T = 16384, H = 64: 9.40 / 9.49 ms against
# 9.56 / 9.81; benchmarks/results/dsa_ws_prefetch_0a9b2ae_h100_2026-12-06.md). Read at each launch.
WS_PREFETCH_IDX = True
# How a launch's programs take their items (query row, head block): "runs", one program per run of WS_RUN consecutive
# items; "persistent", one program per SM taking the items pid, pid + G, ...; "dynamic", one program per SM taking
# item pid and then each next item from a counter the launch zeroes. A program hides the boundaries between its items
# (the next item's queries and first tiles load under the current item's end). Persistent programs deal the items
# statically, so one whose SM is held by another stream's kernel (e.g. NCCL's, under FSDP) runs its whole share late;
# runs and dynamic programs do not. Runs of 4 are the default: on H100s as fast as the others alone and as safe as
# dynamic programs beside a busy kernel, without a counter to zero (benchmarks/results/dsa_fwd_persistent_41fe22c_
# h100_..., ..._0c281ac_..., dsa_fwd_dynamic_3a713d5_h100_2026-12-06.md); on the H200 the fastest at H = 64, with
# persistent programs 1-3 % faster at H = 128 (dsa_fwd_schedules_6cb8ebc_h200_2026-12-06.md; README). Both read at
# each launch.
WS_SCHEDULE = "runs"
WS_SCHEDULES = ("runs", "persistent", "dynamic")
WS_RUN = 4
# Whether the producer prefetches its program's next item's queries into L2 (prefetch.global.L2) four tiles before
# the item ends, so that their load after the last logits hits L2. Off: within these H100s' noise. At T = 16384,
# H = 128 one alternating run gave 20th percentiles of 18.05-18.09 ms against 18.16-18.52 without it
# (benchmarks/results/dsa_fwd_persistent_157f7b1_h100_2026-12-06.md), another 17.81-18.76 against 17.72-17.78
# (dsa_fwd_persistent_7f6816f_h100_2026-12-06.md); the same at H = 64 and at T = 4096, K = 512. Read at each launch.
WS_PREFETCH_Q = False
# Whether each consumer warpgroup stores its half of an item's output through its half of the item's last ring tile
# (released to the producer only after that), as whole 16-byte row segments per thread, instead of straight from the
# wgmma accumulator (4-byte pairs: every 32-byte sector written in two halves); rings of 64-row tiles only. True: on
# an H100, alternating, runs of 4 took 8.69 / 8.86 ms against 8.95 / 9.16 at T = 16384, H = 64, K = 2048 and 1.38 /
# 1.36 against 1.46 / 1.51 at T = 4096, H = 128, K = 512; at H = 128, K = 2048 within that run's noise (20th
# percentiles 17.79 / 17.97 against 18.03 / 18.09); output and lse equal bit for bit
# (benchmarks/results/dsa_fwd_staged_out_ec1ac9c_h100_2026-12-06.md, python benchmarks/dsa_fwd_persistent.py
# --staged-out; tests/gpu/test_dsa_triton_gpu.py -k staged_out). Read at each launch.
WS_STAGED_OUT = True


@gluon.constexpr_function
def _mma_layout(n):
    """wgmma accumulator layout of ``[64, n]`` for one warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _gather(dst, base, rows, valid, col0, WIDTH: gl.constexpr, L: gl.constexpr):
    """cp.async ``base[rows, col0:col0+WIDTH]`` into ``dst`` (rows: element offsets; invalid rows zero-filled)."""
    offs = col0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, L))
    _async_load(dst, base + rows[:, None] + offs[None, :], mask=valid[:, None])  # [rows, WIDTH]


@gluon.jit
def _producer(sc, sm, it, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_LEN: gl.constexpr,
              HAS_SINK: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, RUN: gl.constexpr,
              PREFETCH_IDX: gl.constexpr, PREFETCH_Q: gl.constexpr):  # fmt: skip
    """Worker partition: per item, the queries (once the softmax warpgroup has read the previous item's for the last
    time), then every tile of the row into the ring, which runs on across items. With ``RUN == -1`` it also takes
    the program's items, its first ``pid``, each next one from the launch's counter, and hands each to the
    consumers (an item past the last ends them)."""
    T_q = sc[7]
    g = 0  # tiles of this program's earlier items: the ring position of the item's first tile
    if RUN == -1:
        NUM_HB: gl.constexpr = (H + _BLOCK_H - 1) // _BLOCK_H
        num_items = T_q * NUM_HB
        item = gl.program_id(0)
        k = 0
        while item < num_items:
            _send_item(it, k, item)
            # The next item now, so the atomic's latency runs under this item's tiles.
            nxt = gl.num_programs(0) + gl.atomic_add(it[0], 1, sem="relaxed")
            g = _produce_item(sc, sm, item, nxt, num_items, k, g, H, D_V, D_R, HAS_LEN, BLOCK_K, NUM_BUF,
                              PREFETCH_IDX, PREFETCH_Q)  # fmt: skip
            item = nxt
            k += 1
        _send_item(it, k, item)
    else:
        first, stop, step = _items(T_q, H, RUN)
        for item in range(first, stop, step):
            k = (item - first) // step  # this program's earlier items: the query barriers' phase
            g = _produce_item(sc, sm, item, item + step, stop, k, g, H, D_V, D_R, HAS_LEN, BLOCK_K, NUM_BUF,
                              PREFETCH_IDX, PREFETCH_Q)  # fmt: skip


@gluon.jit
def _produce_item(sc, sm, item, next_item, stop, k, g, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
                  HAS_LEN: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, PREFETCH_IDX: gl.constexpr,
                  PREFETCH_Q: gl.constexpr):  # fmt: skip
    """The producer's part of item ``item``, the program's ``k``-th, whose first tile goes to ring position ``g``:
    its queries, then its tiles. With ``PREFETCH_Q`` the program's next item ``next_item`` (if below ``stop``) has its
    queries prefetched into L2 four tiles before the end. Returns the ring position after the item."""
    q_ptr, kv_ptr, idx_ptr, len_ptr, out_ptr, lse_ptr, sink_ptr, T_q, K_slots, T_k, qk_scale = sc
    q_v, q_t, kv_bufs, kt_bufs, p_smem, a_smem, ready, free, p_ready, p_free, q_ready, q_free = sm
    D_QK: gl.constexpr = D_V + D_R
    LV: gl.constexpr = _gather_layout(D_V, 4)
    LT: gl.constexpr = _gather_layout(max(D_R, 16), 4)
    rl_v: gl.constexpr = gl.SliceLayout(1, LV)
    rl_t: gl.constexpr = gl.SliceLayout(1, LT)

    t, hb, idx_row, n_slots = _item(idx_ptr, len_ptr, K_slots, item, H, HAS_LEN)
    mbarrier.wait(q_free, (k & 1) ^ 1)
    q_row = q_ptr + t * (H * D_QK)
    hh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=rl_v)
    _gather(q_v, q_row, hh * D_QK, hh < H, 0, D_V, LV)  # [64, D_V]
    if D_R > 0:
        ht = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=rl_t)
        _gather(q_t, q_row, ht * D_QK, ht < H, D_V, D_R, LT)  # [64, D_R]
    cp.mbarrier_arrive(q_ready, increment_count=False)
    # A tile's slot indices, -1 past the row's slots (validity below, after the wait, from the indices alone).
    if PREFETCH_IDX:  # loaded one tile ahead, before the wait for the buffer: tile 0's here
        idx, _ = _load_idx(idx_row, 0, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K]
        if D_R > 0:
            idx_t, _ = _load_idx(idx_row, 0, n_slots, T_k, BLOCK_K, rl_t)  # [BLOCK_K]
    n_tiles = gl.cdiv(n_slots, BLOCK_K)
    for i in range(n_tiles):
        r = g + i
        b = r % NUM_BUF
        if PREFETCH_Q:  # noqa: SIM102 (a constexpr guard around a runtime test)
            if i == gl.maximum(n_tiles - 4, 0):  # the next item's queries into L2, four tiles before they load
                _prefetch_queries(q_ptr, next_item, stop, H, D_QK)
        if PREFETCH_IDX:
            # Tile i+1's indices now: their load runs under the wait below and tile i's copies, so the copies
            # of tile i+1 start as soon as its buffer is free instead of a global load's latency later.
            nxt, _ = _load_idx(idx_row, (i + 1) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K]
            if D_R > 0:
                nxt_t, _ = _load_idx(idx_row, (i + 1) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_t)  # [BLOCK_K]
        mbarrier.wait(free.index(b), ((r // NUM_BUF) & 1) ^ 1)
        if not PREFETCH_IDX:  # loaded once the buffer is free
            idx, _ = _load_idx(idx_row, i * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K]
            if D_R > 0:
                idx_t, _ = _load_idx(idx_row, i * BLOCK_K, n_slots, T_k, BLOCK_K, rl_t)  # [BLOCK_K]
        valid = (idx >= 0) & (idx < T_k)
        _gather(kv_bufs.index(b), kv_ptr, gl.where(valid, idx, 0).to(gl.int64) * D_QK, valid, 0, D_V, LV)
        if D_R > 0:
            valid_t = (idx_t >= 0) & (idx_t < T_k)
            rows_t = gl.where(valid_t, idx_t, 0).to(gl.int64) * D_QK
            _gather(kt_bufs.index(b), kv_ptr, rows_t, valid_t, D_V, D_R, LT)
        cp.mbarrier_arrive(ready.index(b), increment_count=False)
        if PREFETCH_IDX:
            idx = nxt
            if D_R > 0:
                idx_t = nxt_t
    return g + n_tiles


@gluon.jit
def _right_half(sc, sm, it, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_LEN: gl.constexpr,
                HAS_SINK: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, RUN: gl.constexpr,
                STAGED_OUT: gl.constexpr):  # fmt: skip
    """Worker partition: ``O[:, D_V/2:] = sum_i P_i V_i[:, D_V/2:]`` from the shared ``P`` and factors, per item."""
    T_q = sc[7]
    g = 0  # ring position of the item's first tile
    pc = 0  # handovers of P (and, per item, of 1 / denominator) before this item's first
    if RUN == -1:
        NUM_HB: gl.constexpr = (H + _BLOCK_H - 1) // _BLOCK_H
        k = 0
        item = _recv_item(it, k)
        while item < T_q * NUM_HB:
            g, pc = _right_item(sc, sm, item, g, pc, H, D_V, HAS_LEN, BLOCK_K, NUM_BUF, STAGED_OUT)
            k += 1
            item = _recv_item(it, k)
    else:
        first, stop, step = _items(T_q, H, RUN)
        for item in range(first, stop, step):
            g, pc = _right_item(sc, sm, item, g, pc, H, D_V, HAS_LEN, BLOCK_K, NUM_BUF, STAGED_OUT)


@gluon.jit
def _right_item(sc, sm, item, g, pc, H: gl.constexpr, D_V: gl.constexpr, HAS_LEN: gl.constexpr,
                BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, STAGED_OUT: gl.constexpr):  # fmt: skip
    """The right warpgroup's part of item ``item`` (first tile at ring position ``g``, first handover ``pc``);
    returns the ring position and handover index after it."""
    q_ptr, kv_ptr, idx_ptr, len_ptr, out_ptr, lse_ptr, sink_ptr, T_q, K_slots, T_k, qk_scale = sc
    q_v, q_t, kv_bufs, kt_bufs, p_smem, a_smem, ready, free, p_ready, p_free, q_ready, q_free = sm
    DH: gl.constexpr = D_V // 2
    NUM_P: gl.constexpr = p_smem.type.shape[0]
    o_layout: gl.constexpr = _mma_layout(DH)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    t, hb, idx_row, n_slots = _item(idx_ptr, len_ptr, K_slots, item, H, HAS_LEN)
    acc = gl.zeros([_BLOCK_H, DH], gl.float32, layout=o_layout)
    n_tiles = gl.cdiv(n_slots, BLOCK_K)
    for i in range(n_tiles):
        b = (g + i) % NUM_BUF
        j = (pc + i) % NUM_P
        mbarrier.wait(p_ready.index(j), ((pc + i) // NUM_P) & 1)
        alpha = a_smem.index(j).load(row_o)  # [64]
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_smem.index(j), kv_bufs.index(b).slice(DH, DH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(p_free.index(j))
        if not STAGED_OUT or i < n_tiles - 1:  # staged: the last tile holds the output on its way out
            mbarrier.arrive(free.index(b))
    e = pc + n_tiles
    mbarrier.wait(p_ready.index(e % NUM_P), (e // NUM_P) & 1)
    inv = a_smem.index(e % NUM_P).load(row_o)  # [64]: 1 / denominator, 0 for rows without keys
    mbarrier.arrive(p_free.index(e % NUM_P))
    out = (acc * inv[:, None]).to(out_ptr.dtype.element_ty)
    _out_half(out_ptr, out, kv_bufs, free, g, n_tiles, t, hb, DH, H, D_V, NUM_BUF, STAGED_OUT)
    return g + n_tiles, e + 1


@gluon.jit
def _out_half(out_ptr, out, kv_bufs, free, g, n_tiles, t, hb, col0, H: gl.constexpr, D_V: gl.constexpr,
              NUM_BUF: gl.constexpr, STAGED_OUT: gl.constexpr):  # fmt: skip
    """Store a warpgroup's half ``out [64, D_V/2]`` of an item's output at columns ``col0 + [0, D_V/2)``: staged,
    through the same columns of the item's last tile (then released to the producer), as whole 16-byte row segments
    per thread; else (or for an item without tiles) straight from the accumulator's layout."""
    DH: gl.constexpr = out.type.shape[1]
    staged = n_tiles > 0
    if STAGED_OUT:  # noqa: SIM102 (a compile-time condition around a run-time one)
        if staged:
            b_last = (g + n_tiles - 1) % NUM_BUF
            half = kv_bufs.index(b_last).slice(col0, DH, dim=1)  # [64, DH]: this warpgroup's columns of V
            half.store(out)
            _cta_barrier()  # the whole half is in shared memory
            L: gl.constexpr = _gather_layout(DH, 4)  # 16-byte vectors, a warp along a row
            seg = half.load(L)  # [64, DH]
            _cta_barrier()  # every warp has read it: the tile goes back to the producer
            mbarrier.arrive(free.index(b_last))
            oh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, L))
            oc = col0 + gl.arange(0, DH, layout=gl.SliceLayout(0, L))
            gl.store(out_ptr + t * (H * D_V) + oh[:, None] * D_V + oc[None, :], seg, mask=(oh < H)[:, None])
    if not STAGED_OUT or not staged:
        o_layout: gl.constexpr = out.type.layout
        oh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        oc = col0 + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
        gl.store(out_ptr + t * (H * D_V) + oh[:, None] * D_V + oc[None, :], out, mask=(oh < H)[:, None])


@gluon.jit
def _logits(sm, b, s_zero, D_R: gl.constexpr):
    """Issue ``S = Q K_b^T`` (async): one wgmma chain per part (values, rope tail)."""
    q_v, q_t, kv_bufs, kt_bufs, p_smem, a_smem, ready, free, p_ready, p_free, q_ready, q_free = sm
    s = warpgroup_mma(q_v, kv_bufs.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if D_R > 0:
        s = warpgroup_mma(q_t, kt_bufs.index(b).permute((1, 0)), s, is_async=True)  # [64, BLOCK_K]
    return s


@gluon.jit
def _softmax_step(sm, s, valid, m_i, l_i, qk_scale, i):
    """Online softmax of a tile's logits; hands ``P`` and the rescale factors to the right warpgroup as the
    program's ``i``-th handover.

    Returns the new row max and sum, ``P`` in fp32 (the logits' layout) and the factors."""
    q_v, q_t, kv_bufs, kt_bufs, p_smem, a_smem, ready, free, p_ready, p_free, q_ready, q_free = sm
    s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # A row that has seen no valid slot yet keeps m = -inf; shifting by 0 gives p = alpha = 0, not NaN.
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p32 = gl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p32, 1)
    # The right warpgroup has finished with the previous P and factors (its wgmma has completed).
    NUM_P: gl.constexpr = p_smem.type.shape[0]
    j = i % NUM_P
    mbarrier.wait(p_free.index(j), ((i // NUM_P) & 1) ^ 1)
    p_smem.index(j).store(p32.to(p_smem.dtype))
    a_smem.index(j).store(alpha)
    fence_async_shared()
    mbarrier.arrive(p_ready.index(j))
    return m_new, l_i, p32, alpha


@gluon.jit
def _deferred_step(sm, idx_row, n_slots, T_k, qk_scale, i, g, pc, p, acc, m_i, l_i, s_zero, D_R: gl.constexpr,
                   BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, p_layout: gl.constexpr, col_s: gl.constexpr,
                   row_o: gl.constexpr):  # fmt: skip
    """Tile i's logits and tile i-1's ``P V`` issued together; tile i's softmax while the ``P V`` runs (``g``, ``pc``:
    the ring position and handover index of the item's first tile)."""
    q_v, q_t, kv_bufs, kt_bufs, p_smem, a_smem, ready, free, p_ready, p_free, q_ready, q_free = sm
    DH: gl.constexpr = kv_bufs.type.shape[2] // 2
    b = (g + i) % NUM_BUF
    bp = (g + i - 1) % NUM_BUF
    # Every input register of the wgmmas issued together is defined before the first of them, and none is written
    # while they run (else ptxas serializes them, C7513): P is carried in fp32 and rounded here, so the softmax
    # below, which runs while this wgmma reads P, writes other registers.
    p_op = gl.convert_layout(p.to(p_smem.dtype), p_layout)
    mbarrier.wait(ready.index(b), ((g + i) // NUM_BUF) & 1)
    fence_async_shared()
    s = _logits(sm, b, s_zero, D_R)
    acc = warpgroup_mma(p_op, kv_bufs.index(bp).slice(0, DH, dim=1), acc, is_async=True)  # [64, DH]: tile i-1
    _, valid = _load_idx(idx_row, i * BLOCK_K, n_slots, T_k, BLOCK_K, col_s)  # [BLOCK_K]
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    m_i, l_i, p, alpha = _softmax_step(sm, s, valid, m_i, l_i, qk_scale, pc + i)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(free.index(bp))
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    return acc, m_i, l_i, p


@gluon.jit
def _pair_step(sm, idx_row, n_slots, T_k, qk_scale, a, g, pc, p, acc, m_i, l_i, s_zero, D_R: gl.constexpr,
               BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, p_layout: gl.constexpr, col_s: gl.constexpr,
               row_o: gl.constexpr):  # fmt: skip
    """Tiles a and a+1 (a ring of four or more tiles: a-1, a and a+1 are in use at once).

    Tile a's logits with tile a-1's ``P V``; then tile a+1's logits, issued before tile a's softmax, which runs under
    them; then tile a's ``P V``, under tile a+1's softmax. Nothing is in flight across the loop's back edge (``g``,
    ``pc``: the ring position and handover index of the item's first tile)."""
    q_v, q_t, kv_bufs, kt_bufs, p_smem, a_smem, ready, free, p_ready, p_free, q_ready, q_free = sm
    DH: gl.constexpr = kv_bufs.type.shape[2] // 2
    ba = (g + a) % NUM_BUF
    bb = (g + a + 1) % NUM_BUF
    bp = (g + a - 1) % NUM_BUF
    p_op = gl.convert_layout(p.to(p_smem.dtype), p_layout)
    mbarrier.wait(ready.index(ba), ((g + a) // NUM_BUF) & 1)
    fence_async_shared()
    s_a = _logits(sm, ba, s_zero, D_R)
    acc = warpgroup_mma(p_op, kv_bufs.index(bp).slice(0, DH, dim=1), acc, is_async=True)  # [64, DH]: tile a-1
    _, valid_a = _load_idx(idx_row, a * BLOCK_K, n_slots, T_k, BLOCK_K, col_s)  # [BLOCK_K]
    s_a = warpgroup_mma_wait(num_outstanding=1, deps=(s_a,))
    mbarrier.wait(ready.index(bb), ((g + a + 1) // NUM_BUF) & 1)
    fence_async_shared()
    s_b = _logits(sm, bb, s_zero, D_R)
    _, valid_b = _load_idx(idx_row, (a + 1) * BLOCK_K, n_slots, T_k, BLOCK_K, col_s)  # [BLOCK_K]
    m_i, l_i, p_a, alpha_a = _softmax_step(sm, s_a, valid_a, m_i, l_i, qk_scale, pc + a)
    s_b, acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_b, acc))
    mbarrier.arrive(free.index(bp))
    acc = acc * gl.convert_layout(alpha_a, row_o)[:, None]
    p_op = gl.convert_layout(p_a.to(p_smem.dtype), p_layout)
    acc = warpgroup_mma(p_op, kv_bufs.index(ba).slice(0, DH, dim=1), acc, is_async=True)  # [64, DH]: tile a
    m_i, l_i, p_b, alpha_b = _softmax_step(sm, s_b, valid_b, m_i, l_i, qk_scale, pc + a + 1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(free.index(ba))
    acc = acc * gl.convert_layout(alpha_b, row_o)[:, None]
    return acc, m_i, l_i, p_b


@gluon.jit
def _finish(sc, sm, t, hb, m_i, l_i, e, H: gl.constexpr, HAS_SINK: gl.constexpr, row_s: gl.constexpr):
    """Store the LSE and hand ``1 / denominator`` (0 for rows without keys) to the right warpgroup as the program's
    ``e``-th handover."""
    q_ptr, kv_ptr, idx_ptr, len_ptr, out_ptr, lse_ptr, sink_ptr, T_q, K_slots, T_k, qk_scale = sc
    q_v, q_t, kv_bufs, kt_bufs, p_smem, a_smem, ready, free, p_ready, p_free, q_ready, q_free = sm
    offs_h = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=row_s)
    mask_h = offs_h < H
    has_keys = l_i > 0.0
    denom = l_i
    if HAS_SINK:
        # The sink is one more logit with a zero value: it only enlarges the denominator.
        sink = gl.load(sink_ptr + offs_h, mask=mask_h, other=float("-inf")) * 1.4426950408889634  # [64]
        denom = l_i + gl.exp2(sink - gl.where(m_i == float("-inf"), 0.0, m_i))
    inv = gl.where(has_keys, 1.0 / gl.where(has_keys, denom, 1.0), 0.0)
    lse = gl.where(has_keys, (m_i + gl.log2(gl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    gl.store(lse_ptr + t * H + offs_h, lse, mask=mask_h)
    NUM_P: gl.constexpr = p_smem.type.shape[0]
    mbarrier.wait(p_free.index(e % NUM_P), ((e // NUM_P) & 1) ^ 1)
    a_smem.index(e % NUM_P).store(inv)
    mbarrier.arrive(p_ready.index(e % NUM_P))
    return inv


@gluon.jit
def _softmax_left(sc, sm, it, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_LEN: gl.constexpr,
                  HAS_SINK: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr,
                  RUN: gl.constexpr, STAGED_OUT: gl.constexpr):  # fmt: skip
    """Default partition: logits, online softmax, the shared ``P``, ``O[:, :D_V/2]`` and the LSE, per item.

    With two tiles in the ring, tile i's ``P V`` runs right after its softmax, and the queries are released to the
    producer (for the next item) as soon as the last tile's logits have completed. With three or more, it is
    deferred: tile i+1's logits and tile i's ``P V`` are issued together, so the softmax of tile i+1 runs while the
    tensor cores do tile i's ``P V`` (and the right warpgroup its half); two tiles are then in use while the producer
    fills the others. With four or more, tiles go in pairs (:func:`_pair_step`), a remainder tile deferred."""
    T_q = sc[7]
    g = 0  # ring position of the item's first tile
    pc = 0  # handovers to the right warpgroup before this item's first
    if RUN == -1:
        NUM_HB: gl.constexpr = (H + _BLOCK_H - 1) // _BLOCK_H
        k = 0
        item = _recv_item(it, k)
        while item < T_q * NUM_HB:
            g, pc = _softmax_item(sc, sm, item, k, g, pc, H, D_V, D_R, HAS_LEN, HAS_SINK, BLOCK_K, NUM_BUF, STAGED_OUT)
            k += 1
            item = _recv_item(it, k)
    else:
        first, stop, step = _items(T_q, H, RUN)
        for item in range(first, stop, step):
            k = (item - first) // step  # this program's earlier items: the query barriers' phase
            g, pc = _softmax_item(sc, sm, item, k, g, pc, H, D_V, D_R, HAS_LEN, HAS_SINK, BLOCK_K, NUM_BUF, STAGED_OUT)


@gluon.jit
def _softmax_item(sc, sm, item, k, g, pc, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
                  HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_K: gl.constexpr,
                  NUM_BUF: gl.constexpr, STAGED_OUT: gl.constexpr):  # fmt: skip
    """The softmax warpgroup's part of item ``item``, the program's ``k``-th (first tile at ring position ``g``,
    first handover ``pc``); returns the ring position and handover index after it."""
    q_ptr, kv_ptr, idx_ptr, len_ptr, out_ptr, lse_ptr, sink_ptr, T_q, K_slots, T_k, qk_scale = sc
    q_v, q_t, kv_bufs, kt_bufs, p_smem, a_smem, ready, free, p_ready, p_free, q_ready, q_free = sm
    DH: gl.constexpr = D_V // 2
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    s_layout: gl.constexpr = _mma_layout(BLOCK_K)
    o_layout: gl.constexpr = _mma_layout(DH)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_zero = gl.zeros([_BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)

    t, hb, idx_row, n_slots = _item(idx_ptr, len_ptr, K_slots, item, H, HAS_LEN)
    m_i = gl.full([_BLOCK_H], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([_BLOCK_H], gl.float32, layout=row_s)
    acc = gl.zeros([_BLOCK_H, DH], gl.float32, layout=o_layout)
    mbarrier.wait(q_ready, k & 1)
    n_tiles = gl.cdiv(n_slots, BLOCK_K)
    if NUM_BUF >= 3:
        if n_tiles > 0:
            b0 = g % NUM_BUF
            mbarrier.wait(ready.index(b0), (g // NUM_BUF) & 1)
            fence_async_shared()
            s = _logits(sm, b0, s_zero, D_R)
            _, valid = _load_idx(idx_row, 0, n_slots, T_k, BLOCK_K, col_s)  # [BLOCK_K]
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            m_i, l_i, p, alpha = _softmax_step(sm, s, valid, m_i, l_i, qk_scale, pc)
            n_pairs = (n_tiles - 1) // 2 if NUM_BUF >= 4 else 0
            for j in range(n_pairs):
                acc, m_i, l_i, p = _pair_step(sm, idx_row, n_slots, T_k, qk_scale, 1 + 2 * j, g, pc, p, acc, m_i,
                                              l_i, s_zero, D_R, BLOCK_K, NUM_BUF, p_layout, col_s,
                                              row_o)  # fmt: skip
            for i in range(1 + 2 * n_pairs, n_tiles):
                acc, m_i, l_i, p = _deferred_step(sm, idx_row, n_slots, T_k, qk_scale, i, g, pc, p, acc, m_i,
                                                  l_i, s_zero, D_R, BLOCK_K, NUM_BUF, p_layout, col_s,
                                                  row_o)  # fmt: skip
            b_last = (g + n_tiles - 1) % NUM_BUF
            v_last = kv_bufs.index(b_last).slice(0, DH, dim=1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_last, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if not STAGED_OUT:  # staged: the last tile holds the output on its way out
                mbarrier.arrive(free.index(b_last))
        mbarrier.arrive(q_free)
    else:
        for i in range(n_tiles):
            b = (g + i) % NUM_BUF
            mbarrier.wait(ready.index(b), ((g + i) // NUM_BUF) & 1)
            fence_async_shared()
            s = _logits(sm, b, s_zero, D_R)
            _, valid = _load_idx(idx_row, i * BLOCK_K, n_slots, T_k, BLOCK_K, col_s)  # [BLOCK_K]
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if i == n_tiles - 1:  # the queries' last reader has completed: the producer may load the next item's
                mbarrier.arrive(q_free)
            m_i, l_i, p, alpha = _softmax_step(sm, s, valid, m_i, l_i, qk_scale, pc + i)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            v_left = kv_bufs.index(b).slice(0, DH, dim=1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_left, acc, is_async=True)  # [64, DH]
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if not STAGED_OUT or i < n_tiles - 1:  # staged: the last tile holds the output on its way out
                mbarrier.arrive(free.index(b))
        if n_tiles == 0:
            mbarrier.arrive(q_free)

    inv = _finish(sc, sm, t, hb, m_i, l_i, pc + n_tiles, H, HAS_SINK, row_s)
    out = (acc * gl.convert_layout(inv, row_o)[:, None]).to(out_ptr.dtype.element_ty)
    _out_half(out_ptr, out, kv_bufs, free, g, n_tiles, t, hb, 0, H, D_V, NUM_BUF, STAGED_OUT)
    return g + n_tiles, pc + n_tiles + 1


@gluon.jit(do_not_specialize=["T_q", "T_k", "K_slots"])
def sparse_mla_fwd_sm90_ws_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    T_q, T_k, K_slots, qk_scale, cnt_ptr,
    H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
    HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr,
    BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, REGS_RIGHT: gl.constexpr, REGS_PRODUCER: gl.constexpr,
    num_warps: gl.constexpr, RUN: gl.constexpr = 1, PREFETCH_IDX: gl.constexpr = False,
    PREFETCH_Q: gl.constexpr = False, STAGED_OUT: gl.constexpr = False,
):  # fmt: skip
    """Items ``(query row, block of 64 heads)``, query-major: program ``pid`` takes the ``RUN`` items from
    ``pid * RUN`` (``RUN = 1``: one program per item); with ``RUN = 0`` (persistent) the items ``pid, pid + G, ...``
    for ``G`` programs; with ``RUN = -1`` (persistent, dynamic) item ``pid`` and then, while any is left, item
    ``G + atomic_add(cnt_ptr, 1)`` (``cnt_ptr``: an int32 zero per launch; unused otherwise)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")
    gl.static_assert(not STAGED_OUT or BLOCK_K >= _BLOCK_H, "the output goes out through a tile of at least 64 rows")

    # Shared memory: queries and the ring, each as (values, rope tail); P and its factors.
    qv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, D_V], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_V], dtype)
    q_v = gl.allocate_shared_memory(dtype, [_BLOCK_H, D_V], qv_sl)
    kv_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, D_V], kv_sl)
    if D_R > 0:
        qt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, D_R], dtype)
        kt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D_R], dtype)
        q_t = gl.allocate_shared_memory(dtype, [_BLOCK_H, D_R], qt_sl)
        kt_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_K, D_R], kt_sl)
    else:
        q_t = q_v
        kt_bufs = kv_bufs
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, BLOCK_K], dtype)
    NUM_P: gl.constexpr = 2 if NUM_BUF >= 3 else 1
    p_smem = gl.allocate_shared_memory(dtype, [NUM_P, _BLOCK_H, BLOCK_K], p_sl)
    a_smem = gl.allocate_shared_memory(gl.float32, [NUM_P, _BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [NUM_P, 1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [NUM_P, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(j), count=128)  # every producer thread, when its copies have landed
        mbarrier.init(free.index(j), count=2)  # both consumers
    for j in gl.static_range(NUM_P):
        mbarrier.init(p_ready.index(j), count=1)
        mbarrier.init(p_free.index(j), count=1)  # the right warpgroup
    mbarrier.init(q_ready, count=128)
    mbarrier.init(q_free, count=1)  # the softmax warpgroup
    if RUN == -1:  # the producer hands each item to both consumers through a ring of two slots
        items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        item_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(2):
            mbarrier.init(item_ready.index(j), count=1)  # the producer
            mbarrier.init(item_free.index(j), count=2)  # both consumers
    else:  # unused
        items = a_smem
        item_ready = ready
        item_free = free

    sc = (q_ptr, kv_ptr, idx_ptr, len_ptr, out_ptr, lse_ptr, sink_ptr, T_q, K_slots, T_k, qk_scale)
    sm = (q_v, q_t, kv_bufs, kt_bufs, p_smem, a_smem, ready, free, p_ready, p_free, q_ready, q_free)
    it = (cnt_ptr, items, item_ready, item_free)
    gl.warp_specialize(
        [
            (_softmax_left, (sc, sm, it, H, D_V, D_R, HAS_LEN, HAS_SINK, BLOCK_K, NUM_BUF, RUN, STAGED_OUT)),
            (_right_half, (sc, sm, it, H, D_V, D_R, HAS_LEN, HAS_SINK, BLOCK_K, NUM_BUF, RUN, STAGED_OUT)),
            (_producer, (sc, sm, it, H, D_V, D_R, HAS_LEN, HAS_SINK, BLOCK_K, NUM_BUF, RUN, PREFETCH_IDX, PREFETCH_Q)),
        ],
        [4, 4],
        [REGS_RIGHT, REGS_PRODUCER],
    )


def ws_schedule(num_items: int, device: torch.device) -> tuple[int, int]:
    """``(programs, RUN)`` of a launch over ``num_items`` items (``WS_SCHEDULE``): one program per run of ``WS_RUN``
    consecutive items (``RUN = WS_RUN``), or one program per SM (never more than items) taking every G-th item
    (``RUN = 0``) or items from the launch's counter (``RUN = -1``). One program fits an SM."""
    if WS_SCHEDULE not in WS_SCHEDULES:
        raise ValueError(f"WS_SCHEDULE must be one of {WS_SCHEDULES}, got {WS_SCHEDULE!r}")
    if WS_SCHEDULE != "runs":
        return max(min(num_items, sm_count(device)), 1), (0 if WS_SCHEDULE == "persistent" else -1)
    if not isinstance(WS_RUN, int) or isinstance(WS_RUN, bool) or WS_RUN < 1:
        raise ValueError(f"WS_RUN must be a positive int (consecutive items per program), got {WS_RUN!r}")
    return max(-(-num_items // WS_RUN), 1), WS_RUN


def ws_smem_bytes(block_k: int, num_buf: int, d_qk: int, itemsize: int) -> int:
    """Shared memory of one program: queries, the ring, ``P``, the factors and the barriers."""
    num_p = 2 if num_buf >= 3 else 1
    return (_HEADS + num_buf * block_k) * d_qk * itemsize + num_p * _HEADS * (block_k * itemsize + 4) + 512


def ws_unsupported_reason(q: torch.Tensor, d_v: int) -> str | None:
    """``None`` when this kernel handles ``q [T, H, D_qk]`` with value width ``d_v``, else why not: the two-warpgroup
    kernel's rules (:func:`~longtrain.dsa.triton.sparse_mla_fwd_sm90.sm90_unsupported_reason`), and two halves of
    ``d_v`` of at least 64 each."""
    reason = sm90_unsupported_reason(q, d_v)
    if reason is None and d_v < 128:
        return f"it needs a power-of-two d_v in [128, 512] (two halves of 64..256), got d_v={d_v}"
    return reason
