"""The deterministic sparse MLA backward's reduction of dkv: each row chunk's per-slot pieces (fp32 or bf16, stored
by the probabilities + dkv kernel) summed key by key in a fixed order, without atomics, onto the running dkv, so the
result is the same bit for bit on every run, row chunk and schedule.

:func:`dkv_reduce_keys` forms the sort keys once per backward. Per row chunk, :func:`dkv_reduce_plan` (before the
kernel: a stable sort of the chunk's keys and a search) says where the kernel stores each slot's pieces (``pos``) and
in which order the reduction reads them (``order``), and :func:`dkv_reduce_chunk` (after it) launches
``sparse_mla_bwd_kernel_dkv_reduce``. Two layouts, the same sums bit for bit: ``by_key=False`` stores the pieces in
``(row, slot)`` order and reads each key's run through the sort's permutation (scattered reads); ``by_key=True``
stores them at their sorted positions, so each key's run is read as one contiguous block. The knobs stay in
:mod:`longtrain.dsa.triton.sparse_mla_bwd` (``DKV_REDUCE_BATCH`` arrives here as ``batch``, ``DET_PIECE_ORDER`` as
``by_key``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from longtrain.dsa.triton._common import next_pow2

__all__ = ["ReducePlan", "dkv_reduce_chunk", "dkv_reduce_keys", "dkv_reduce_plan", "sparse_mla_bwd_kernel_dkv_reduce"]


@triton.jit(do_not_specialize=["num_keys"])
def sparse_mla_bwd_kernel_dkv_reduce(
    contrib_ptr, order_ptr, run_start_ptr, dkv_ptr, num_keys,
    D_QK: tl.constexpr, BLOCK_D: tl.constexpr, NUM_HB: tl.constexpr, BATCH: tl.constexpr,
):  # fmt: skip
    """Key rows ``pid, pid + grid, ...``: each sums its run of the chunk's sorted slots, ``order[run_start[key] :
    run_start[key + 1]]``, in that order into ``dkv`` (each slot's ``NUM_HB`` head-block pieces in head-block order).
    A key no slot of the chunk selected has an empty run and is skipped. With ``BATCH > 1`` the run is read ``BATCH``
    slots at a time: their indices in one load, then their pieces' loads issued together (they do not depend on the
    sum), added one after the other, so the order, and every bit of the sum, is the sequential one."""
    lanes = tl.arange(0, BATCH)
    for key in range(tl.program_id(0), num_keys, tl.num_programs(0)):
        start = tl.load(run_start_ptr + key)  # scalar
        end = tl.load(run_start_ptr + key + 1)  # scalar
        if start < end:
            row = tl.cast(key, tl.int64) * D_QK
            for c0 in tl.static_range(0, D_QK, BLOCK_D):
                offs = c0 + tl.arange(0, BLOCK_D)
                cmask = offs < D_QK
                acc = tl.load(dkv_ptr + row + offs, mask=cmask, other=0.0)  # [BLOCK_D]
                if BATCH == 1:
                    for j in range(start, end):
                        src = tl.load(order_ptr + j).to(tl.int64) * NUM_HB  # scalar
                        for hb in tl.static_range(NUM_HB):
                            piece = tl.load(contrib_ptr + (src + hb) * D_QK + offs, mask=cmask, other=0.0)  # [BLOCK_D]
                            acc += piece.to(tl.float32)
                else:
                    for j0 in range(start, end, BATCH):
                        srcs = tl.load(order_ptr + j0 + lanes, mask=j0 + lanes < end, other=0).to(tl.int64)  # [BATCH]
                        for b in tl.static_range(BATCH):
                            src = tl.sum(tl.where(lanes == b, srcs, 0)) * NUM_HB  # scalar
                            # A slot past the run loads zeros: adding +0.0 leaves every sum but -0.0 unchanged.
                            bmask = cmask & (offs * 0 + j0 + b < end)  # [BLOCK_D]
                            for hb in tl.static_range(NUM_HB):
                                piece = tl.load(contrib_ptr + (src + hb) * D_QK + offs, mask=bmask, other=0.0)
                                acc += piece.to(tl.float32)  # [BLOCK_D]
                tl.store(dkv_ptr + row + offs, acc, mask=cmask)


def dkv_reduce_keys(
    idx: torch.Tensor, topk_length: torch.Tensor | None, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys [T * K], key_ids [num_keys + 1])`` for the deterministic reduction, int16 up to 32767 keys (else
    int32): each slot's key, ``num_keys`` for an invalid slot (negative, past the last key or past the row's length),
    so that invalid slots sort last, outside every key's run; and the key ids each chunk's sorted keys are searched
    for. Formed once per backward, so each row chunk's reduction is a sort, a search and one launch."""
    valid = (idx >= 0) & (idx < num_keys)
    if topk_length is not None:
        slots = torch.arange(idx.shape[1], device=idx.device)
        valid &= slots[None, :] < topk_length.to(torch.int64)[:, None]
    # int16 where every key and the invalid marker fit: the per-chunk radix sort then runs 2 passes, not 4.
    dtype = torch.int16 if num_keys <= torch.iinfo(torch.int16).max else torch.int32
    keys = torch.where(valid, idx, num_keys).to(dtype).reshape(-1)
    return keys, torch.arange(num_keys + 1, device=idx.device, dtype=dtype)


class ReducePlan(NamedTuple):
    """One row chunk's layout of pieces: slot ``i`` of the chunk (``row_local * K + slot``) stores its head blocks'
    pieces at rows ``pos[i] * NUM_HB + hb``; key ``j``'s pieces are read from ``order[run_start[j] : run_start[j +
    1]]`` (each times ``NUM_HB`` plus its head blocks), in ascending ``(row, slot)`` order."""

    pos: torch.Tensor  # [rows * K] int32
    order: torch.Tensor  # [rows * K] int64
    run_start: torch.Tensor  # [num_keys + 1]


def dkv_reduce_plan(reduce_keys, k_slots: int, row0: int, rows: int, by_key: bool) -> ReducePlan:
    """The layout of rows ``[row0, row0 + rows)``'s pieces (:class:`ReducePlan`): a stable sort of their keys (from
    :func:`dkv_reduce_keys`), so each key's slots keep ``(row, slot)`` order. ``by_key``: pieces stored at their
    sorted positions (``pos`` the sort's inverse, ``order`` the identity), else at their slots (``pos`` the identity,
    ``order`` the sort's permutation)."""
    keys, key_ids = reduce_keys
    sorted_keys, perm = torch.sort(keys[row0 * k_slots : (row0 + rows) * k_slots], stable=True)
    # Key j's run is [run_start[j], run_start[j + 1]): the first sorted position of each key 0..num_keys.
    run_start = torch.searchsorted(sorted_keys, key_ids)
    ident = torch.arange(perm.numel(), device=perm.device)
    if by_key:
        pos = torch.empty(perm.numel(), dtype=torch.int32, device=perm.device).index_put_((perm,), ident.int())
        return ReducePlan(pos, ident, run_start)
    return ReducePlan(ident.int(), perm, run_start)


def dkv_reduce_chunk(plan: ReducePlan, contrib, dkv_acc, rows, k_slots, d_qk, num_hb, batch) -> None:
    """Sum one row chunk's per-slot dkv pieces (laid out by ``plan``) key by key, in a fixed order (no atomics): each
    key's slots in ascending ``(row, slot)`` order, each key row summed by one program."""
    num_keys = dkv_acc.shape[0]
    # At most one program per key and per slot: a chunk selects at most rows * K distinct keys.
    grid = (max(1, min(num_keys, rows * k_slots)),)
    sparse_mla_bwd_kernel_dkv_reduce[grid](
        contrib, plan.order, plan.run_start, dkv_acc, num_keys, D_QK=d_qk, BLOCK_D=min(1024, next_pow2(d_qk)),
        NUM_HB=num_hb, BATCH=batch, num_warps=4,
    )  # fmt: skip
