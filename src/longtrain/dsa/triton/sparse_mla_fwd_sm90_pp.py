"""Sparse MLA forward for Hopper (SM90) in Gluon, ping-pong: two consumer warpgroups take turns over the key tiles,
each computing the logits and softmax of its own tile and one half of ``d_v`` over both tiles.

Same contract and math as :func:`longtrain.dsa.triton.sparse_mla_fwd.sparse_mla_fwd_kernel` (one program per
(query row, block of 64 heads), fp32 online softmax in base 2, invalid slots masked, exact zeros for rows without
keys). In :mod:`~longtrain.dsa.triton.sparse_mla_fwd_sm90_ws` one warpgroup computes every tile's logits and softmax
and the other only the right half of ``P V``, so the tensor cores wait while the first one runs its softmax. Here the
tiles go in pairs (tile ``2j`` in buffer 0, ``2j + 1`` in buffer 1) and the work is the same on both sides:

* the **producer** (4 warps, few registers) cp.asyncs the queries once, then each pair's tiles into the two buffers
  (values ``[64, D_V]`` and rope tail ``[64, D_R]`` each), signalled by ``cp.async.mbarrier.arrive``; a buffer is
  refilled once both consumers have released it;
* **warpgroup 0** (the default partition) computes ``S_0 = Q K_0^T``, its row max and hands it over; its
  probabilities ``P_0`` (relative to its own max) go straight into ``O_L += P_0 V_0[:, :D_V/2]`` from registers;
  once warpgroup 1 has returned the pair's max it rescales ``P_0`` to it and stores it for warpgroup 1, then adds
  warpgroup 1's ``P_1`` with ``O_L += P_1 V_1[:, :D_V/2]``;
* **warpgroup 1** computes ``S_1 = Q K_1^T`` at the same time, takes the pair's max (its own and warpgroup 0's),
  ``O_R += P_1 V_1[:, D_V/2:]`` from registers and stores ``P_1``, then ``O_R += P_0 V_0[:, D_V/2:]``.

So each warpgroup issues one tile's logits and two half-width ``P V`` per pair, and one's softmax runs under the
other's matmuls. Both keep the same running max (the pair's), each its own row sums, added at the end.
Shared memory at the GLM shape (64 heads, D_qk 576): 72 KiB of queries, two tiles of 72 KiB and ``P_1`` (8 KiB);
``P_0`` goes into tile 0's rope block, which only ``S_0`` reads (where ``D_R`` = 64; otherwise a block of its own).
A row whose tile count is odd ends with an empty tile (every slot invalid, zero-filled).

Gluon kernels do not run in Triton's CPU interpreter; ``sparse_mla_fwd`` runs this kernel only where its
``_pp_reason`` returns ``None`` (the warp-specialized kernel's rules and :func:`pp_smem_bytes` within 227 KiB).
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

from longtrain.dsa.triton.sparse_mla_fwd_sm90 import _gather_layout, _load_idx
from longtrain.dsa.triton.sparse_mla_fwd_sm90_items import _item
from longtrain.dsa.triton.sparse_mla_fwd_sm90_ws import _gather, _mma_layout

__all__ = [
    "PP_MAXNREG",
    "PP_NUM_REGS",
    "pp_smem_bytes",
    "sparse_mla_fwd_sm90_pp_kernel",
]

_HEADS = 64  # heads per program (one wgmma tile of M)
_BLOCK_H = gl.constexpr(_HEADS)
_SLOTS = 64  # slots per tile
_BLOCK_K = gl.constexpr(_SLOTS)
# setmaxnreg budgets of the worker partitions (warpgroup 1, the producer); warpgroup 0 gets the rest of the 168 x 3
# per thread that one 384-thread program may hold on an SM (64K registers): 216.
PP_NUM_REGS = (216, 72)
PP_MAXNREG = 168


@gluon.jit
def _producer(sc, sm, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr):
    """Worker partition: the queries, then both tiles of every pair."""
    q_ptr, kv_ptr, idx_row, out_ptr, lse_ptr, sink_ptr, t, hb, n_slots, T_k, qk_scale = sc
    q_v, q_t, kv_bufs, kt_bufs, p0_smem, p1_smem, m_smem, l_smem, bars = sm
    ready, free, q_bar, m0_ready, m1_ready, p0_ready, p1_ready, p1_free, l_ready, inv_ready = bars
    D_QK: gl.constexpr = D_V + D_R
    LV: gl.constexpr = _gather_layout(D_V, 4)
    LT: gl.constexpr = _gather_layout(max(D_R, 16), 4)

    q_row = q_ptr + t * (H * D_QK)
    hh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, LV))
    _gather(q_v, q_row, hh * D_QK, hh < H, 0, D_V, LV)  # [64, D_V]
    if D_R > 0:
        ht = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, LT))
        _gather(q_t, q_row, ht * D_QK, ht < H, D_V, D_R, LT)  # [64, D_R]
    cp.mbarrier_arrive(q_bar, increment_count=False)

    for j in range(gl.cdiv(n_slots, 2 * _BLOCK_K)):
        for b in gl.static_range(2):
            mbarrier.wait(free.index(b), (j & 1) ^ 1)
            k0 = (2 * j + b) * _BLOCK_K
            idx, valid = _load_idx(idx_row, k0, n_slots, T_k, _BLOCK_K, gl.SliceLayout(1, LV))  # [64] x 2
            _gather(kv_bufs.index(b), kv_ptr, gl.where(valid, idx, 0).to(gl.int64) * D_QK, valid, 0, D_V, LV)
            if D_R > 0:
                idx_t, valid_t = _load_idx(idx_row, k0, n_slots, T_k, _BLOCK_K, gl.SliceLayout(1, LT))
                rows_t = gl.where(valid_t, idx_t, 0).to(gl.int64) * D_QK
                _gather(kt_bufs.index(b), kv_ptr, rows_t, valid_t, D_V, D_R, LT)  # [64, D_R]
            cp.mbarrier_arrive(ready.index(b), increment_count=False)


@gluon.jit
def _buffers(j):
    """The two buffers' indices, 0 and 1, as values the compiler cannot fold: with constant indices every wgmma
    descriptor of the loop is formed once before it and held in registers (ptxas then spills them); formed in the
    loop they cost a few integer instructions. ``j >> 30`` is 0 for any row (at most 2^30 pairs)."""
    b0 = j >> 30
    return b0, b0 + 1


@gluon.jit
def _tile_logits(sc, sm, b, k0, s_zero, D_R: gl.constexpr):
    """``S = Q K_b^T`` scaled to base 2, invalid slots ``-inf``: ``[64, 64]`` fp32 (two wgmma chains)."""
    q_ptr, kv_ptr, idx_row, out_ptr, lse_ptr, sink_ptr, t, hb, n_slots, T_k, qk_scale = sc
    q_v, q_t, kv_bufs, kt_bufs, p0_smem, p1_smem, m_smem, l_smem, bars = sm
    s = warpgroup_mma(q_v, kv_bufs.index(b).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if D_R > 0:
        s = warpgroup_mma(q_t, kt_bufs.index(b).permute((1, 0)), s, is_async=True)  # [64, 64]
    _, valid = _load_idx(idx_row, k0, n_slots, T_k, _BLOCK_K, gl.SliceLayout(0, s_zero.type.layout))  # [64]
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    return gl.where(valid[None, :], s * qk_scale, float("-inf"))


@gluon.jit
def _guard(m):
    """A row max usable as a shift: a row that has seen no valid slot keeps ``-inf``; shifting by 0 gives
    ``exp2(-inf) = 0``, not NaN."""
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def _store_half(sc, acc, inv, col0, o_layout: gl.constexpr, H: gl.constexpr, D_V: gl.constexpr):
    """``out[t, heads of the block, col0 : col0 + D_V/2] = acc * inv``."""
    q_ptr, kv_ptr, idx_row, out_ptr, lse_ptr, sink_ptr, t, hb, n_slots, T_k, qk_scale = sc
    DH: gl.constexpr = D_V // 2
    out = (acc * gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]).to(out_ptr.dtype.element_ty)
    oh = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    oc = col0 + gl.arange(0, DH, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + t * (H * D_V) + oh[:, None] * D_V + oc[None, :], out, mask=(oh < H)[:, None])


@gluon.jit
def _warpgroup0(sc, sm, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr):
    """Default partition: tile ``2j``'s logits and softmax, ``O[:, :D_V/2]`` over both tiles, the LSE."""
    q_ptr, kv_ptr, idx_row, out_ptr, lse_ptr, sink_ptr, t, hb, n_slots, T_k, qk_scale = sc
    q_v, q_t, kv_bufs, kt_bufs, p0_smem, p1_smem, m_smem, l_smem, bars = sm
    ready, free, q_bar, m0_ready, m1_ready, p0_ready, p1_ready, p1_free, l_ready, inv_ready = bars
    DH: gl.constexpr = D_V // 2
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    s_layout: gl.constexpr = _mma_layout(_BLOCK_K)
    o_layout: gl.constexpr = _mma_layout(DH)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_i = gl.full([_BLOCK_H], float("-inf"), gl.float32, layout=row_s)  # the running max (the last pair's)
    l_i = gl.zeros([_BLOCK_H], gl.float32, layout=row_s)  # this warpgroup's row sums (tiles 2j)
    acc = gl.zeros([_BLOCK_H, DH], gl.float32, layout=o_layout)
    s_zero = gl.zeros([_BLOCK_H, _BLOCK_K], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(gl.cdiv(n_slots, 2 * _BLOCK_K)):
        phase = j & 1
        b0, b1 = _buffers(j)
        mbarrier.wait(ready.index(0), phase)
        fence_async_shared()
        s = _tile_logits(sc, sm, b0, 2 * j * _BLOCK_K, s_zero, D_R)  # [64, 64]
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_smem.store(m_new)
        mbarrier.arrive(m0_ready)
        m_use = _guard(m_new)
        alpha = gl.exp2(m_i - m_use)
        p32 = gl.exp2(s - m_use[:, None])  # [64, 64], relative to this tile's max
        l_i = l_i * alpha + gl.sum(p32, 1)
        p = p32.to(dtype)
        p0_smem.store(p)  # tile 0's rope block (S_0 has read it) or a block of its own
        fence_async_shared()
        mbarrier.arrive(p0_ready)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p, p_layout), kv_bufs.index(b0).slice(0, DH, dim=1), acc,
                            is_async=True)  # [64, DH]: O_L += P_0 V_0  # fmt: skip
        mbarrier.wait(m1_ready, phase)
        m_pair = m_smem.load(row_s)
        beta = _to_pair_max(m_new, m_pair)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(free.index(0))
        acc = acc * gl.convert_layout(beta, row_o)[:, None]
        l_i = l_i * beta
        mbarrier.wait(p1_ready, phase)
        acc = warpgroup_mma(p1_smem, kv_bufs.index(b1).slice(0, DH, dim=1), acc, is_async=True)  # O_L += P_1 V_1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(p1_free)
        mbarrier.arrive(free.index(1))
        m_i = m_pair

    # Row sums of both warpgroups (the same max), the sink, the LSE; 1 / denominator to warpgroup 1.
    mbarrier.wait(l_ready, 0)
    l_all = l_i + l_smem.load(row_s)
    offs_h = hb * _BLOCK_H + gl.arange(0, _BLOCK_H, layout=row_s)
    mask_h = offs_h < H
    has_keys = l_all > 0.0
    denom = l_all
    if HAS_SINK:
        # The sink is one more logit with a zero value: it only enlarges the denominator.
        sink = gl.load(sink_ptr + offs_h, mask=mask_h, other=float("-inf")) * 1.4426950408889634  # [64]
        denom = l_all + gl.exp2(sink - _guard(m_i))
    inv = gl.where(has_keys, 1.0 / gl.where(has_keys, denom, 1.0), 0.0)
    lse = gl.where(has_keys, (m_i + gl.log2(gl.where(has_keys, l_all, 1.0))) * 0.6931471805599453, float("-inf"))
    gl.store(lse_ptr + t * H + offs_h, lse, mask=mask_h)
    m_smem.store(inv)
    mbarrier.arrive(inv_ready)
    _store_half(sc, acc, inv, 0, o_layout, H, D_V)


@gluon.jit
def _to_pair_max(m_new, m_pair):
    """``exp2(m_new - m_pair)``: from tile 2j's max to the pair's (<= 1); 1 where tile 2j's rows have no key yet
    (their probabilities and sums are 0, and the factor could overflow)."""
    return gl.where(m_new == float("-inf"), 1.0, gl.exp2(_guard(m_new) - _guard(m_pair)))


@gluon.jit
def _warpgroup1(sc, sm, H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr, HAS_SINK: gl.constexpr):
    """Worker partition: tile ``2j + 1``'s logits and softmax at the pair's max, ``O[:, D_V/2:]`` over both tiles:
    ``P_0`` comes relative to tile 2j's max, so the accumulator is brought to that max, takes ``P_0 V_0``, then to
    the pair's and takes ``P_1 V_1`` (the same factors as warpgroup 0's half)."""
    q_ptr, kv_ptr, idx_row, out_ptr, lse_ptr, sink_ptr, t, hb, n_slots, T_k, qk_scale = sc
    q_v, q_t, kv_bufs, kt_bufs, p0_smem, p1_smem, m_smem, l_smem, bars = sm
    ready, free, q_bar, m0_ready, m1_ready, p0_ready, p1_ready, p1_free, l_ready, inv_ready = bars
    DH: gl.constexpr = D_V // 2
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    s_layout: gl.constexpr = _mma_layout(_BLOCK_K)
    o_layout: gl.constexpr = _mma_layout(DH)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_i = gl.full([_BLOCK_H], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([_BLOCK_H], gl.float32, layout=row_s)  # this warpgroup's row sums (tiles 2j + 1)
    acc = gl.zeros([_BLOCK_H, DH], gl.float32, layout=o_layout)
    s_zero = gl.zeros([_BLOCK_H, _BLOCK_K], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(gl.cdiv(n_slots, 2 * _BLOCK_K)):
        phase = j & 1
        b0, b1 = _buffers(j)
        mbarrier.wait(ready.index(1), phase)
        fence_async_shared()
        s = _tile_logits(sc, sm, b1, (2 * j + 1) * _BLOCK_K, s_zero, D_R)  # [64, 64]
        mbarrier.wait(m0_ready, phase)
        m_new = m_smem.load(row_s)  # tile 2j's max (with the running max)
        m_pair = gl.maximum(m_new, gl.max(s, 1))
        m_smem.store(m_pair)
        mbarrier.arrive(m1_ready)
        m_use = _guard(m_pair)
        p32 = gl.exp2(s - m_use[:, None])  # [64, 64], relative to the pair's max
        l_i = l_i * gl.exp2(m_i - m_use) + gl.sum(p32, 1)
        p = p32.to(dtype)
        mbarrier.wait(p1_free, phase ^ 1)  # warpgroup 0 has finished reading the last pair's P_1
        p1_smem.store(p)
        fence_async_shared()
        mbarrier.arrive(p1_ready)
        beta = _to_pair_max(m_new, m_pair)
        acc = acc * gl.convert_layout(gl.exp2(m_i - _guard(m_new)), row_o)[:, None]
        mbarrier.wait(p0_ready, phase)
        acc = warpgroup_mma(p0_smem, kv_bufs.index(b0).slice(DH, DH, dim=1), acc, is_async=True)  # O_R += P_0 V_0
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(free.index(0))
        acc = acc * gl.convert_layout(beta, row_o)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p, p_layout), kv_bufs.index(b1).slice(DH, DH, dim=1), acc,
                            is_async=True)  # [64, DH]: O_R += P_1 V_1  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(free.index(1))
        m_i = m_pair

    l_smem.store(l_i)
    mbarrier.arrive(l_ready)
    mbarrier.wait(inv_ready, 0)
    _store_half(sc, acc, m_smem.load(row_s), DH, o_layout, H, D_V)


@gluon.jit(do_not_specialize=["T_k", "K_slots"])
def sparse_mla_fwd_sm90_pp_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    T_k, K_slots, qk_scale,
    H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
    HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr,
    REGS_WG1: gl.constexpr, REGS_PRODUCER: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    gl.static_assert(num_warps == 4, "the default partition is one warpgroup")

    qv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, D_V], dtype)
    kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_K, D_V], dtype)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, _BLOCK_K], dtype)
    q_v = gl.allocate_shared_memory(dtype, [_BLOCK_H, D_V], qv_sl)
    kv_bufs = gl.allocate_shared_memory(dtype, [2, _BLOCK_K, D_V], kv_sl)
    if D_R > 0:
        qt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_H, D_R], dtype)
        kt_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_BLOCK_K, D_R], dtype)
        q_t = gl.allocate_shared_memory(dtype, [_BLOCK_H, D_R], qt_sl)
        kt_bufs = gl.allocate_shared_memory(dtype, [2, _BLOCK_K, D_R], kt_sl)
    else:
        q_t = q_v
        kt_bufs = kv_bufs
    if D_R == _BLOCK_K:
        p0_smem = kt_bufs.index(0)  # [64 keys, 64] rope block = [64 heads, 64 keys] of P_0, the same layout
    else:
        p0_smem = gl.allocate_shared_memory(dtype, [_BLOCK_H, _BLOCK_K], p_sl)
    p1_smem = gl.allocate_shared_memory(dtype, [_BLOCK_H, _BLOCK_K], p_sl)
    row_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    m_smem = gl.allocate_shared_memory(gl.float32, [_BLOCK_H], row_sl)
    l_smem = gl.allocate_shared_memory(gl.float32, [_BLOCK_H], row_sl)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    one = gl.allocate_shared_memory(gl.int64, [8, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(ready.index(b), count=128)  # every producer thread, when its copies have landed
        mbarrier.init(free.index(b), count=2)  # both consumers
    mbarrier.init(one.index(0), count=128)  # the queries: every producer thread
    for k in gl.static_range(1, 8):
        mbarrier.init(one.index(k), count=1)  # one warpgroup's hand-over
    bars = (ready, free, one.index(0), one.index(1), one.index(2), one.index(3), one.index(4), one.index(5),
            one.index(6), one.index(7))  # fmt: skip

    t, hb, idx_row, n_slots = _item(idx_ptr, len_ptr, K_slots, gl.program_id(0), H, HAS_LEN)
    sc = (q_ptr, kv_ptr, idx_row, out_ptr, lse_ptr, sink_ptr, t, hb, n_slots, T_k, qk_scale)
    sm = (q_v, q_t, kv_bufs, kt_bufs, p0_smem, p1_smem, m_smem, l_smem, bars)
    gl.warp_specialize(
        [
            (_warpgroup0, (sc, sm, H, D_V, D_R, HAS_SINK)),
            (_warpgroup1, (sc, sm, H, D_V, D_R, HAS_SINK)),
            (_producer, (sc, sm, H, D_V, D_R)),
        ],
        [4, 4],
        [REGS_WG1, REGS_PRODUCER],
    )


def pp_smem_bytes(d_qk: int, d_v: int, itemsize: int) -> int:
    """Shared memory of one program: queries, two tiles, ``P_1`` (and ``P_0`` unless it takes tile 0's rope block),
    the row statistics and the barriers."""
    p_blocks = 1 if d_qk - d_v == _SLOTS else 2
    return 3 * 64 * d_qk * itemsize + p_blocks * _HEADS * _SLOTS * itemsize + 2 * _HEADS * 4 + 512
