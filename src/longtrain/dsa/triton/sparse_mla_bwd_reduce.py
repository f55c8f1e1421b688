"""The deterministic sparse MLA backward's reduction of dkv: each row chunk's per-slot pieces (stored by the
probabilities + dkv kernel in ``(row, slot, head block)`` order, fp32, bf16 or scaled fp16) summed key by key in a
fixed order, without atomics, onto the running dkv, so the result is the same bit for bit on every run, row chunk and
schedule. :func:`dkv_reduce_keys` forms the sort keys once per backward, :func:`dkv_reduce_runs` each chunk's runs
of slots by key (a stable sort and a search; :class:`ChunkRuns` forms them a chunk ahead, on a side stream on CUDA),
:func:`dkv_reduce_chunk` reduces one chunk (one launch of ``sparse_mla_bwd_kernel_dkv_reduce``). The knobs stay in
:mod:`longtrain.dsa.triton.sparse_mla_bwd` (``DKV_REDUCE_BATCH`` arrives here as ``batch``).

Scaled fp16 pieces: the columns fall into groups of ``G`` columns and every piece row has one fp32 scale per group,
``scales[piece row, group]``, a power of two; the stored fp16 value is the piece divided by it. The portable and the
two-warpgroup kernels store a piece as ``[BLOCK_K, W]`` tiles of columns (``G`` from :func:`piece_group_cols`: a power
of two dividing every tile and ``d_v``) and scale each row of a tile by its largest finite magnitude, put in
``[2**14, 2**15)``, storing that scale for each of the tile's ``W / G`` groups. The warp-specialized kernel scales
a whole piece row from a bound on it (one group per reduction block, ``G = min(1024, next_pow2(d_qk))``). The
reduction reads each piece as ``[groups, G]`` with one scale per group and adds ``fp16 value * scale``: the division
and the multiplication by a power of two are exact, so each piece carries fp16's 11 significant bits relative to each
element (bf16's 8), over fp16's whole exponent range below the row's largest element, whatever the gradients'
magnitude. Infinities and NaN are kept (they take no part in the scale).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from longtrain.dsa.triton._common import next_pow2

__all__ = [
    "ChunkRuns",
    "dkv_reduce_chunk",
    "dkv_reduce_keys",
    "dkv_reduce_runs",
    "piece_group_cols",
    "scale_piece_rows",
    "sparse_mla_bwd_kernel_dkv_reduce",
]


@triton.jit
def scale_piece_rows(value):
    """``(value / scale[:, None], scale)`` for an fp32 ``value [R, W]``: ``scale [R]`` fp32, a power of two per row that
    puts its largest finite magnitude in ``[2**14, 2**15)`` (below fp16's largest, 65504, with room for rounding; 29
    binades above its smallest normal), ``2**-126`` at least (rows below ``2**-112`` are scaled by ``2**126``).
    Formed from the exponent bits, so both the scale and the division are exact."""
    mag = tl.abs(value)
    top = tl.max(tl.where(mag < float("inf"), mag, 0.0), axis=1)  # [R]: NaN and infinities take no part
    bits = tl.maximum((top.to(tl.int32, bitcast=True) & 0x7F800000) - (14 << 23), 1 << 23)  # [R]
    inv = ((254 << 23) - bits).to(tl.float32, bitcast=True)  # [R]: 1 / scale, a normal power of two
    return value * inv[:, None], bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["num_keys"])
def sparse_mla_bwd_kernel_dkv_reduce(
    contrib_ptr, order_ptr, run_start_ptr, dkv_ptr, num_keys, scale_ptr,
    D_QK: tl.constexpr, BLOCK_D: tl.constexpr, NUM_HB: tl.constexpr, BATCH: tl.constexpr, GROUP_COLS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
):  # fmt: skip
    """Key rows ``pid, pid + grid, ...``: each sums its run of the chunk's sorted slots, ``order[run_start[key] :
    run_start[key + 1]]``, in that order into ``dkv`` (each slot's ``NUM_HB`` head-block pieces in head-block order).
    A key no slot of the chunk selected has an empty run and is skipped. With ``BATCH > 1`` the run is read ``BATCH``
    slots at a time: their indices in one load, then their pieces' loads issued together (they do not depend on the
    sum), added one after the other, so the order, and every bit of the sum, is the sequential one. Columns are read
    as ``[BLOCK_D / GROUP_COLS, GROUP_COLS]`` blocks; ``NUM_GROUPS > 0``: scaled fp16 pieces, each row of a block
    (``GROUP_COLS`` columns, one group) times its piece row's scale of that group."""
    lanes = tl.arange(0, BATCH)
    NB: tl.constexpr = BLOCK_D // GROUP_COLS
    for key in range(tl.program_id(0), num_keys, tl.num_programs(0)):
        start = tl.load(run_start_ptr + key)  # scalar
        end = tl.load(run_start_ptr + key + 1)  # scalar
        if start < end:
            row = tl.cast(key, tl.int64) * D_QK
            for c0 in tl.static_range(0, D_QK, BLOCK_D):
                grp = c0 // GROUP_COLS + tl.arange(0, NB)  # [NB]
                offs = grp[:, None] * GROUP_COLS + tl.arange(0, GROUP_COLS)[None, :]  # [NB, GROUP_COLS]
                cmask = offs < D_QK
                gmask = grp < (D_QK + GROUP_COLS - 1) // GROUP_COLS  # [NB]
                acc = tl.load(dkv_ptr + row + offs, mask=cmask, other=0.0)  # [NB, GROUP_COLS]
                if BATCH == 1:
                    for j in range(start, end):
                        src = tl.load(order_ptr + j).to(tl.int64) * NUM_HB  # scalar
                        for hb in tl.static_range(NUM_HB):
                            piece = tl.load(contrib_ptr + (src + hb) * D_QK + offs, mask=cmask, other=0.0)
                            acc += _unscaled(piece, scale_ptr, src + hb, grp, gmask, NUM_GROUPS)  # [NB, GROUP_COLS]
                else:
                    for j0 in range(start, end, BATCH):
                        srcs = tl.load(order_ptr + j0 + lanes, mask=j0 + lanes < end, other=0).to(tl.int64)  # [BATCH]
                        for b in tl.static_range(BATCH):
                            src = tl.sum(tl.where(lanes == b, srcs, 0)) * NUM_HB  # scalar
                            # A slot past the run loads zeros: adding +0.0 leaves every sum but -0.0 unchanged.
                            bmask = cmask & (offs * 0 + j0 + b < end)  # [NB, GROUP_COLS]
                            bgmask = gmask & (grp * 0 + j0 + b < end)  # [NB]
                            for hb in tl.static_range(NUM_HB):
                                piece = tl.load(contrib_ptr + (src + hb) * D_QK + offs, mask=bmask, other=0.0)
                                acc += _unscaled(piece, scale_ptr, src + hb, grp, bgmask, NUM_GROUPS)
                tl.store(dkv_ptr + row + offs, acc, mask=cmask)


@triton.jit
def _unscaled(piece, scale_ptr, piece_row, grp, gmask, NUM_GROUPS: tl.constexpr):
    """A ``[NB, G]`` block of a piece as fp32: each row times its group's scale with scaled fp16 pieces."""
    if NUM_GROUPS > 0:
        scale = tl.load(scale_ptr + piece_row * NUM_GROUPS + grp, mask=gmask, other=0.0)  # [NB]
        return piece.to(tl.float32) * scale[:, None]
    else:
        return piece.to(tl.float32)


def piece_group_cols(d_v: int, d_r: int, value_width: int, rope_width: int) -> int:
    """Columns per scale group of scaled fp16 pieces from a producer that stores tiles of ``value_width`` value columns
    from column 0 and ``rope_width`` rope columns from column ``d_v``: the largest power of two dividing both widths
    (``rope_width`` counted only with ``d_r > 0``), ``d_v`` and, where the rope tile is wider than the rope columns,
    ``d_r``, so that every tile covers whole groups. Group ``g`` holds columns ``[g G, (g + 1) G)``."""
    g = math.gcd(value_width, d_v)
    if d_r > 0:
        g = math.gcd(g, math.gcd(rope_width, d_r))
    return g & -g


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


def dkv_reduce_runs(reduce_keys, k_slots: int, row0: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [rows * K] int64, run_start [num_keys + 1])`` of one row chunk: a stable sort of the chunk's keys
    (``reduce_keys`` from :func:`dkv_reduce_keys`), so that each key's slots come in ascending ``(row, slot)`` order,
    and key ``j``'s run ``order[run_start[j] : run_start[j + 1]]``. They depend on the index sets alone, so they may be
    formed before the chunk's pieces exist (on another stream)."""
    keys, key_ids = reduce_keys
    sorted_keys, order = torch.sort(keys[row0 * k_slots : (row0 + rows) * k_slots], stable=True)
    # Key j's run is [run_start[j], run_start[j + 1]): the first sorted position of each key 0..num_keys.
    return order, torch.searchsorted(sorted_keys, key_ids)


class ChunkRuns:
    """Each row chunk's runs of slots by key (:func:`dkv_reduce_runs`) for its reduction, ``take(i)`` for chunk ``i`` of
    ``chunks [(row0, rows), ...]``. They depend on the index sets alone. With a side ``stream`` (CUDA), the keys and
    chunk 0's runs are formed there at once, and chunk ``i + 1``'s when chunk ``i``'s are taken (at most two chunks'
    runs alive); the taking stream waits on them. So their sorts and searches (many small kernels) run beside the
    probabilities kernels and the reductions, on the SMs those leave idle, instead of between them. Without a stream
    the keys are formed at once and each chunk's runs when taken, on the current stream, in any order; with a stream
    the chunks are taken in order, 0, 1, 2, ... (as the backward's chunk loop does)."""

    def __init__(self, idx, topk_length, num_keys: int, k_slots: int, chunks, stream=None) -> None:
        self._k_slots, self._chunks, self._stream = k_slots, list(chunks), stream
        self._ahead: dict[int, tuple] = {}
        if stream is None:
            self._keys = dkv_reduce_keys(idx, topk_length, num_keys)
            return
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # the index sets are written on the caller's
        with torch.cuda.stream(stream):
            self._keys = dkv_reduce_keys(idx, topk_length, num_keys)
        self._issue(0)

    def _issue(self, i: int) -> None:
        if i >= len(self._chunks):
            return
        with torch.cuda.stream(self._stream):
            runs = dkv_reduce_runs(self._keys, self._k_slots, *self._chunks[i])
            done = torch.cuda.Event()
            done.record(self._stream)
        self._ahead[i] = (runs, done)

    def take(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``i``'s ``(order, run_start)``, ready for work queued next on the current stream."""
        if self._stream is None:
            return dkv_reduce_runs(self._keys, self._k_slots, *self._chunks[i])
        runs, done = self._ahead.pop(i)
        taker = torch.cuda.current_stream(self._stream.device)
        taker.wait_event(done)
        for t in runs:  # allocated on the side stream, read on the taker's: not reused before the taker is done
            t.record_stream(taker)
        self._issue(i + 1)
        return runs


def dkv_reduce_chunk(
    runs, k_slots, contrib, dkv_acc, rows, d_qk, num_hb, batch, num_warps=4, scales=None, group_cols=0
) -> None:
    """Sum one row chunk's per-slot dkv pieces key by key, in a fixed order (no atomics): each key's slots in
    ascending ``(row, slot)`` order (``runs`` from :func:`dkv_reduce_runs`), each key row summed by one program.
    Scaled fp16 pieces come with their ``scales [pieces, ceil(d_qk / G)]`` fp32 and ``group_cols`` G
    (:func:`piece_group_cols`)."""
    order, run_start = runs
    num_keys = dkv_acc.shape[0]
    # At most one program per key and per slot: a chunk selects at most rows * K distinct keys.
    grid = (max(1, min(num_keys, rows * k_slots)),)
    block_d = min(1024, next_pow2(d_qk))
    sparse_mla_bwd_kernel_dkv_reduce[grid](
        contrib, order, run_start, dkv_acc, num_keys, scales if scales is not None else contrib, D_QK=d_qk,
        BLOCK_D=block_d, NUM_HB=num_hb, BATCH=batch, GROUP_COLS=group_cols if scales is not None else block_d,
        NUM_GROUPS=0 if scales is None else scales.shape[1], num_warps=num_warps,
    )  # fmt: skip
