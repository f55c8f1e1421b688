"""Indexer scores for Hopper (SM90) in Gluon: one program per (query tile, key tile), wgmma with its epilogue hidden.

Same contract and output as :func:`longtrain.dsa.triton.indexer_topk.indexer_topk_fwd_kernel_scores` (each eligible
score ``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` of a row that needs scores, as an order-preserving 32-bit
key in the row-relative scratch), with the schedule written out:

* the key tile ``[BLOCK_N, D_I]`` stays in shared memory; the two warpgroups split its keys, so each query head's
  ``[BLOCK_M, D_I]`` tile is loaded once for ``BLOCK_N`` keys (the L2 traffic of the queries halves against a
  ``[64, 128]`` tile);
* the query tiles of the heads stream through a ring of ``NUM_BUF`` shared-memory buffers filled by TMA (one
  mbarrier per buffer) or by ``cp.async`` (``IndexerConfig.sm90_loader``), ``NUM_BUF - 2`` heads ahead;
* head ``h``'s logits wgmma is issued before head ``h - 1``'s ``relu`` and weighted sum run on the CUDA cores, so the
  tensor cores never wait for the epilogue (two logits tiles are live: 2 x 64 fp32 registers per thread at
  ``BLOCK_N = 256``). The head sum runs in the same order as the portable kernel's, so the scores are the same.

Gluon kernels do not run in Triton's CPU interpreter; :func:`sm90_scores_unfit` says when this kernel can run
(``IndexerConfig.scores_impl`` picks it).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from longtrain.dsa.triton._common import SM90_TMA_MIN_KEYS
from longtrain.dsa.triton.sparse_mla_fwd_sm90 import _async_load, _cta_barrier, _gather_layout

__all__ = [
    "SM90_SCORES_BLOCK_M",
    "head_group",
    "indexer_topk_fwd_sm90_kernel_scores",
    "indexer_topk_fwd_sm90_scores",
    "sm90_scores_smem_bytes",
    "sm90_scores_unfit",
    "tma_descriptors",
]

# Triton 3.6 names the TMA load ``async_copy_global_to_shared``; later releases call it ``async_load``.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

#: Query rows per program (one wgmma tile of M = 64 per warpgroup).
SM90_SCORES_BLOCK_M = 64


@gluon.constexpr_function
def _mma_k(dtype):
    """The reduction width of one wgmma instruction: 32 bytes of operand (16 for bf16/fp16, 32 for FP8)."""
    return 256 // dtype.primitive_bitwidth


@gluon.jit
def _issue_q(q_rows, q_mask, h, H_I: gl.constexpr, D_I: gl.constexpr, buf):
    """cp.async head ``h``'s query tile ``[BLOCK_M, D_I]`` into ``buf`` (zeros for rows past the chunk and for
    ``h >= H_I``, the ring's tail), as one copy group."""
    live = h < H_I
    _async_load(buf, q_rows + gl.minimum(h, H_I - 1) * D_I, mask=q_mask & live)  # [BLOCK_M, D_I]
    cp.commit_group()


@gluon.jit
def _window(starts_ptr, lens_ptr, rows, row_ok, T_k, topk):
    """Each row's key window clipped to the key rows that exist (as the portable kernel's ``_clip_window``), and
    whether the row needs scores (more eligible keys than K): ``(st, ln, need)``, ``[BLOCK_M]`` each."""
    st = gl.load(starts_ptr + rows, mask=row_ok, other=0).to(gl.int64)  # [BLOCK_M]
    ln = gl.load(lens_ptr + rows, mask=row_ok, other=0).to(gl.int64)  # [BLOCK_M]
    ln = gl.where(st < 0, 0, gl.maximum(gl.minimum(ln, T_k - st), 0))
    st = gl.minimum(gl.maximum(st, 0), gl.maximum(T_k - 1, 0))
    return st, ln, row_ok & (ln > topk)


@gluon.jit
def _head_mma(h, q_bufs, k_t, dead, loader, H_I: gl.constexpr, D_I: gl.constexpr, NUM_BUF: gl.constexpr,
              TMA: gl.constexpr):  # fmt: skip
    """Head ``h``'s step: once its query tile has landed, issue its logits wgmma, then refill head h-2's buffer with
    head ``h + NUM_BUF - 2`` (every warp is past head h-1's wait, so head h-2's wgmma has retired). ``loader``:
    ``(q_rows, q_mask)`` for cp.async (the landed tile made visible to the wgmma by a proxy fence and a CTA barrier),
    ``(q_desc, ready, row0)`` for TMA (each buffer's mbarrier; one CTA barrier before the refill). Returns the
    logits ``[BLOCK_M, BLOCK_N]`` in flight, in the registers of ``dead`` (a tile whose values are no longer
    needed)."""
    nh = h + NUM_BUF - 2
    nb = nh % NUM_BUF
    if TMA:
        q_desc, ready, row0 = loader
        mbarrier.wait(ready.index(h % NUM_BUF), (h // NUM_BUF) & 1)
        s = warpgroup_mma(q_bufs.index(h % NUM_BUF), k_t, dead, use_acc=False, is_async=True)
        _cta_barrier()
        mbarrier.expect(ready.index(nb), q_desc.block_type.nbytes, pred=nh < H_I)
        _tma_load(q_desc, [row0, (nh % H_I) * D_I], ready.index(nb), q_bufs.index(nb),
                                        pred=nh < H_I)  # fmt: skip
    else:
        q_rows, q_mask = loader
        cp.wait_group(NUM_BUF - 3)
        fence_async_shared()
        _cta_barrier()
        s = warpgroup_mma(q_bufs.index(h % NUM_BUF), k_t, dead, use_acc=False, is_async=True)
        _issue_q(q_rows, q_mask, nh, H_I, D_I, q_bufs.index(nb))
    return s


@gluon.jit
def _head_group(h0, n: gl.constexpr, acc, a, b, q_bufs, k_t, loader, w_rows, row_ok, H_I: gl.constexpr,
                D_I: gl.constexpr, NUM_BUF: gl.constexpr, TMA: gl.constexpr):  # fmt: skip
    """Heads ``h0 .. h0 + n - 1`` added into ``acc``; ``a`` and ``b`` are two consumed logits tiles whose registers
    the wgmmas take. Returns ``(acc, a, b)`` with nothing in flight."""
    a = _head_mma(h0, q_bufs, k_t, a, loader, H_I, D_I, NUM_BUF, TMA)  # [BLOCK_M, BLOCK_N], in flight
    w_a = gl.load(w_rows + h0, mask=row_ok, other=0.0)  # [BLOCK_M]
    for j in gl.static_range(1, n):
        b = _head_mma(h0 + j, q_bufs, k_t, b, loader, H_I, D_I, NUM_BUF, TMA)
        w_b = gl.load(w_rows + h0 + j, mask=row_ok, other=0.0)  # [BLOCK_M]
        a = warpgroup_mma_wait(num_outstanding=1, deps=(a,))
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc + gl.maximum(a, 0.0) * w_a[:, None],))
        a, b = b, a
        w_a = w_b
    a = warpgroup_mma_wait(num_outstanding=0, deps=(a,))
    acc += gl.maximum(a, 0.0) * w_a[:, None]
    return acc, a, b


@gluon.jit(do_not_specialize=["row_begin", "row_end", "T_k", "topk", "scratch_stride"])
def indexer_topk_fwd_sm90_kernel_scores(
    q_ptr, k_ptr, w_ptr, ks_ptr, starts_ptr, lens_ptr, scratch_ptr, q_desc, k_desc,
    row_begin, row_end, T_k, topk, scratch_stride,
    H_I: gl.constexpr, D_I: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
    GROUP: gl.constexpr, TMA: gl.constexpr, K_SCALE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    gl.static_assert(num_warps == 8, "two warpgroups splitting the keys")
    gl.static_assert(
        H_I % GROUP == 0,
        "the head groups tile the heads (a remainder group after the loop makes ptxas "
        "serialize the wgmmas): see head_group()",
    )
    gl.static_assert(NUM_BUF >= 3, "a ring of at least three query tiles (one read, one landed, one in flight)")
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, _mma_k(dtype)]
    )
    row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
    LD: gl.constexpr = _gather_layout(D_I, num_warps)

    pid = gl.program_id(0)
    n_kb = gl.cdiv(T_k, BLOCK_N)
    # Key blocks vary fastest: programs running together share their query rows in L2.
    qb = pid // n_kb
    kb = pid % n_kb
    rows = row_begin + qb * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_l)
    row_ok = rows < row_end
    st, ln, need = _window(starts_ptr, lens_ptr, rows, row_ok, T_k, topk)
    k_lo = kb * BLOCK_N
    overlap = need & (st < k_lo + BLOCK_N) & (st + ln > k_lo)
    if gl.max(overlap.to(gl.int32), 0) > 0:
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_I], dtype)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_I], dtype)
        q_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_M, D_I], q_sl)
        k_buf = gl.allocate_shared_memory(dtype, [BLOCK_N, D_I], k_sl)
        if TMA:
            # One mbarrier per ring buffer and one for the key tile; TMA zero-fills rows past the tensors.
            ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
            k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            for j in gl.static_range(NUM_BUF):
                mbarrier.init(ready.index(j), count=1)
            mbarrier.init(k_bar, count=1)
            fence_async_shared()
            _cta_barrier()
            mbarrier.expect(k_bar, k_desc.block_type.nbytes)
            _tma_load(k_desc, [k_lo, 0], k_bar, k_buf)
            row0 = row_begin + qb * BLOCK_M
            for j in gl.static_range(NUM_BUF - 2):
                mbarrier.expect(ready.index(j), q_desc.block_type.nbytes, pred=j < H_I)
                _tma_load(q_desc, [row0, (j % H_I) * D_I], ready.index(j), q_bufs.index(j),
                                                pred=j < H_I)  # fmt: skip
            loader = (q_desc, ready, row0)
            mbarrier.wait(k_bar, 0)
        else:
            cd = gl.arange(0, D_I, layout=gl.SliceLayout(0, LD))
            kr = k_lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
            _async_load(k_buf, k_ptr + kr.to(gl.int64)[:, None] * D_I + cd[None, :], mask=(kr < T_k)[:, None])
            qr = row_begin + qb * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
            q_rows = q_ptr + qr.to(gl.int64)[:, None] * (H_I * D_I) + cd[None, :]
            q_mask = (qr < row_end)[:, None]
            # Prologue: heads 0 .. NUM_BUF-3 in flight (the key tile in head 0's copy group).
            for j in gl.static_range(NUM_BUF - 2):
                _issue_q(q_rows, q_mask, j, H_I, D_I, q_bufs.index(j))
            loader = (q_rows, q_mask)

        w_rows = w_ptr + rows.to(gl.int64) * H_I
        k_t = k_buf.permute((1, 0))  # [D_I, BLOCK_N]
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
        # Heads run in groups of GROUP, unrolled: in a group, head j+1's wgmma is issued before head j's relu and
        # weighted sum, and each wgmma writes the registers of a logits tile already consumed, so no other
        # instruction defines or reads an accumulator in flight (else ptxas serializes every wgmma). Nothing is in
        # flight across the loop's back edge. Each head's sum ends in a no-op wait on ``acc`` that keeps the
        # compiler from moving it past the next wgmma. The head sum runs in head order, as the portable kernel's.
        a = zero
        b = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
        for g in range(0, H_I // GROUP):
            acc, a, b = _head_group(g * GROUP, GROUP, acc, a, b, q_bufs, k_t, loader, w_rows, row_ok, H_I, D_I,
                                    NUM_BUF, TMA)  # fmt: skip
        cp.wait_group(0)

        offs_n = k_lo + gl.arange(0, BLOCK_N, layout=col_l)
        if K_SCALE:  # FP8 keys: each key row's (positive, power-of-two) scale, taken out of the head sum
            acc *= gl.load(ks_ptr + offs_n, mask=offs_n < T_k, other=0.0)[None, :]
        # Order-preserving map float -> uint32 (stored as int32), -0.0 folded into +0.0 (as the portable kernel).
        acc = gl.where(acc == 0.0, 0.0, acc)
        bits = acc.to(gl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) | -2147483648)
        # The windows again (reloaded, not held in registers through the head loop).
        st, ln, need = _window(starts_ptr, lens_ptr, rows, row_ok, T_k, topk)
        cols = offs_n.to(gl.int64)[None, :] - st[:, None]
        eligible = need[:, None] & (cols >= 0) & (cols < ln[:, None])
        out_rows = scratch_ptr + (rows - row_begin).to(gl.int64)[:, None] * scratch_stride
        gl.store(out_rows + cols, key, mask=eligible)  # [BLOCK_M, BLOCK_N]


def indexer_topk_fwd_sm90_scores(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    head_weights: torch.Tensor,
    k_scale: torch.Tensor | None,
    starts: torch.Tensor,
    causal_lengths: torch.Tensor,
    scratch: torch.Tensor,
    row0: int,
    row1: int,
    index_topk: int,
    cfg,
) -> None:
    """Launch :func:`indexer_topk_fwd_sm90_kernel_scores` for query rows ``[row0, row1)`` (what
    ``indexer_topk.indexer_topk_fwd_scores`` does where ``scores_route`` picks this kernel; inputs as it takes them).

    With ``k_scale`` (FP8 codes, E4M3) the kernel runs its TMA loader and applies the key scales after the head sum.
    The library does not route FP8 codes here yet (``benchmarks/dsa_indexer_variants.py --sm90-sweep`` measures it
    against the portable kernel first)."""
    num_heads, head_dim = index_q.shape[1], index_q.shape[2]
    num_keys = index_k.shape[0]
    # TMA needs 16-byte aligned bases (a view at an odd offset takes the cp.async loader: the same scores).
    aligned = index_q.data_ptr() % 16 == 0 and index_k.data_ptr() % 16 == 0
    fp8 = k_scale is not None
    if fp8 and not aligned:
        raise ValueError("the SM90 scoring kernel reads FP8 codes by TMA only: it needs 16-byte aligned q and k codes")
    wants_tma = cfg.sm90_loader == "tma" or (cfg.sm90_loader == "auto" and num_keys >= SM90_TMA_MIN_KEYS)
    tma = fp8 or (wants_tma and aligned)
    # TMA: descriptors of q as [T_q, H_I * D_I] and k; cp.async: the tensors again, unused.
    descs = tma_descriptors(index_q, index_k, cfg.sm90_block_n) if tma else (index_q, index_k)
    grid = (triton.cdiv(row1 - row0, SM90_SCORES_BLOCK_M) * triton.cdiv(max(num_keys, 1), cfg.sm90_block_n),)
    indexer_topk_fwd_sm90_kernel_scores[grid](
        index_q, index_k, head_weights, k_scale if fp8 else head_weights, starts, causal_lengths, scratch, *descs,
        row0, row1, num_keys, index_topk, scratch.stride(0), H_I=num_heads, D_I=head_dim, BLOCK_M=SM90_SCORES_BLOCK_M,
        BLOCK_N=cfg.sm90_block_n, NUM_BUF=cfg.sm90_num_buf, GROUP=head_group(num_heads, cfg.sm90_group), TMA=tma,
        K_SCALE=fp8, num_warps=8,
    )  # fmt: skip


def tma_descriptors(index_q: torch.Tensor, index_k: torch.Tensor, block_n: int) -> tuple:
    """Host TMA descriptors of ``index_q`` (as ``[T_q, H_I * D_I]``, boxes of one head's ``[64, D_I]``) and
    ``index_k`` (``[T_k, D_I]``, boxes of ``[block_n, D_I]``), in the shared layouts the kernel's buffers use."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[index_q.dtype]
    num_queries, num_heads, head_dim = index_q.shape
    q2 = index_q.view(num_queries, num_heads * head_dim)
    q_layout = gl.NVMMASharedLayout.get_default_for([SM90_SCORES_BLOCK_M, head_dim], gdt)
    k_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gdt)
    return (
        TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [SM90_SCORES_BLOCK_M, head_dim], q_layout),
        TensorDescriptor(index_k, list(index_k.shape), list(index_k.stride()), [block_n, head_dim], k_layout),
    )


def head_group(num_heads: int, most: int) -> int:
    """Heads per unrolled step of the kernel's head loop: the largest divisor of ``num_heads`` up to ``most``, or
    all heads when there are at most 16 (a group of one head cannot overlap its sum with the next head's wgmma)."""
    if num_heads <= 16:
        return num_heads
    return max(d for d in range(1, most + 1) if num_heads % d == 0)


def sm90_scores_smem_bytes(block_n: int, num_buf: int, head_dim: int, elem_bytes: int = 2) -> int:
    """Shared memory of one program: the key tile and the ring of query tiles."""
    return (block_n + num_buf * SM90_SCORES_BLOCK_M) * head_dim * elem_bytes


def sm90_scores_unfit(
    device: torch.device, dtype: torch.dtype, head_dim: int, fp8: bool, block_n: int, num_buf: int
) -> str | None:
    """``None`` when :func:`indexer_topk_fwd_sm90_kernel_scores` scores ``index_q`` of ``dtype`` with head width
    ``head_dim`` on ``device`` with ``block_n`` keys per program and ``num_buf`` query tiles, else why not."""
    from longtrain.dsa.triton.sparse_mla_fwd import SM90_SMEM_BYTES

    if device.type != "cuda":
        return f"it runs on CUDA SM90 GPUs, not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"it needs an SM90 (Hopper) GPU, {device} is SM{major}{minor}"
    if fp8:
        return "it scores bf16/fp16 operands (FP8 codes run on the portable kernel)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"it takes bf16/fp16 inputs, got {dtype}"
    if head_dim not in (64, 128, 256):
        return f"it needs D_I of 64, 128 or 256, got {head_dim}"
    smem = sm90_scores_smem_bytes(block_n, num_buf, head_dim)
    if smem > SM90_SMEM_BYTES:
        return (
            f"{block_n} keys x {num_buf} query tiles at D_I={head_dim} need {smem} bytes of shared memory, more than "
            f"the {SM90_SMEM_BYTES} an SM90 program gets: lower sm90_block_n or sm90_num_buf"
        )
    return None
