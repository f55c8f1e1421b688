"""The Triton kernels of :mod:`.triton_varlen_bwd` (preprocess, dK/dV, dQ); see its docstring.

Importing this module imports Triton.
"""

import triton
import triton.language as tl

__all__ = ["triton_varlen_bwd_kernel_dkdv", "triton_varlen_bwd_kernel_dq", "triton_varlen_bwd_kernel_preprocess"]


@triton.jit
def _load_tile(ptrs, row_ok, d_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    # ptrs: [R, BLOCK_D] (R: the caller's block of rows), row_ok: [R], d_ok: [BLOCK_D] -> x: [R, BLOCK_D]
    if MASK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return x


@triton.jit
def _load_rows(ptrs, row_ok, fill, MASK_ROWS: tl.constexpr):
    # ptrs, row_ok: [R] -> x: [R]
    if MASK_ROWS:
        x = tl.load(ptrs, mask=row_ok, other=fill)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit(do_not_specialize=["T_q"])
def triton_varlen_bwd_kernel_preprocess(
    O, DO, LSE, DELTA, LSE2, T_q,
    stride_ot, stride_oh, stride_dot, stride_doh, stride_lt, stride_lh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < T_q
    d_ok = offs_d < D
    rows = offs_t.to(tl.int64)
    # o, do: [BLOCK_T, BLOCK_D]
    o = _load_tile(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], t_ok, d_ok, True, BLOCK_D == D)
    do = _load_tile(DO + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], t_ok, d_ok, True, BLOCK_D == D)
    lse = tl.load(LSE + rows * stride_lt + h * stride_lh, mask=t_ok, other=0.0).to(tl.float32)  # [BLOCK_T]
    # A row that sees no key has lse -inf (or +inf / NaN, by library): its probabilities must all be 0.
    no_key = (lse != lse) | (lse == float("inf")) | (lse == float("-inf"))
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BLOCK_T]
    base = h.to(tl.int64) * T_q
    tl.store(DELTA + base + offs_t, tl.where(no_key, 0.0, delta), mask=t_ok)
    tl.store(LSE2 + base + offs_t, tl.where(no_key, float("inf"), lse * 1.4426950408889634), mask=t_ok)  # log2(e)


@triton.jit
def _dkdv_steps(
    dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr,
    stride_qt, stride_dot, stride_dqat, q0, lq, off, offs_n, offs_d, d_ok, b_start, b_end, qk_scale, sm_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr,
    DQ_ATOMIC: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    for b in range(b_start, b_end):
        offs_m = b * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < lq
        rows = (q0 + offs_m).to(tl.int64)
        # q, do: [BLOCK_M, BLOCK_D]
        q = _load_tile(q_ptr + rows[:, None] * stride_qt + offs_d[None, :], m_ok, d_ok, MASK, EVEN_D)
        do = _load_tile(do_ptr + rows[:, None] * stride_dot + offs_d[None, :], m_ok, d_ok, MASK, EVEN_D)
        lse2 = _load_rows(lse_ptr + q0 + offs_m, m_ok, float("inf"), MASK)  # [BLOCK_M]
        delta = _load_rows(delta_ptr + q0 + offs_m, m_ok, 0.0, MASK)  # [BLOCK_M]
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_M]
        p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])  # [BLOCK_N, BLOCK_M]
        if MASK:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + off, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_D]
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_M]
        ds_t = p_t * (dp_t - delta[None, :])  # [BLOCK_N, BLOCK_M]
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_D]
        if DQ_ATOMIC:
            dq = tl.dot(tl.trans(ds_t * sm_scale).to(k.dtype), k, input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_D]
            ptrs = dqa_ptr + rows[:, None] * stride_dqat + offs_d[None, :]
            if EVEN_D:
                tl.atomic_add(ptrs, dq, mask=m_ok[:, None], sem="relaxed")
            else:
                tl.atomic_add(ptrs, dq, mask=m_ok[:, None] & d_ok[None, :], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["T_q"])
def triton_varlen_bwd_kernel_dkdv(
    Q, K, V, DO, DK, DV, LSE2, DELTA, DQA, TABLE, T_q, qk_scale, sm_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqat, stride_dqah,
    H_KV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQ_ATOMIC: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    item = TABLE + (pid // H_KV) * 8  # work item: [8] int32 (q_start, q_len, k_start, k_len, block_start, 3 unused)
    hk = pid % H_KV
    lk = tl.load(item + 3)  # scalar: the document's key count
    if lk <= 0:  # past the end of the work list
        return
    q0 = tl.load(item + 0)  # scalar: the document's first query row
    lq = tl.load(item + 1)  # scalar: its query count
    k0 = tl.load(item + 2)  # scalar: its first key row
    j0 = tl.load(item + 4)  # scalar: this key block's first key, relative to k0
    off = lk - lq  # bottom-right: query i sees key j iff j <= i + off
    EVEN_D: tl.constexpr = BLOCK_D == D
    offs_n = j0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < lk
    d_ok = offs_d < D
    krows = (k0 + offs_n).to(tl.int64)
    # k, v: [BLOCK_N, BLOCK_D]
    k = _load_tile(K + krows[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], n_ok, d_ok, True, EVEN_D)
    v = _load_tile(V + krows[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], n_ok, d_ok, True, EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Query blocks: [b_lo, b_mid) straddle the diagonal (masked); [b_mid, n_full) see every key of the block
    # (unmasked); [max(b_mid, n_full), n_q) is the document's last, partial query block (masked).
    n_q = (lq + BLOCK_M - 1) // BLOCK_M
    n_full = lq // BLOCK_M
    b_lo = tl.maximum(j0 - off, 0) // BLOCK_M
    b_mid = tl.maximum((tl.maximum(j0 + BLOCK_N - 1 - off, 0) + BLOCK_M - 1) // BLOCK_M, b_lo)
    diag_end = tl.minimum(b_mid, n_q)
    tail_start = tl.maximum(b_mid, n_full)
    for g in range(GROUP):
        qh = (hk * GROUP + g).to(tl.int64)
        q_ptr = Q + qh * stride_qh
        do_ptr = DO + qh * stride_doh
        lse_ptr = LSE2 + qh * T_q
        delta_ptr = DELTA + qh * T_q
        dqa_ptr = DQA + qh * stride_dqah
        dk, dv = _dkdv_steps(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr, stride_qt, stride_dot, stride_dqat,
            q0, lq, off, offs_n, offs_d, d_ok, b_lo, diag_end, qk_scale, sm_scale,
            D, BLOCK_M, True, EVEN_D, DQ_ATOMIC, DOT_PREC,
        )  # fmt: skip
        dk, dv = _dkdv_steps(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr, stride_qt, stride_dot, stride_dqat,
            q0, lq, off, offs_n, offs_d, d_ok, b_mid, n_full, qk_scale, sm_scale,
            D, BLOCK_M, False, EVEN_D, DQ_ATOMIC, DOT_PREC,
        )  # fmt: skip
        dk, dv = _dkdv_steps(
            dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, dqa_ptr, stride_qt, stride_dot, stride_dqat,
            q0, lq, off, offs_n, offs_d, d_ok, tail_start, n_q, qk_scale, sm_scale,
            D, BLOCK_M, True, EVEN_D, DQ_ATOMIC, DOT_PREC,
        )  # fmt: skip
    out_mask = n_ok[:, None] & d_ok[None, :]
    dk_ptrs = DK + krows[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :]
    dv_ptrs = DV + krows[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :]
    tl.store(dk_ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=out_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _dq_steps(
    dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kt, stride_vt, k0, lk, off, offs_m, offs_d, d_ok,
    b_start, b_end, qk_scale,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    for b in range(b_start, b_end):
        offs_n = b * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < lk
        krows = (k0 + offs_n).to(tl.int64)
        # k, v: [BLOCK_N, BLOCK_D]
        k = _load_tile(k_ptr + krows[:, None] * stride_kt + offs_d[None, :], n_ok, d_ok, MASK, EVEN_D)
        v = _load_tile(v_ptr + krows[:, None] * stride_vt + offs_d[None, :], n_ok, d_ok, MASK, EVEN_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])  # [BLOCK_M, BLOCK_N]
        if MASK:
            p = tl.where(n_ok[None, :] & (offs_n[None, :] <= offs_m[:, None] + off), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])  # [BLOCK_M, BLOCK_N]
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_D]
    return dq


@triton.jit(do_not_specialize=["T_q"])
def triton_varlen_bwd_kernel_dq(
    Q, K, V, DO, DQ, LSE2, DELTA, TABLE, T_q, qk_scale, sm_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh, stride_dqt, stride_dqh,
    H_Q: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    item = TABLE + (pid // H_Q) * 8  # work item: [8] int32 (q_start, q_len, k_start, k_len, block_start, 3 unused)
    qh = pid % H_Q
    lq = tl.load(item + 1)  # scalar: the document's query count
    if lq <= 0:  # past the end of the work list
        return
    q0 = tl.load(item + 0)  # scalar: the document's first query row
    k0 = tl.load(item + 2)  # scalar: its first key row
    lk = tl.load(item + 3)  # scalar: its key count
    i0 = tl.load(item + 4)  # scalar: this query block's first query, relative to q0
    off = lk - lq
    hk = qh // GROUP
    EVEN_D: tl.constexpr = BLOCK_D == D
    offs_m = i0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < lq
    d_ok = offs_d < D
    rows = (q0 + offs_m).to(tl.int64)
    # q, do: [BLOCK_M, BLOCK_D]
    q = _load_tile(Q + rows[:, None] * stride_qt + qh * stride_qh + offs_d[None, :], m_ok, d_ok, True, EVEN_D)
    do = _load_tile(DO + rows[:, None] * stride_dot + qh * stride_doh + offs_d[None, :], m_ok, d_ok, True, EVEN_D)
    base = qh.to(tl.int64) * T_q + q0
    lse2 = tl.load(LSE2 + base + offs_m, mask=m_ok, other=float("inf"))  # [BLOCK_M]
    delta = tl.load(DELTA + base + offs_m, mask=m_ok, other=0.0)  # [BLOCK_M]
    # Key blocks [0, n_free) are visible to every row of the block; [n_free, n_all) need the mask.
    n_free = tl.maximum(tl.minimum(i0 + off + 1, lk), 0) // BLOCK_N
    n_all = (tl.maximum(tl.minimum(lk, i0 + BLOCK_M + off), 0) + BLOCK_N - 1) // BLOCK_N
    k_ptr = K + hk * stride_kh
    v_ptr = V + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_steps(
        dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kt, stride_vt, k0, lk, off, offs_m, offs_d, d_ok,
        0, n_free, qk_scale, BLOCK_N, False, EVEN_D, DOT_PREC,
    )  # fmt: skip
    dq = _dq_steps(
        dq, q, do, lse2, delta, k_ptr, v_ptr, stride_kt, stride_vt, k0, lk, off, offs_m, offs_d, d_ok,
        n_free, n_all, qk_scale, BLOCK_N, True, EVEN_D, DOT_PREC,
    )  # fmt: skip
    dq_ptrs = DQ + rows[:, None] * stride_dqt + qh * stride_dqh + offs_d[None, :]
    tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
