"""Sparse MLA forward: one program per (query row, head block), gathered KV tiles shared by all its heads.

Each program streams its row's top-k slots ``BLOCK_K`` at a time: the gathered latent rows
``kv[idx, :D_V]`` (value, and the first part of the key) and ``kv[idx, D_V:]`` (the rope tail of the key)
are loaded once and feed both ``Q K^T`` and ``P V`` for every head of the block, with an fp32 online
softmax (base 2). Program ids run over head blocks fastest, then query rows, so programs that run together
work on neighbouring queries whose index sets overlap and find their gathered rows in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longtrain.dsa.triton._common import KernelConfig, dot_precision, interpreting, next_pow2

__all__ = [
    "SM90_FWD_DEFAULT",
    "SM90_SMEM_BYTES",
    "SM90_WS_DEFAULT",
    "fwd_block_h",
    "sm90_forward_kind",
    "sparse_mla_fwd",
    "sparse_mla_fwd_kernel",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# (block_k, num_warps, num_stages, layout): candidates the autotuner tries for the (H, D) of a model, once: the
# fastest of the sweep at the GLM-5.2 shape (benchmarks/results/dsa_fwd_sweep_2026-11-29.md has the timings); the
# one-stage configs stay for GPUs whose shared memory cannot hold two 64-row tiles (SM80: 164 KiB).
_FWD_CANDIDATES = ((128, 8, 1, 1), (128, 8, 1, 2), (64, 8, 1, 0), (64, 8, 2, 0))
# (block_k, tiles in flight): candidates of the SM90 kernel (sparse_mla_fwd_sm90.py), tried where it applies, the
# fastest of the same sweep first; 32-row tiles cover rope tails up to 128.
_SM90_CANDIDATES = ((64, 2), (32, 4), (32, 3))
_LAYOUTS = {"heads": 0, "keys": 1, "keys_logits": 2}
# Shared memory an SM90 block may use (227 KiB), and that minus what the two-warpgroup kernel needs beside its tiles.
SM90_SMEM_LIMIT = 232448
SM90_SMEM_BYTES = SM90_SMEM_LIMIT - 8192
# The SM90 forward that config=None runs where it applies: "heads" (sparse_mla_fwd_sm90.py, autotuned over
# _SM90_CANDIDATES), "warp_specialized" (sparse_mla_fwd_sm90_ws.py at SM90_WS_DEFAULT = (block_k, tiles)) or
# "ping_pong" (sparse_mla_fwd_sm90_pp.py); where the chosen kernel cannot run, the next one in that order backwards.
SM90_FWD_DEFAULT = "warp_specialized"
SM90_WS_DEFAULT = (64, 2)


@triton.jit
def _row_col_mask(row_mask, offs_c, N: tl.constexpr, BLOCK: tl.constexpr):
    """``row_mask[:, None] & (offs_c < N)[None, :]``, without the column part when it is all true.

    A mask that is constant along the contiguous dim keeps the 16-byte vector loads.
    """
    if BLOCK == N:
        return row_mask[:, None]
    else:
        return row_mask[:, None] & (offs_c < N)[None, :]


@triton.jit(do_not_specialize=["T_k", "K_slots"])
def sparse_mla_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, lse_ptr,
    T_k, K_slots, qk_scale,
    H: tl.constexpr, D_V: tl.constexpr, D_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    HAS_LEN: tl.constexpr, HAS_SINK: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_K: tl.constexpr, LAYOUT: tl.constexpr, IDX_AHEAD: tl.constexpr,
):  # fmt: skip
    D_QK: tl.constexpr = D_V + D_R
    NUM_HB: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    t = (pid // NUM_HB).to(tl.int64)
    hb = pid % NUM_HB

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, BLOCK_DR)
    mask_h = offs_h < H

    q_rows = q_ptr + t * (H * D_QK) + offs_h[:, None] * D_QK
    qv_mask = _row_col_mask(mask_h, offs_v, D_V, BLOCK_DV)
    q_v = tl.load(q_rows + offs_v[None, :], mask=qv_mask, other=0.0)  # [BLOCK_H, BLOCK_DV]
    if D_R > 0:
        qr_mask = _row_col_mask(mask_h, offs_r, D_R, BLOCK_DR)
        q_r = tl.load(q_rows + D_V + offs_r[None, :], mask=qr_mask, other=0.0)  # [BLOCK_H, BLOCK_DR]

    if HAS_LEN:
        n_slots = tl.minimum(tl.maximum(tl.load(len_ptr + t).to(tl.int32), 0), K_slots)  # scalar
    else:
        n_slots = K_slots

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    # LAYOUT 0: logits [heads, keys]; 1: logits [keys, heads], output accumulated as [d_v, heads];
    # 2: logits [keys, heads], output [heads, d_v]. With 8 warps and 64 heads, [keys, heads] logits let the
    # two warpgroups split the keys instead of both computing the same [heads, keys] tile.
    if LAYOUT == 1:
        acc = tl.zeros([BLOCK_DV, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    idx_row = idx_ptr + t * K_slots
    offs_k = tl.arange(0, BLOCK_K)
    if IDX_AHEAD:
        # The slot indices of step i+1 are loaded during step i: the gathered KV loads then depend on a
        # loop-carried value, not on a load of the same step, so with num_stages >= 2 the software pipeliner
        # turns them into cp.async copies one more buffer deep (the index load needs no stage of its own).
        idx_next = tl.load(idx_row + offs_k, mask=offs_k < n_slots, other=-1)  # [BLOCK_K]
    for k0 in range(0, n_slots, BLOCK_K):
        if IDX_AHEAD:
            in_len = offs_k < n_slots - k0
            idx = idx_next
            next_ok = offs_k < n_slots - k0 - BLOCK_K
            idx_next = tl.load(idx_row + BLOCK_K + k0 + offs_k, mask=next_ok, other=-1)  # [BLOCK_K]
        else:
            offs = k0 + offs_k
            in_len = offs < n_slots
            idx = tl.load(idx_row + offs, mask=in_len, other=-1)  # [BLOCK_K]
        valid = in_len & (idx >= 0) & (idx < T_k)
        kv_rows = kv_ptr + tl.where(valid, idx, 0).to(tl.int64) * D_QK
        kvv_mask = _row_col_mask(valid, offs_v, D_V, BLOCK_DV)
        kv_v = tl.load(kv_rows[:, None] + offs_v[None, :], mask=kvv_mask, other=0.0)  # [BLOCK_K, BLOCK_DV]
        if D_R > 0:
            kvr_mask = _row_col_mask(valid, offs_r, D_R, BLOCK_DR)
            kv_r = tl.load(kv_rows[:, None] + D_V + offs_r[None, :], mask=kvr_mask, other=0.0)  # [BLOCK_K, BLOCK_DR]
        if LAYOUT != 0:
            s = tl.dot(kv_v, tl.trans(q_v), input_precision=DOT_PREC)  # [BLOCK_K, BLOCK_H]
            if D_R > 0:
                s = tl.dot(kv_r, tl.trans(q_r), s, input_precision=DOT_PREC)
            s = tl.where(valid[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(s - m_use[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            if LAYOUT == 1:
                acc = acc * alpha[None, :]
                acc = tl.dot(tl.trans(kv_v), p.to(kv_v.dtype), acc, input_precision=DOT_PREC)
            else:
                acc = acc * alpha[:, None]
                acc = tl.dot(tl.trans(p.to(kv_v.dtype)), kv_v, acc, input_precision=DOT_PREC)
        else:
            s = tl.dot(q_v, tl.trans(kv_v), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_K]
            if D_R > 0:
                s = tl.dot(q_r, tl.trans(kv_r), s, input_precision=DOT_PREC)
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no valid slot yet keeps m = -inf; shifting by 0 gives p = alpha = 0, not NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(kv_v.dtype), kv_v, acc, input_precision=DOT_PREC)
        m_i = m_new

    has_keys = l_i > 0.0
    denom = l_i
    if HAS_SINK:
        # The sink is one more logit with a zero value: it only enlarges the denominator.
        sink = tl.load(sink_ptr + offs_h, mask=mask_h, other=float("-inf")) * 1.4426950408889634  # [BLOCK_H]
        denom = l_i + tl.math.exp2(sink - tl.where(m_i == float("-inf"), 0.0, m_i))
    inv = tl.where(has_keys, 1.0 / tl.where(has_keys, denom, 1.0), 0.0)
    if LAYOUT == 1:
        out = tl.trans(acc * inv[None, :])
    else:
        out = acc * inv[:, None]
    lse = tl.where(has_keys, (m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))

    out_rows = out_ptr + t * (H * D_V) + offs_h[:, None] * D_V
    tl.store(
        out_rows + offs_v[None, :], out.to(out_ptr.dtype.element_ty), mask=_row_col_mask(mask_h, offs_v, D_V, BLOCK_DV)
    )
    tl.store(lse_ptr + t * H + offs_h, lse, mask=mask_h)


def fwd_block_h(num_heads: int, cfg_block_h: int = 64) -> int:
    """Heads per program: all heads up to ``cfg_block_h`` (never fewer than 16, the smallest MMA tile)."""
    return max(16, min(cfg_block_h, next_pow2(num_heads)))


_AUTOTUNED: dict[str, object] = {}


def _autotuned_fwd():
    kernel = _AUTOTUNED.get("fwd")
    if kernel is None:
        configs = [
            triton.Config({"BLOCK_K": bk, "LAYOUT": layout, "IDX_AHEAD": s > 1}, num_warps=w, num_stages=s)
            for bk, w, s, layout in _FWD_CANDIDATES
        ]
        # Static model dims only: token counts never re-trigger tuning.
        kernel = triton.autotune(configs=configs, key=["H", "D_V", "D_R", "BLOCK_H"])(sparse_mla_fwd_kernel)
        _AUTOTUNED["fwd"] = kernel
    return kernel


def _sm90_fits(block_k: int, num_buf: int, d_qk: int, itemsize: int) -> bool:
    return (64 + num_buf * block_k) * d_qk * itemsize <= SM90_SMEM_BYTES


def _autotuned_sm90():
    kernel = _AUTOTUNED.get("fwd_sm90")
    if kernel is None:
        from longtrain.dsa.triton.sparse_mla_fwd_sm90 import sparse_mla_fwd_sm90_kernel

        configs = [
            triton.Config({"BLOCK_K": bk, "NUM_BUF": nb, "SPLIT_KEYS": True}, num_warps=8)
            for bk, nb in _SM90_CANDIDATES
        ]

        def prune(configs, named_args, **kwargs):
            d_qk = kwargs["D_V"] + kwargs["D_R"]
            size = named_args["q_ptr"].element_size()
            fit = [c for c in configs if _sm90_fits(c.kwargs["BLOCK_K"], c.kwargs["NUM_BUF"], d_qk, size)]
            return fit or configs[-1:]

        kernel = triton.autotune(
            configs=configs, key=["H", "D_V", "D_R"], prune_configs_by={"early_config_prune": prune}
        )(sparse_mla_fwd_sm90_kernel)
        _AUTOTUNED["fwd_sm90"] = kernel
    return kernel


def _launch_sm90(q, kv2d, idx, qk_scale, d_v, topk_length, attn_sink, out, lse, config) -> None:
    from longtrain.dsa.triton.sparse_mla_fwd_sm90 import sm90_unsupported_reason, sparse_mla_fwd_sm90_kernel

    num_tokens, num_heads, d_qk = q.shape
    grid = (num_tokens * triton.cdiv(num_heads, 64),)
    args = (
        q, kv2d, idx,
        topk_length if topk_length is not None else idx,
        attn_sink if attn_sink is not None else q,
        out, lse, kv2d.shape[0], idx.shape[1], qk_scale,
    )  # fmt: skip
    meta = dict(H=num_heads, D_V=d_v, D_R=d_qk - d_v, HAS_LEN=topk_length is not None, HAS_SINK=attn_sink is not None)
    kind = sm90_forward_kind(q, d_v) if config is None else None
    if kind == "ping_pong" or config is not None and config.layout == "ping_pong":
        reason = None if kind == "ping_pong" else _pp_reason(q, d_v)  # the default's was checked by its routing
        if reason is not None:
            raise RuntimeError(
                f"KernelConfig(impl='sm90', layout='ping_pong') cannot run here: {reason}; use "
                "layout='warp_specialized' or impl='triton'"
            )
        _launch_sm90_pp(grid, args, meta)
        return
    if kind == "warp_specialized":
        _launch_sm90_ws(grid, args, meta, *SM90_WS_DEFAULT)
        return
    if config is None:
        _autotuned_sm90()[grid](*args, **meta)
        return
    if config.layout == "warp_specialized":
        reason = _ws_reason(q, d_v, config.block_k, config.num_stages)
        if reason is not None:
            raise RuntimeError(
                f"KernelConfig(impl='sm90', layout='warp_specialized') cannot run here: {reason}; use layout='heads' "
                "or impl='triton'"
            )
        _launch_sm90_ws(grid, args, meta, config.block_k, config.num_stages)
        return
    reason = "Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1)" if interpreting() else None
    reason = reason or sm90_unsupported_reason(q, d_v)
    if reason is None and not _sm90_fits(config.block_k, config.num_stages, d_qk, q.element_size()):
        reason = (
            f"{config.num_stages} tiles of {config.block_k} rows plus 64 query heads of D_qk={d_qk} exceed the "
            "227 KiB of shared memory; lower block_k or num_stages"
        )
    if reason is not None:
        raise RuntimeError(f"KernelConfig(impl='sm90') cannot run here: {reason}; use impl='triton'")
    sparse_mla_fwd_sm90_kernel[grid](
        *args, **meta, BLOCK_K=config.block_k, NUM_BUF=config.num_stages, SPLIT_KEYS=True, num_warps=8
    )


def _ws_reason(q: torch.Tensor, d_v: int, block_k: int, num_buf: int) -> str | None:
    """``None`` when the warp-specialized SM90 forward runs ``q`` with this ring, else why not."""
    if interpreting():
        return "Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1)"
    from longtrain.dsa.triton.sparse_mla_fwd_sm90_ws import ws_smem_bytes, ws_unsupported_reason

    reason = ws_unsupported_reason(q, d_v)
    if reason is None and num_buf < 2:
        reason = f"it streams a ring of num_stages >= 2 tiles, got num_stages={num_buf}"
    if reason is None and ws_smem_bytes(block_k, num_buf, q.shape[2], q.element_size()) > SM90_SMEM_LIMIT:
        reason = (
            f"{num_buf} tiles of {block_k} rows plus 64 query heads of D_qk={q.shape[2]} and the shared P exceed the "
            "227 KiB of shared memory; lower block_k or num_stages"
        )
    return reason


def _pp_reason(q: torch.Tensor, d_v: int) -> str | None:
    """``None`` when the ping-pong SM90 forward runs ``q [T, H, D_qk]`` with value width ``d_v``, else why not: the
    warp-specialized kernel's rules and shared memory for the queries, two tiles and the shared probabilities."""
    if interpreting():
        return "Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1)"
    from longtrain.dsa.triton.sparse_mla_fwd_sm90_pp import pp_smem_bytes
    from longtrain.dsa.triton.sparse_mla_fwd_sm90_ws import ws_unsupported_reason

    reason = ws_unsupported_reason(q, d_v)
    if reason is None and pp_smem_bytes(q.shape[2], d_v, q.element_size()) > SM90_SMEM_LIMIT:
        reason = (
            f"64 query heads and two tiles of 64 rows of D_qk={q.shape[2]} with the shared probabilities exceed the "
            "227 KiB of shared memory"
        )
    return reason


def _launch_sm90_pp(grid, args, meta) -> None:
    from longtrain.dsa.triton import sparse_mla_fwd_sm90_pp as pp

    pp.sparse_mla_fwd_sm90_pp_kernel[grid](
        *args, **meta, REGS_WG1=pp.PP_NUM_REGS[0], REGS_PRODUCER=pp.PP_NUM_REGS[1], num_warps=4,
        maxnreg=pp.PP_MAXNREG,
    )  # fmt: skip


def _launch_sm90_ws(grid, args, meta, block_k: int, num_buf: int) -> None:
    from longtrain.dsa.triton import sparse_mla_fwd_sm90_ws as ws

    num_items = grid[0]
    q = args[0]
    programs, run = ws.ws_schedule(num_items, q.device)
    # The kernel takes the query count before the key count, and the item counter: (..., lse, T_q, T_k, K_slots,
    # qk_scale, cnt); the counter is read only by dynamic programs (RUN = -1).
    cnt = torch.zeros(1, dtype=torch.int32, device=q.device) if run == -1 else args[2]
    args = (*args[:7], q.shape[0], *args[7:], cnt)
    ws.sparse_mla_fwd_sm90_ws_kernel[(programs,)](
        *args, **meta, BLOCK_K=block_k, NUM_BUF=num_buf, REGS_RIGHT=ws.WS_NUM_REGS[0],
        REGS_PRODUCER=ws.WS_NUM_REGS[1], RUN=run, PREFETCH_IDX=ws.WS_PREFETCH_IDX,
        PREFETCH_Q=ws.WS_PREFETCH_Q and programs < num_items, STAGED_OUT=ws.WS_STAGED_OUT and block_k >= 64,
        num_warps=4, maxnreg=ws.WS_MAXNREG,
    )  # fmt: skip


def sparse_mla_fwd(
    q: torch.Tensor,
    kv2d: torch.Tensor,
    idx: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    config: KernelConfig | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on validated, contiguous inputs.

    ``config=None`` runs the SM90 kernel (``sparse_mla_fwd_sm90.py``) where it applies, else the autotuned
    portable kernel; a ``KernelConfig`` forces one kernel and launch configuration.

    Args:
        q: ``[T, H, D_qk]``; kv2d: ``[T_k, D_qk]``; idx: ``[T, K] int32``; topk_length: ``[T]`` or None;
        attn_sink: ``[H] fp32`` or None.

    Returns:
        ``(out [T, H, d_v]`` in ``q.dtype``, ``lse [T, H] fp32`` natural log, ``-inf`` on rows without keys).
    """
    num_tokens, num_heads, d_qk = q.shape
    d_r = d_qk - d_v
    out = torch.empty((num_tokens, num_heads, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out, lse
    if config is not None and config.impl == "sm90" or config is None and _sm90_default(q, d_v):
        _launch_sm90(q, kv2d, idx, softmax_scale * LOG2E, d_v, topk_length, attn_sink, out, lse, config)
        return out, lse
    block_h = fwd_block_h(num_heads, config.block_h if config is not None else 64)
    grid = (num_tokens * triton.cdiv(num_heads, block_h),)
    dummy = idx
    args = (
        q, kv2d, idx,
        topk_length if topk_length is not None else dummy,
        attn_sink if attn_sink is not None else q,
        out, lse,
        kv2d.shape[0], idx.shape[1], softmax_scale * LOG2E,
    )  # fmt: skip
    meta = dict(
        H=num_heads,
        D_V=d_v,
        D_R=d_r,
        BLOCK_H=block_h,
        BLOCK_DV=next_pow2(d_v),
        BLOCK_DR=next_pow2(d_r) if d_r > 0 else 16,
        HAS_LEN=topk_length is not None,
        HAS_SINK=attn_sink is not None,
        DOT_PREC=dot_precision(q.dtype),
    )
    if config is None and interpreting():
        config = KernelConfig(block_k=16, num_warps=4, num_stages=1)
    if config is not None:
        sparse_mla_fwd_kernel[grid](
            *args,
            **meta,
            BLOCK_K=config.block_k,
            LAYOUT=_LAYOUTS[config.layout],
            IDX_AHEAD=config.num_stages > 1,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    else:
        _autotuned_fwd()[grid](*args, **meta)
    return out, lse


def sm90_forward_kind(q: torch.Tensor, d_v: int) -> str | None:
    """The SM90 forward ``config=None`` runs for ``q [T, H, D_qk]``: ``SM90_FWD_DEFAULT`` where it applies, else the
    next of ``"ping_pong"`` (``sparse_mla_fwd_sm90_pp.py``), ``"warp_specialized"`` (``sparse_mla_fwd_sm90_ws.py``
    at ``SM90_WS_DEFAULT``) and ``"heads"`` (``sparse_mla_fwd_sm90.py``, autotuned) after it, or ``None`` where no
    SM90 kernel applies (the portable kernel runs)."""
    if not _sm90_default(q, d_v):
        return None
    if SM90_FWD_DEFAULT == "ping_pong" and _pp_reason(q, d_v) is None:
        return "ping_pong"
    if SM90_FWD_DEFAULT in ("ping_pong", "warp_specialized") and _ws_reason(q, d_v, *SM90_WS_DEFAULT) is None:
        return "warp_specialized"
    return "heads"


def _sm90_default(q: torch.Tensor, d_v: int) -> bool:
    if interpreting() or q.device.type != "cuda":
        return False
    from longtrain.dsa.triton.sparse_mla_fwd_sm90 import sm90_unsupported_reason

    return sm90_unsupported_reason(q, d_v) is None
