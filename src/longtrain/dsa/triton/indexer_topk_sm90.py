"""Indexer scores for Hopper (SM90) in Gluon: one program per (query tile, key tile), wgmma with its epilogue hidden.

Same contract and output as :func:`longtrain.dsa.triton.indexer_topk.indexer_topk_fwd_kernel_scores` (each eligible
score ``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` of a row that needs scores, as an order-preserving 32-bit
key in the row-relative scratch), with the schedule written out:

* the key tile ``[BLOCK_N, D_I]`` stays in shared memory; the two warpgroups split its keys, so each query head's
  ``[BLOCK_M, D_I]`` tile is loaded once for ``BLOCK_N`` keys (the L2 traffic of the queries halves against a
  ``[64, 128]`` tile);
* the query tiles of the heads stream through a ring of ``NUM_BUF`` shared-memory buffers filled by ``cp.async``,
  ``NUM_BUF - 2`` heads ahead;
* head ``h``'s logits wgmma is issued before head ``h - 1``'s ``relu`` and weighted sum run on the CUDA cores, so the
  tensor cores never wait for the epilogue (two logits tiles are live: 2 x 64 fp32 registers per thread at
  ``BLOCK_N = 256``). The head sum runs in the same order as the portable kernel's, so the scores are the same.

Gluon kernels do not run in Triton's CPU interpreter; :func:`sm90_scores_unfit` says when this kernel can run
(``IndexerConfig.scores_impl`` picks it).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from longtrain.dsa.triton.sparse_mla_fwd_sm90 import _async_load, _cta_barrier, _gather_layout

__all__ = [
    "SM90_SCORES_BLOCK_M",
    "head_group",
    "key_tiles",
    "indexer_topk_fwd_sm90_kernel_scores",
    "sm90_scores_smem_bytes",
    "sm90_scores_unfit",
]

#: Query rows per program (one wgmma tile of M = 64 per warpgroup).
SM90_SCORES_BLOCK_M = 64


@gluon.jit
def _issue_q(q_rows, q_mask, v, H_I: gl.constexpr, D_I: gl.constexpr, n_steps, buf):
    """cp.async step ``v``'s query tile (head ``v % H_I``, ``[BLOCK_M, D_I]``) into ``buf`` as one copy group (zeros
    for rows past the chunk and for ``v >= n_steps``, the ring's tail)."""
    _async_load(buf, q_rows + (v % H_I) * D_I, mask=q_mask & (v < n_steps))  # [BLOCK_M, D_I]
    cp.commit_group()


@gluon.jit
def _issue_k(k_ptr, kb, T_k, buf, BLOCK_N: gl.constexpr, D_I: gl.constexpr, LD: gl.constexpr):
    """cp.async key tile ``kb`` (``[BLOCK_N, D_I]``, zeros past ``T_k``) into ``buf``, in the open copy group."""
    cd = gl.arange(0, D_I, layout=gl.SliceLayout(0, LD))
    kr = kb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    _async_load(buf, k_ptr + kr.to(gl.int64)[:, None] * D_I + cd[None, :], mask=(kr < T_k)[:, None])


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
def _head_mma(v, q_bufs, k_t, dead, q_rows, q_mask, n_steps, k_next, H_I: gl.constexpr, D_I: gl.constexpr,
              NUM_BUF: gl.constexpr, K_NEXT: gl.constexpr, BLOCK_N: gl.constexpr, LD: gl.constexpr):  # fmt: skip
    """Step ``v``: once its query tile has landed (every thread's copies visible, every warp past step v-1's wait,
    so step v-2's buffer is free), issue its logits wgmma, then (with ``K_NEXT``) the next key tile
    ``k_next = (k_ptr, kb, T_k, buf)`` and the refill of step v-2's buffer with step ``v + NUM_BUF - 2``, one copy
    group. Returns the logits ``[BLOCK_M, BLOCK_N]`` in flight, in the registers of ``dead`` (a tile whose values are
    no longer needed)."""
    cp.wait_group(NUM_BUF - 3)
    fence_async_shared()
    _cta_barrier()
    s = warpgroup_mma(q_bufs.index(v % NUM_BUF), k_t, dead, use_acc=False, is_async=True)
    if K_NEXT:
        _issue_k(k_next[0], k_next[1], k_next[2], k_next[3], BLOCK_N, D_I, LD)
    _issue_q(q_rows, q_mask, v + NUM_BUF - 2, H_I, D_I, n_steps, q_bufs.index((v + NUM_BUF - 2) % NUM_BUF))
    return s


@gluon.jit
def _head_group(v0, h0, n: gl.constexpr, acc, a, b, q_bufs, k_t, q_rows, q_mask, n_steps, w_rows, row_ok, k_next,
                H_I: gl.constexpr, D_I: gl.constexpr, NUM_BUF: gl.constexpr, K_NEXT: gl.constexpr,
                BLOCK_N: gl.constexpr, LD: gl.constexpr):  # fmt: skip
    """Heads ``h0 .. h0 + n - 1`` (steps ``v0 ..``) added into ``acc``; ``a`` and ``b`` are two consumed logits tiles
    whose registers the wgmmas take; the first step also issues ``k_next`` with ``K_NEXT``. Returns ``(acc, a, b)``
    with nothing in flight."""
    a = _head_mma(v0, q_bufs, k_t, a, q_rows, q_mask, n_steps, k_next, H_I, D_I, NUM_BUF, K_NEXT, BLOCK_N,
                  LD)  # fmt: skip
    w_a = gl.load(w_rows + h0, mask=row_ok, other=0.0)  # [BLOCK_M]
    for j in gl.static_range(1, n):
        b = _head_mma(v0 + j, q_bufs, k_t, b, q_rows, q_mask, n_steps, k_next, H_I, D_I, NUM_BUF, False, BLOCK_N,
                      LD)  # fmt: skip
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
    q_ptr, k_ptr, w_ptr, ks_ptr, starts_ptr, lens_ptr, scratch_ptr,
    row_begin, row_end, T_k, topk, scratch_stride,
    H_I: gl.constexpr, D_I: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_BUF: gl.constexpr,
    GROUP: gl.constexpr, KEY_TILES: gl.constexpr, K_SCALE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    gl.static_assert(num_warps == 8, "two warpgroups splitting the keys")
    gl.static_assert(
        H_I % GROUP == 0,
        "the head groups tile the heads (a remainder group after the loop makes ptxas "
        "serialize the wgmmas): see head_group()",
    )
    gl.static_assert(NUM_BUF >= 3, "a ring of at least three query tiles (one read, one landed, one in flight)")
    gl.static_assert(KEY_TILES == 1 or H_I >= NUM_BUF - 2, "the next key tile lands within one tile's head steps")
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
    LD: gl.constexpr = _gather_layout(D_I, num_warps)

    pid = gl.program_id(0)
    # A program scores the tiles of KEY_TILES consecutive key blocks that some row of its query block needs, one
    # after the other (the next key tile loads under the current one's heads, the query ring runs on across tiles).
    n_kc = gl.cdiv(T_k, BLOCK_N * KEY_TILES)
    # Key chunks vary fastest: programs running together share their query rows in L2.
    qb = pid // n_kc
    kc = pid % n_kc
    rows = row_begin + qb * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_l)
    row_ok = rows < row_end
    st, ln, need = _window(starts_ptr, lens_ptr, rows, row_ok, T_k, topk)
    lo = gl.min(gl.where(need, st, T_k), 0)  # first key any row needs
    hi = gl.max(gl.where(need, st + ln, 0), 0)  # past the last one
    kb_first = gl.maximum(kc * KEY_TILES, lo // BLOCK_N)
    kb_end = gl.minimum((kc + 1) * KEY_TILES, gl.cdiv(hi, BLOCK_N))
    if kb_end > kb_first:
        n_tiles = (kb_end - kb_first).to(gl.int32)
        n_steps = n_tiles * H_I
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D_I], dtype)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_I], dtype)
        q_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF, BLOCK_M, D_I], q_sl)
        k_bufs = gl.allocate_shared_memory(dtype, [2 if KEY_TILES > 1 else 1, BLOCK_N, D_I], k_sl)

        _issue_k(k_ptr, kb_first, T_k, k_bufs.index(0), BLOCK_N, D_I, LD)
        cd = gl.arange(0, D_I, layout=gl.SliceLayout(0, LD))
        qr = row_begin + qb * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
        q_rows = q_ptr + qr.to(gl.int64)[:, None] * (H_I * D_I) + cd[None, :]
        q_mask = (qr < row_end)[:, None]
        # Prologue: steps 0 .. NUM_BUF-3 in flight (the first key tile in step 0's copy group).
        for j in gl.static_range(NUM_BUF - 2):
            _issue_q(q_rows, q_mask, j, H_I, D_I, n_steps, q_bufs.index(j))

        w_rows = w_ptr + rows.to(gl.int64) * H_I
        # Heads run in groups of GROUP, unrolled: in a group, head j+1's wgmma is issued before head j's relu and
        # weighted sum, and each wgmma writes the registers of a logits tile already consumed, so no other
        # instruction defines or reads an accumulator in flight (else ptxas serializes every wgmma). Nothing is in
        # flight across a loop's back edge. Each head's sum ends in a no-op wait on ``acc`` that keeps the compiler
        # from moving it past the next wgmma. The head sum runs in head order, as the portable kernel's.
        for i in range(n_tiles):
            kb = kb_first + i
            k_t = k_bufs.index(i % 2 if KEY_TILES > 1 else 0).permute((1, 0))  # [D_I, BLOCK_N]
            # The next key tile goes into step i * H_I's copy group, after that step's barrier (every warp is done
            # with tile i-1, whose buffer it takes); that group has landed by tile i+1's first step.
            k_next = (k_ptr, kb + 1, T_k, k_bufs.index((i + 1) % 2 if KEY_TILES > 1 else 0))
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
            a = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
            b = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=acc_layout)
            acc, a, b = _head_group(i * H_I, 0, GROUP, acc, a, b, q_bufs, k_t, q_rows, q_mask, n_steps, w_rows, row_ok,
                                    k_next, H_I, D_I, NUM_BUF, KEY_TILES > 1, BLOCK_N, LD)  # fmt: skip
            for g in range(1, H_I // GROUP):
                acc, a, b = _head_group(i * H_I + g * GROUP, g * GROUP, GROUP, acc, a, b, q_bufs, k_t, q_rows, q_mask,
                                        n_steps, w_rows, row_ok, k_next, H_I, D_I, NUM_BUF, False, BLOCK_N,
                                        LD)  # fmt: skip
            offs_n = kb * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
            if K_SCALE:  # FP8 keys: each key row's (positive, power-of-two) scale, taken out of the head sum
                acc *= gl.load(ks_ptr + offs_n, mask=offs_n < T_k, other=0.0)[None, :]
            # Order-preserving map float -> uint32 (as int32), -0.0 folded into +0.0 (as the portable kernel).
            acc = gl.where(acc == 0.0, 0.0, acc)
            bits = acc.to(gl.int32, bitcast=True)
            key = bits ^ ((bits >> 31) | -2147483648)
            # The windows again (reloaded, not held in registers through the head loop).
            st, ln, need = _window(starts_ptr, lens_ptr, rows, row_ok, T_k, topk)
            cols = offs_n.to(gl.int64)[None, :] - st[:, None]
            eligible = need[:, None] & (cols >= 0) & (cols < ln[:, None])
            out_rows = scratch_ptr + (rows - row_begin).to(gl.int64)[:, None] * scratch_stride
            gl.store(out_rows + cols, key, mask=eligible)  # [BLOCK_M, BLOCK_N]
        cp.wait_group(0)


def head_group(num_heads: int, most: int) -> int:
    """Heads per unrolled step of the kernel's head loop: the largest divisor of ``num_heads`` up to ``most``, or
    all heads when there are at most 16 (a group of one head cannot overlap its sum with the next head's wgmma)."""
    if num_heads <= 16:
        return num_heads
    return max(d for d in range(1, most + 1) if num_heads % d == 0)


def sm90_scores_smem_bytes(block_n: int, num_buf: int, head_dim: int, key_tiles: int = 1, elem_bytes: int = 2) -> int:
    """Shared memory of one program: the key tile (two with ``key_tiles > 1``) and the ring of query tiles."""
    return ((2 if key_tiles > 1 else 1) * block_n + num_buf * SM90_SCORES_BLOCK_M) * head_dim * elem_bytes


def key_tiles(num_heads: int, num_buf: int, most: int) -> int:
    """Key tiles per program: ``most``, or 1 where the next key tile could not land within one tile's head steps
    (fewer heads than the ``num_buf - 2`` steps the query ring loads ahead)."""
    return most if num_heads >= num_buf - 2 else 1


def sm90_scores_unfit(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    fp8: bool,
    block_n: int,
    num_buf: int,
    num_key_tiles: int = 1,
) -> str | None:
    """``None`` when :func:`indexer_topk_fwd_sm90_kernel_scores` scores ``index_q`` of ``dtype`` with head width
    ``head_dim`` on ``device`` with ``block_n`` keys per tile, ``num_buf`` query tiles and ``num_key_tiles`` key
    tiles per program, else why not."""
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
    smem = sm90_scores_smem_bytes(block_n, num_buf, head_dim, num_key_tiles)
    if smem > SM90_SMEM_BYTES:
        return (
            f"{block_n} keys ({'two tiles' if num_key_tiles > 1 else 'one tile'}) and {num_buf} query tiles at "
            f"D_I={head_dim} need {smem} bytes of shared memory, more than the {SM90_SMEM_BYTES} an SM90 program "
            "gets: lower sm90_block_n, sm90_num_buf or sm90_key_tiles"
        )
    return None
