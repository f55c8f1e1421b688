"""The deterministic sparse MLA backward's reduction of dkv: each row chunk's per-slot pieces (stored by the
probabilities + dkv kernel in ``(row, slot, head block)`` order, fp32 or bf16) summed key by key in a fixed order,
without atomics, onto the running dkv, so the result is the same bit for bit on every run, row chunk and schedule.
:func:`dkv_reduce_keys` forms the sort keys once per backward, :func:`dkv_reduce_chunk` reduces one chunk (a stable
sort, a search, one launch of ``sparse_mla_bwd_kernel_dkv_reduce``). The knobs stay in
:mod:`longtrain.dsa.triton.sparse_mla_bwd` (``DKV_REDUCE_BATCH`` arrives here as ``batch``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longtrain.dsa.triton._common import next_pow2

__all__ = ["dkv_reduce_chunk", "dkv_reduce_keys", "sparse_mla_bwd_kernel_dkv_reduce"]


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


def dkv_reduce_chunk(reduce_keys, k_slots, contrib, dkv_acc, row0, rows, d_qk, num_hb, batch, num_warps=4) -> None:
    """Sum one row chunk's per-slot dkv pieces key by key, in a fixed order (no atomics): each key's slots in
    ascending ``(row, slot)`` order (a stable sort of the chunk's keys, ``reduce_keys`` from :func:`dkv_reduce_keys`),
    each key row summed by one program."""
    keys, key_ids = reduce_keys
    num_keys = dkv_acc.shape[0]
    sorted_keys, order = torch.sort(keys[row0 * k_slots : (row0 + rows) * k_slots], stable=True)
    # Key j's run is [run_start[j], run_start[j + 1]): the first sorted position of each key 0..num_keys.
    run_start = torch.searchsorted(sorted_keys, key_ids)
    # At most one program per key and per slot: a chunk selects at most rows * K distinct keys.
    grid = (max(1, min(num_keys, rows * k_slots)),)
    sparse_mla_bwd_kernel_dkv_reduce[grid](
        contrib, order, run_start, dkv_acc, num_keys, D_QK=d_qk, BLOCK_D=min(1024, next_pow2(d_qk)), NUM_HB=num_hb,
        BATCH=batch, num_warps=num_warps,
    )  # fmt: skip
