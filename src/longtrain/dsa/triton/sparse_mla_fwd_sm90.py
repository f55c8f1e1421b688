"""Sparse MLA forward for Hopper (SM90) in Gluon: an explicit cp.async ring of gathered KV tiles + wgmma.

Same contract and math as :func:`longtrain.dsa.triton.sparse_mla_fwd.sparse_mla_fwd_kernel` (one program per
(query row, block of 64 heads), fp32 online softmax in base 2, invalid slots masked, exact zeros for rows
without keys), with the schedule written out instead of left to Triton's software pipeliner:

* the queries ``[64, D_qk]`` stay in shared memory; the row's gathered latent rows stream through a ring of
  ``NUM_BUF`` shared-memory tiles of ``BLOCK_K`` rows, filled by ``cp.async`` (invalid slots are zero-filled);
* at the top of step ``i`` (after one CTA barrier) the copy of tile ``i + NUM_BUF - 1`` is issued into the
  buffer step ``i - 1`` just released, so the gather runs under the whole of step ``i``'s matmuls and softmax
  (Triton's pipeliner issues the next tile only after the last matmul of the step);
* ``S = Q K^T`` runs as one wgmma per part (latent, rope) with the two warpgroups splitting the keys (no
  warpgroup computes logits the other one also computes), the row statistics are combined across warpgroups,
  and ``P V`` runs with ``P`` in registers and the two warpgroups splitting ``d_v``;
* the slot indices of a tile are loaded one step before its copy is issued, so their latency is hidden too.

Gluon kernels do not run in Triton's CPU interpreter; ``sparse_mla_fwd`` uses this kernel only on SM90 CUDA
devices for bf16/fp16 inputs with power-of-two ``d_v`` in [64, 512], a rope tail of 0 or a power of two in
[16, 128], and at least 64 heads (see :func:`sm90_unsupported_reason`).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

__all__ = ["sm90_unsupported_reason", "sparse_mla_fwd_sm90_kernel"]

# Triton 3.6 names the cp.async copy ``async_copy_global_to_shared``; later releases call it ``async_load``.
_async_load = cp.async_load if hasattr(cp, "async_load") else cp.async_copy_global_to_shared
# ... and its CTA barrier ``thread_barrier`` (``barrier`` later).
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

_BLOCK_H = 64


@gluon.constexpr_function
def _gather_layout(width, num_warps):
    """Blocked layout of a ``[rows, width]`` tile: 16-byte (8 x 16-bit) vectors, a warp spans a row."""
    tpw_c = min(32, max(width, 8) // 8)
    return gl.BlockedLayout([1, 8], [32 // tpw_c, tpw_c], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _half_n_mma_layout(n):
    """wgmma accumulator layout of ``[64, n]`` with the two warpgroups splitting ``n``."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, min(n // 2, 256), 16])


@gluon.jit
def _load_idx(idx_row, k0, n_slots, T_k, BLOCK_K: gl.constexpr, layout: gl.constexpr):
    """Slot indices ``[k0, k0 + BLOCK_K)`` of a row (``-1`` past ``n_slots``) and their validity."""
    offs = k0 + gl.arange(0, BLOCK_K, layout=layout)
    in_len = offs < n_slots
    idx = gl.load(idx_row + offs, mask=in_len, other=-1)  # [BLOCK_K]
    return idx, in_len & (idx >= 0) & (idx < T_k)


@gluon.jit
def _issue_tile(kv_ptr, v_off, r_off, idx_v, valid_v, idx_r, valid_r, v_buf, r_buf, STRIDE: gl.constexpr,
                D_V: gl.constexpr, D_R: gl.constexpr, LV: gl.constexpr, LR: gl.constexpr):  # fmt: skip
    """cp.async the gathered rows of one tile into ``v_buf`` / ``r_buf`` (invalid rows are zero-filled): ``D_V``
    columns from column ``v_off`` and ``D_R`` from column ``r_off`` of rows ``STRIDE`` elements apart."""
    rows_v = gl.where(valid_v, idx_v, 0).to(gl.int64) * STRIDE + v_off
    offs_v = gl.arange(0, D_V, layout=gl.SliceLayout(0, LV))
    _async_load(v_buf, kv_ptr + rows_v[:, None] + offs_v[None, :], mask=valid_v[:, None])  # [BLOCK_K, D_V]
    if D_R > 0:
        rows_r = gl.where(valid_r, idx_r, 0).to(gl.int64) * STRIDE + r_off
        offs_r = gl.arange(0, D_R, layout=gl.SliceLayout(0, LR))
        _async_load(r_buf, kv_ptr + rows_r[:, None] + offs_r[None, :], mask=valid_r[:, None])  # [BLOCK_K, D_R]
    cp.commit_group()


@gluon.jit
def _ring_start(kv_ptr, v_off, r_off, STRIDE: gl.constexpr, idx_row, n_slots, T_k, v_bufs, r_bufs, D_V: gl.constexpr,
                D_R: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, LV: gl.constexpr,
                LR: gl.constexpr):  # fmt: skip
    """The ring's prologue: tiles 0 .. NUM_BUF-2 in flight; returns the indices (and validity) of tile NUM_BUF-1.
    Columns and stride as in :func:`_issue_tile`."""
    rl_v: gl.constexpr = gl.SliceLayout(1, LV)
    rl_r: gl.constexpr = gl.SliceLayout(1, LR)
    for j in gl.static_range(NUM_BUF - 1):
        iv, mv = _load_idx(idx_row, j * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
        ir, mr = _load_idx(idx_row, j * BLOCK_K, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
        _issue_tile(kv_ptr, v_off, r_off, iv, mv, ir, mr, v_bufs.index(j), r_bufs.index(j), STRIDE, D_V, D_R, LV, LR)
    nxt_v, nxt_mv = _load_idx(idx_row, (NUM_BUF - 1) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_v)  # [BLOCK_K] x 2
    nxt_r, nxt_mr = _load_idx(idx_row, (NUM_BUF - 1) * BLOCK_K, n_slots, T_k, BLOCK_K, rl_r)  # [BLOCK_K] x 2
    return nxt_v, nxt_mv, nxt_r, nxt_mr


@gluon.jit
def _ring_advance(kv_ptr, v_off, r_off, STRIDE: gl.constexpr, idx_row, n_slots, T_k, i, nxt_v, nxt_mv, nxt_r,
                  nxt_mr, v_bufs, r_bufs, D_V: gl.constexpr, D_R: gl.constexpr, BLOCK_K: gl.constexpr,
                  NUM_BUF: gl.constexpr, LV: gl.constexpr, LR: gl.constexpr):  # fmt: skip
    """Top of step ``i``: wait until tile i has landed (this thread's copies, then everyone's: every warp has also
    finished step i-1, so the buffer it read is free), issue tile i + NUM_BUF - 1 into it, and return the indices
    of tile i + NUM_BUF."""
    cp.wait_group(NUM_BUF - 2)
    fence_async_shared()
    _cta_barrier()
    nb = (i + NUM_BUF - 1) % NUM_BUF
    _issue_tile(kv_ptr, v_off, r_off, nxt_v, nxt_mv, nxt_r, nxt_mr, v_bufs.index(nb), r_bufs.index(nb), STRIDE, D_V,
                D_R, LV, LR)  # fmt: skip
    k_next = (i + NUM_BUF) * BLOCK_K
    nxt_v, nxt_mv = _load_idx(idx_row, k_next, n_slots, T_k, BLOCK_K, gl.SliceLayout(1, LV))  # [BLOCK_K] x 2
    nxt_r, nxt_mr = _load_idx(idx_row, k_next, n_slots, T_k, BLOCK_K, gl.SliceLayout(1, LR))  # [BLOCK_K] x 2
    return nxt_v, nxt_mv, nxt_r, nxt_mr


@gluon.jit(do_not_specialize=["T_k", "K_slots"])
def sparse_mla_fwd_sm90_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    T_k, K_slots, qk_scale,
    H: gl.constexpr, D_V: gl.constexpr, D_R: gl.constexpr,
    HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr,
    BLOCK_K: gl.constexpr, NUM_BUF: gl.constexpr, SPLIT_KEYS: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    BLOCK_H: gl.constexpr = 64
    D_QK: gl.constexpr = D_V + D_R
    NUM_HB: gl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    gl.static_assert(num_warps == 8, "two consumer warpgroups")

    # Register layouts: gathers, logits S [heads, keys], output O [heads, d_v] and P as the A operand of P V.
    LV: gl.constexpr = _gather_layout(D_V, num_warps)
    LR: gl.constexpr = _gather_layout(D_R, num_warps)
    if SPLIT_KEYS:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_K // 2, 16]
        )
    else:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_K, 16]
        )
    o_layout: gl.constexpr = _half_n_mma_layout(D_V)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

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

    pid = gl.program_id(0)
    t = (pid // NUM_HB).to(gl.int64)
    hb = pid % NUM_HB

    # Queries (heads past H are zero-filled), in the first copy group together with tile 0.
    q_row = q_ptr + t * (H * D_QK)
    hv = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LV))
    cv = gl.arange(0, D_V, layout=gl.SliceLayout(0, LV))
    _async_load(q_v, q_row + hv[:, None] * D_QK + cv[None, :], mask=(hv < H)[:, None])  # [BLOCK_H, D_V]
    if D_R > 0:
        hr = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LR))
        cr = gl.arange(0, D_R, layout=gl.SliceLayout(0, LR))
        _async_load(q_r, q_row + D_V + hr[:, None] * D_QK + cr[None, :], mask=(hr < H)[:, None])  # [BLOCK_H, D_R]

    if HAS_LEN:
        n_slots = gl.minimum(gl.maximum(gl.load(len_ptr + t).to(gl.int32), 0), K_slots)  # scalar
    else:
        n_slots = K_slots
    idx_row = idx_ptr + t * K_slots

    # Prologue: tiles 0 .. NUM_BUF-2 in flight, indices of tile NUM_BUF-1 in registers.
    nxt_v, nxt_mv, nxt_r, nxt_mr = _ring_start(kv_ptr, 0, D_V, D_QK, idx_row, n_slots, T_k, v_bufs, r_bufs,
                                               D_V, D_R, BLOCK_K, NUM_BUF, LV, LR)  # fmt: skip

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_H, D_V], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_layout)
    n_tiles = gl.cdiv(n_slots, BLOCK_K)
    for i in range(n_tiles):
        buf = i % NUM_BUF
        nxt_v, nxt_mv, nxt_r, nxt_mr = _ring_advance(kv_ptr, 0, D_V, D_QK, idx_row, n_slots, T_k, i, nxt_v, nxt_mv,
                                                     nxt_r, nxt_mr, v_bufs, r_bufs, D_V, D_R, BLOCK_K, NUM_BUF, LV,
                                                     LR)  # fmt: skip

        v_buf = v_bufs.index(buf)
        s = warpgroup_mma(q_v, v_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)  # [BLOCK_H, BLOCK_K]
        if D_R > 0:
            s = warpgroup_mma(q_r, r_bufs.index(buf).permute((1, 0)), s, is_async=True)
        _, valid = _load_idx(idx_row, i * BLOCK_K, n_slots, T_k, BLOCK_K, col_s)  # [BLOCK_K]
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))

        s = gl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A row that has seen no valid slot yet keeps m = -inf; shifting by 0 gives p = alpha = 0, not NaN.
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)  # [BLOCK_H, D_V]
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    cp.wait_group(0)

    offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
    mask_h = offs_h < H
    has_keys = l_i > 0.0
    denom = l_i
    if HAS_SINK:
        # The sink is one more logit with a zero value: it only enlarges the denominator.
        sink = gl.load(sink_ptr + offs_h, mask=mask_h, other=float("-inf")) * 1.4426950408889634  # [BLOCK_H]
        denom = l_i + gl.exp2(sink - gl.where(m_i == float("-inf"), 0.0, m_i))
    inv = gl.where(has_keys, 1.0 / gl.where(has_keys, denom, 1.0), 0.0)
    lse = gl.where(has_keys, (m_i + gl.log2(gl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    gl.store(lse_ptr + t * H + offs_h, lse, mask=mask_h)

    out = (acc * gl.convert_layout(inv, row_o)[:, None]).to(out_ptr.dtype.element_ty)
    oh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_o)
    oc = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + t * (H * D_V) + oh[:, None] * D_V + oc[None, :], out, mask=(oh < H)[:, None])


def sm90_unsupported_reason(q: torch.Tensor, d_v: int) -> str | None:
    """``None`` when this kernel handles ``q [T, H, D_qk]`` with value width ``d_v``, else why not."""
    num_heads, d_qk = q.shape[1], q.shape[2]
    d_r = d_qk - d_v
    if q.device.type != "cuda":
        return f"it runs on CUDA SM90 GPUs, not on {q.device.type}"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"it needs an SM90 (Hopper) GPU, {q.device} is SM{major}{minor}"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"it takes bf16/fp16 inputs, got {q.dtype}"
    if num_heads < _BLOCK_H:
        return f"it needs at least {_BLOCK_H} heads (one wgmma tile), got H={num_heads}"
    if d_v & (d_v - 1) or not 64 <= d_v <= 512:
        return f"it needs a power-of-two d_v in [64, 512], got d_v={d_v}"
    if d_r and (d_r & (d_r - 1) or not 16 <= d_r <= 128):
        return f"it needs a rope tail D_qk - d_v of 0 or a power of two in [16, 128], got {d_r}"
    return None
