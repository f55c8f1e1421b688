"""Fused lightning-indexer top-k: scores and an exact per-row radix select, never the ``[T_q, T_k]`` fp32 matrix.

Query rows are processed in chunks. For a chunk:

1. ``indexer_topk_fwd_kernel_scores`` tiles (query rows x keys), loops over the indexer heads with one
   ``tl.dot`` over ``D_I`` per head, applies ``relu`` and the head weight in the epilogue and writes each
   eligible score as an order-preserving 32-bit key into a row-relative scratch (``[rows, T_k]`` int32,
   column ``j`` = key ``starts[t] + j``). Rows whose whole window fits in ``K`` are skipped (they select
   everything) and tiles without an eligible pair exit at once.
2. ``indexer_topk_fwd_kernel_select`` (one program per row) finds the K-th largest key exactly by an 8-bit radix
   select, then emits, in ascending key order, every key above the threshold and the first ties at it (ties go to
   the smaller index), followed by ``-1``. The work is done on a *union* held in registers: the columns of every
   key ``>= lo``, in ascending order, whenever it has at least K and at most ``select_cand`` members (then it holds
   the K largest keys). A row of at most ``select_cand`` keys is its own union (``lo`` = 0). For a wider row a
   strided sample of ``select_sample`` keys, sorted, gives two keys ``lo <= hi`` whose ranks bracket the K-th
   largest with a margin of four standard deviations, and one pass over the row compacts the union's columns into
   a ``select_cand`` buffer. The radix select then runs on the union's keys in ``[lo, hi]`` only, below the leading
   bits ``lo`` and ``hi`` share (keys above ``hi`` are selected for sure; if K or more lie above it, the bracket's
   top missed and the radix runs on the whole union), and the selection is emitted from the union, so the row is
   read once. When the union is too small (the bracket's bottom missed) or too large, or with
   ``select_sample=0``, the radix select reads the whole row in each of its 4 passes and the emission reads it once
   more: the result is the same exact selection either way.

The scratch holds at most ``max(SCRATCH_PER_OUTPUT * T_q * K, block_m * T_k)`` int32 (twice the output, O(T_q K)),
the union buffer ``select_cand`` int32 per row of a chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longtrain.dsa._checks import check_float, check_int, check_same_device
from longtrain.dsa.triton._common import (
    TRITON_DTYPES,
    IndexerConfig,
    dot_precision,
    indexer_fp8_unfit,
    indexer_unfit,
    interpreting,
    next_pow2,
    require_available,
)

__all__ = [
    "MAX_TOPK",
    "SCRATCH_PER_OUTPUT",
    "default_config",
    "indexer_fp8_operands_triton",
    "indexer_fp8_rows_kernel",
    "indexer_topk_fwd",
    "indexer_topk_fwd_scores",
    "indexer_topk_fwd_kernel_scores",
    "indexer_topk_fwd_kernel_select",
    "indexer_topk_triton",
    "indexer_topk_triton_unchecked",
    "scores_route",
]

MAX_TOPK = 2048
#: The default score scratch, in output sizes (``T_q * K`` int32): the row chunk is this many times ``T_q * K / T_k``
#: rows. 2 on the H200 at T = 16384, K = 2048 (one document): 3.82 ms against 3.98 with 1 and 3.70 with 4 (peak 448
#: MiB against 288 and 768; documents 1.70 / 1.82 / 1.58, T = 65536 52.2 / 54.9 / 51.1 ms), the selections identical
#: (``benchmarks/results/logs/exp_chunks_eefe5ea_2026-12-03.log``). Read at each call.
SCRATCH_PER_OUTPUT = 2


@triton.jit
def _clip_window(st, ln, T_k):
    """A row's key window clipped to the key rows that exist (a window starting before 0 or past ``T_k`` is empty,
    one running past ``T_k`` ends there): what keeps a forged window from reading or emitting out of range."""
    st = st.to(tl.int64)
    ln = ln.to(tl.int64)
    ln = tl.where(st < 0, 0, tl.maximum(tl.minimum(ln, T_k - st), 0))
    st = tl.minimum(tl.maximum(st, 0), tl.maximum(T_k - 1, 0))
    return st.to(tl.int32), ln.to(tl.int32)


@triton.jit
def _score_tile(starts_ptr, lens_ptr, row_begin, row_end, T_k, topk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile of the scores: ``(rows, row_ok, st, ln, need, offs_n, busy)``; ``need`` marks the rows
    with more eligible keys than K (the only ones that need scores), ``busy`` whether any of them sees a key here."""
    pid = tl.program_id(0)
    n_kb = tl.cdiv(T_k, BLOCK_N)
    # Key blocks vary fastest: programs running together share their query rows in L2.
    qb = pid // n_kb
    kb = pid % n_kb
    rows = row_begin + qb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    st = tl.load(starts_ptr + rows, mask=row_ok, other=0)  # [BLOCK_M]
    ln = tl.load(lens_ptr + rows, mask=row_ok, other=0)  # [BLOCK_M]
    st, ln = _clip_window(st, ln, T_k)
    need = row_ok & (ln > topk)
    k_lo = kb * BLOCK_N
    overlap = need & (st < k_lo + BLOCK_N) & (st + ln > k_lo)
    offs_n = k_lo + tl.arange(0, BLOCK_N)
    return rows, row_ok, st, ln, need, offs_n, tl.max(overlap.to(tl.int32), 0) > 0


@triton.jit
def _store_score_keys(acc, scratch_ptr, rows, row_begin, offs_n, st, ln, need, scratch_stride):
    """Each eligible score of ``acc: [BLOCK_M, BLOCK_N]`` as an order-preserving 32-bit key, row-relative."""
    # Order-preserving map float -> uint32 (stored as int32): flip the sign bit of non-negative values,
    # every bit of negative ones. -0.0 is folded into +0.0 first so equal scores get equal keys.
    acc = tl.where(acc == 0.0, 0.0, acc)
    bits = acc.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) | -2147483648)
    cols = offs_n[None, :] - st[:, None]
    eligible = need[:, None] & (cols >= 0) & (cols < ln[:, None])
    out_rows = scratch_ptr + (rows - row_begin).to(tl.int64)[:, None] * scratch_stride
    tl.store(out_rows + cols, key, mask=eligible)  # [BLOCK_M, BLOCK_N]


@triton.jit(do_not_specialize=["row_begin", "row_end", "T_k", "topk", "scratch_stride"])
def indexer_topk_fwd_kernel_scores(
    q_ptr, k_ptr, w_ptr, ks_ptr, starts_ptr, lens_ptr, scratch_ptr,
    row_begin, row_end, T_k, topk, scratch_stride,
    H_I: tl.constexpr, D_I: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_SCALE: tl.constexpr,
):  # fmt: skip
    rows, row_ok, st, ln, need, offs_n, busy = _score_tile(
        starts_ptr, lens_ptr, row_begin, row_end, T_k, topk, BLOCK_M, BLOCK_N
    )
    if busy:
        offs_d = tl.arange(0, BLOCK_D)
        if BLOCK_D == D_I:
            k_mask = (offs_n < T_k)[:, None]
            q_mask = row_ok[:, None]
        else:
            k_mask = (offs_n < T_k)[:, None] & (offs_d < D_I)[None, :]
            q_mask = row_ok[:, None] & (offs_d < D_I)[None, :]
        k_tile = k_ptr + offs_n.to(tl.int64)[:, None] * D_I + offs_d[None, :]
        keys = tl.load(k_tile, mask=k_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        keys_t = tl.trans(keys)  # [BLOCK_D, BLOCK_N]
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * (H_I * D_I) + offs_d[None, :]
        w_rows = w_ptr + rows.to(tl.int64) * H_I
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for h in range(H_I):
            q_h = tl.load(q_rows + h * D_I, mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
            w_h = tl.load(w_rows + h, mask=row_ok, other=0.0)  # [BLOCK_M]
            logits = tl.dot(q_h, keys_t, input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
            acc += tl.maximum(logits, 0.0) * w_h[:, None]
        if K_SCALE:  # FP8 keys: each key row's (positive, power-of-two) scale, taken out of the head sum
            acc *= tl.load(ks_ptr + offs_n, mask=offs_n < T_k, other=0.0)[None, :]
        _store_score_keys(acc, scratch_ptr, rows, row_begin, offs_n, st, ln, need, scratch_stride)


@triton.jit
def _radix_digit(hist, bins, remaining, prefix, prefix_mask, shift):
    """One 8-bit step of the radix select: the digit at ``shift`` of the ``remaining``-th largest matched key, from
    the matched keys' digit histogram ``hist: [256]``; returns the new ``(prefix, prefix_mask, remaining)``."""
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # [256]
    digit_sel = tl.max(tl.where(at_or_above >= remaining, bins, -1), 0)
    remaining -= tl.sum(tl.where(bins > digit_sel, hist, 0), 0)
    prefix = prefix | (digit_sel.to(tl.uint32) << shift)
    prefix_mask = prefix_mask | (tl.full([], 0xFF, tl.uint32) << shift)
    return prefix, prefix_mask, remaining


@triton.jit
def _significant_bits(d):
    """Bits below and at the highest set bit of the uint32 scalar ``d`` (0 for ``d == 0``)."""
    n = tl.full([], 0, tl.int32)
    for b in tl.static_range(32):
        n = tl.where((d >> b) != 0, b + 1, n)
    return n


@triton.jit(do_not_specialize=["row_begin", "T_k", "topk", "scratch_stride"])
def indexer_topk_fwd_kernel_select(
    scratch_ptr, starts_ptr, lens_ptr, out_ptr, cand_ptr, row_begin, T_k, topk, scratch_stride,
    BLOCK: tl.constexpr, SAMPLE: tl.constexpr, CAND: tl.constexpr,
):  # fmt: skip
    r = row_begin + tl.program_id(0)
    st = tl.load(starts_ptr + r)  # scalar
    ln = tl.load(lens_ptr + r)  # scalar
    st, ln = _clip_window(st, ln, T_k)
    out_row = out_ptr + r.to(tl.int64) * topk
    offs = tl.arange(0, BLOCK)
    if ln <= topk:
        # Every eligible key is selected: the ascending window, then -1.
        for j0 in range(0, topk, BLOCK):
            j = j0 + offs
            tl.store(out_row + j, tl.where(j < ln, st + j, -1), mask=j < topk)
    else:
        row = scratch_ptr + (r - row_begin).to(tl.int64) * scratch_stride
        bins = tl.arange(0, 256)
        umax = tl.full([], 0xFFFFFFFF, tl.uint32)
        zero = tl.full([], 0, tl.uint32)
        # The union: the columns (ascending) of every key >= lo, held in registers when it has at most CAND members
        # and at least K (then it holds the K largest keys); keys above hi lie over the K-th largest for sure.
        lo = zero
        hi = umax
        offs_c = tl.arange(0, CAND)
        cand_row = cand_ptr + tl.program_id(0).to(tl.int64) * CAND
        # (Names a constexpr branch defines do not outlive it: everything used below is defined here.)
        held = ln <= CAND * (SAMPLE > 0)  # a row this narrow is the union itself (none without sampling)
        n_u = tl.where(held, ln, 0)
        if SAMPLE > 0:  # noqa: SIM102  (a constexpr test and a runtime one cannot share an `and` in Triton)
            if ln > CAND:
                # Bracket the K-th largest by the ranks of a strided sample (its expected rank +- 4 standard
                # deviations of a binomial count, +- 4), then compact the columns of the keys >= lo in one pass.
                stride = ln // SAMPLE
                offs_s = tl.arange(0, SAMPLE)
                sample = tl.load(row + offs_s * stride + stride // 2)  # [SAMPLE] keys (uint32 order)
                # Sorted as int32 with the sign bit flipped: the same order as the uint32 keys.
                sample = (tl.sort(sample ^ -2147483648) ^ -2147483648).to(tl.uint32, bitcast=True)  # [SAMPLE]
                q = topk.to(tl.float32) / ln.to(tl.float32)
                rank = q * SAMPLE
                margin = 4.0 * tl.sqrt(rank * (1.0 - q)) + 4.0
                r_hi = tl.floor(rank - margin).to(tl.int32)  # descending ranks: 0 is the sample's largest
                r_lo = tl.ceil(rank + margin).to(tl.int32)
                hi_v = tl.max(tl.where(offs_s == SAMPLE - 1 - r_hi, sample, 0), 0)
                lo_v = tl.max(tl.where(offs_s == SAMPLE - 1 - r_lo, sample, 0), 0)
                hi = tl.where(r_hi < 0, umax, hi_v)
                lo = tl.where(r_lo >= SAMPLE, zero, lo_v)
                # A union expected to hold more than CAND keys (very wide rows) is not compacted at all.
                expected = tl.minimum(r_lo, SAMPLE) * stride
                for j0 in range(0, tl.where(expected <= CAND, ln, 0), BLOCK):
                    j = j0 + offs
                    x = tl.load(row + j, mask=j < ln, other=0).to(tl.uint32, bitcast=True)  # [BLOCK]
                    is_u = ((j < ln) & (x >= lo)).to(tl.int32)
                    pos = n_u + tl.cumsum(is_u, 0) - is_u
                    tl.store(cand_row + pos, j, mask=(is_u > 0) & (pos < CAND))
                    n_u += tl.sum(is_u, 0)
                held = (n_u >= topk) & (n_u <= CAND)
                tl.debug_barrier()  # the compacted columns are read back by other threads of this program
        if held:
            valid = offs_c < n_u
            n_compacted = tl.where(ln > CAND, n_u, 0)  # a row held whole has its columns in order: 0, 1, ...
            cols = tl.load(cand_row + offs_c, mask=offs_c < n_compacted, other=0)  # [CAND] union columns
            cols = tl.where(ln > CAND, cols, offs_c)
            y = tl.load(row + cols, mask=valid, other=0).to(tl.uint32, bitcast=True)  # [CAND] their keys
            above = tl.sum((valid & (y > hi)).to(tl.int32), 0)
            hi = tl.where(above < topk, hi, umax)  # a bracket whose top missed: the union alone is still exact
            above = tl.where(above < topk, above, 0)
            # Every key in [lo, hi] shares the leading bits where lo and hi agree: start the radix below them.
            n_bits = _significant_bits(lo ^ hi)
            keep = tl.where(n_bits >= 32, zero, umax << n_bits.to(tl.uint32))
            prefix = lo & keep
            prefix_mask = keep
            remaining = topk - above
            in_bracket = valid & (y <= hi)
            for p in tl.static_range(4):
                shift = 24 - 8 * p
                if shift < n_bits:
                    match = in_bracket & ((y & prefix_mask) == prefix)
                    digit = ((y >> shift) & 0xFF).to(tl.int32)
                    # Unmatched lanes are counted in bin 0 and taken out again (no masked histogram needed).
                    hist = tl.histogram(tl.where(match, digit, 0), 256)
                    hist -= tl.where(bins == 0, CAND - tl.sum(match.to(tl.int32), 0), 0)
                    prefix, prefix_mask, remaining = _radix_digit(hist, bins, remaining, prefix, prefix_mask, shift)
            # prefix is the exact K-th largest key: emit the union's keys above it and the first `remaining` ties.
            tie = valid & (y == prefix)
            if tl.sum(tie.to(tl.int32), 0) > remaining:  # more ties than places: the first ones (a rare case)
                tie = tie & (tl.cumsum(tie.to(tl.int32), 0) - tie.to(tl.int32) < remaining)
            sel = ((valid & (y > prefix)) | tie).to(tl.int32)
            pos = tl.cumsum(sel, 0) - sel
            tl.store(out_row + pos, st + cols, mask=(sel > 0) & (pos < topk))
        else:
            prefix = tl.full([], 0, tl.uint32)
            prefix_mask = tl.full([], 0, tl.uint32)
            remaining = topk
            hist_at_prefix = tl.full([], 0, tl.int32)
            for p in tl.static_range(4):
                shift = 24 - 8 * p
                hist = tl.zeros([256], tl.int32)
                n_matched = 0
                n_seen = 0
                for j0 in range(0, ln, BLOCK):
                    j = j0 + offs
                    x = tl.load(row + j, mask=j < ln, other=0).to(tl.uint32, bitcast=True)  # [BLOCK]
                    match = (j < ln) & ((x & prefix_mask) == prefix)
                    digit = ((x >> shift) & 0xFF).to(tl.int32)
                    hist += tl.histogram(tl.where(match, digit, 0), 256)
                    n_matched += tl.sum(match.to(tl.int32), 0)
                    n_seen += BLOCK
                hist -= tl.where(bins == 0, n_seen - n_matched, 0)
                prefix, prefix_mask, remaining = _radix_digit(hist, bins, remaining, prefix, prefix_mask, shift)
                # The bin of the digit taken; after the last pass (shift 0): the keys equal to the threshold.
                hist_at_prefix = tl.sum(tl.where(bins == ((prefix >> shift) & 0xFF).to(tl.int32), hist, 0), 0)
            # prefix is now the exact K-th largest key; `remaining` ties at it are taken, lowest index first.
            n_out = 0
            n_tie = 0
            all_ties = hist_at_prefix <= remaining  # every key equal to the threshold is selected: no tie ranks
            for j0 in range(0, ln, BLOCK):
                j = j0 + offs
                in_row = j < ln
                x = tl.load(row + j, mask=in_row, other=0).to(tl.uint32, bitcast=True)  # [BLOCK]
                tie = in_row & (x == prefix)
                if not all_ties:
                    tie_i = tie.to(tl.int32)
                    n_before = n_tie + tl.cumsum(tie_i, 0) - tie_i
                    n_tie += tl.sum(tie_i, 0)
                    tie = tie & (n_before < remaining)
                sel = ((in_row & (x > prefix)) | tie).to(tl.int32)
                pos = n_out + tl.cumsum(sel, 0) - sel
                tl.store(out_row + pos, st + j, mask=(sel > 0) & (pos < topk))
                n_out += tl.sum(sel, 0)


@triton.jit
def _e4m3_bits(y):
    """The ``float8_e4m3fn`` bytes (uint8) of float32 ``y`` with ``|y| <= 448``, rounded to nearest even in integer
    arithmetic (the same bytes as torch's conversion on every device, whatever a conversion instruction does). A
    non-finite ``y`` (or one beyond the format) gives NaN, never a wrapped finite byte."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal codes (|y| >= 2**-6): rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits; a mantissa
    # that rounds up to 8 carries into the exponent, as the encoding wants.
    normal = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    # Subnormal codes (multiples of 2**-9): round |y| * 2**9 to an integer (adding 2**23 rounds to nearest even).
    t = tl.abs(y) * 512.0
    sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(mag >= (121 << 23), normal, sub)
    code = tl.where((mag >= 0x7F800000) | (code > 0x7E), 0x7F, code)  # inf / NaN / out of range: NaN
    return (sign | code).to(tl.uint8)


@triton.jit(do_not_specialize=["n_rows"])
def indexer_fp8_rows_kernel(
    x_ptr, codes_ptr, scale_ptr, w_ptr, n_rows,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, FOLD_W: tl.constexpr,
):  # fmt: skip
    """E4M3 codes of ``BLOCK_R`` rows of ``x [n_rows, D]`` and their power-of-two scales, bit for bit
    :func:`~longtrain.dsa.reference.fp8_rows`; ``FOLD_W``: store ``w[row] * scale`` (the head weights of query row
    and head ``row``) instead of the scale."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_D]
    amax = tl.max(tl.abs(x), 1)  # [BLOCK_R]
    # The smallest power of two with amax / scale <= 448 = 1.75 * 2**8, from amax's bits (reference.fp8_pow2_scales).
    bits = amax.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    k = tl.where((bits & 0x7FFFFF) <= 0x600000, exponent - 8, exponent - 7)
    k = tl.minimum(tl.maximum(k, -126), 127)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - k) << 23).to(tl.float32, bitcast=True)
    zero = ~(amax > 0)
    scale = tl.where(zero, 1.0, scale)
    inverse = tl.where(zero, 1.0, inverse)
    tl.store(codes_ptr + offs, _e4m3_bits(x * inverse[:, None]), mask=mask)
    if FOLD_W:
        tl.store(scale_ptr + rows, tl.load(w_ptr + rows, mask=row_ok, other=0.0) * scale, mask=row_ok)
    else:
        tl.store(scale_ptr + rows, scale, mask=row_ok)


def indexer_fp8_operands_triton(
    index_q: torch.Tensor, index_k: torch.Tensor, head_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~longtrain.dsa.reference.indexer_fp8_operands` in two launches (bit for bit the same), on contiguous
    ``index_q [T_q, H_I, D_I]``, ``index_k [T_k, D_I]``, ``head_weights [T_q, H_I]`` float32."""
    head_dim = index_q.shape[-1]
    block_d = next_pow2(head_dim)
    block_r = max(1, 4096 // block_d)
    q8 = torch.empty(index_q.shape, dtype=torch.float8_e4m3fn, device=index_q.device)
    k8 = torch.empty(index_k.shape, dtype=torch.float8_e4m3fn, device=index_k.device)
    weights = torch.empty(head_weights.shape, dtype=torch.float32, device=index_q.device)
    k_scale = torch.empty(index_k.shape[0], dtype=torch.float32, device=index_k.device)
    for x, codes, out, w, fold in ((index_q, q8, weights, head_weights, True), (index_k, k8, k_scale, k_scale, False)):
        n_rows = x.numel() // head_dim
        if n_rows:  # the codes are written as their bytes (a uint8 view)
            indexer_fp8_rows_kernel[(triton.cdiv(n_rows, block_r),)](
                x, codes.view(torch.uint8), out, w, n_rows, D=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, FOLD_W=fold,
                num_warps=4,
            )  # fmt: skip
    return q8, k8, weights, k_scale


def _chunk_rows(num_queries: int, num_keys: int, topk: int, cfg: IndexerConfig) -> int:
    budget = cfg.scratch_elements
    if budget is None:
        budget = max(SCRATCH_PER_OUTPUT * num_queries * topk, 1)
    rows = max(cfg.block_m, (budget // max(1, num_keys)) // cfg.block_m * cfg.block_m)
    return min(rows, triton.cdiv(num_queries, cfg.block_m) * cfg.block_m)


_SCORES_ROUTES: dict[tuple, str] = {}


def scores_route(index_q: torch.Tensor, cfg: IndexerConfig, fp8: bool) -> str:
    """The scoring kernel a call runs, ``"sm90"`` or ``"triton"`` (``cfg.scores_impl`` resolved; cached per device,
    dtype, head width and config). A forced ``"sm90"`` that cannot run raises ``ValueError`` saying why."""
    key = (str(index_q.device), index_q.dtype, index_q.shape[-1], fp8, cfg.scores_impl, cfg.sm90_block_n,
           cfg.sm90_num_buf)  # fmt: skip
    route = _SCORES_ROUTES.get(key)
    if route is None:
        if cfg.scores_impl == "triton":
            route = "triton"
        else:
            if index_q.device.type != "cuda":  # decided without importing the Gluon module (CPU, the interpreter)
                reason = f"it runs on CUDA SM90 GPUs, not on {index_q.device.type}"
            else:
                from longtrain.dsa.triton.indexer_topk_sm90 import sm90_scores_unfit

                reason = sm90_scores_unfit(
                    index_q.device, index_q.dtype, index_q.shape[-1], fp8, cfg.sm90_block_n, cfg.sm90_num_buf
                )
            if reason is not None and cfg.scores_impl == "sm90":
                raise ValueError(
                    f"IndexerConfig(scores_impl='sm90'): the SM90 scoring kernel cannot run here: {reason}. Use "
                    "scores_impl='auto' (it picks the portable kernel where the SM90 one does not apply) or 'triton'"
                )
            route = "triton" if reason is not None else "sm90"
        _SCORES_ROUTES[key] = route
    return route


def indexer_topk_fwd_scores(
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
    cfg: IndexerConfig,
) -> None:
    """Score query rows ``[row0, row1)`` into ``scratch: [>= row1 - row0, T_k] int32`` (row-relative order-preserving
    keys of the eligible scores of the rows wider than K; nothing else is written) with the kernel
    :func:`scores_route` picks. Inputs as :func:`indexer_topk_fwd` takes them."""
    if scores_route(index_q, cfg, k_scale is not None) == "sm90":
        from longtrain.dsa.triton.indexer_topk_sm90 import indexer_topk_fwd_sm90_scores

        indexer_topk_fwd_sm90_scores(
            index_q, index_k, head_weights, k_scale, starts, causal_lengths, scratch, row0, row1, index_topk, cfg
        )
    else:
        num_heads, head_dim = index_q.shape[1], index_q.shape[2]
        num_keys = index_k.shape[0]
        grid = (triton.cdiv(row1 - row0, cfg.block_m) * triton.cdiv(max(num_keys, 1), cfg.block_n),)
        indexer_topk_fwd_kernel_scores[grid](
            index_q, index_k, head_weights, k_scale if k_scale is not None else head_weights, starts, causal_lengths,
            scratch, row0, row1, num_keys, index_topk, scratch.stride(0), H_I=num_heads, D_I=head_dim,
            BLOCK_D=next_pow2(head_dim), DOT_PREC=dot_precision(index_q.dtype), BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, K_SCALE=k_scale is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip


def indexer_topk_fwd(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    head_weights: torch.Tensor,
    starts: torch.Tensor,
    causal_lengths: torch.Tensor,
    index_topk: int,
    cfg: IndexerConfig,
    k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch scoring + selection per row chunk on validated contiguous inputs; returns ``[T_q, K] int32``.

    ``k_scale``: ``[T_k]`` float32 key-row scales of FP8 (E4M3) ``index_q`` / ``index_k`` codes
    (:func:`~longtrain.dsa.reference.indexer_fp8_operands`; the query scales are already in ``head_weights``).
    """
    num_queries, num_heads, head_dim = index_q.shape
    num_keys = index_k.shape[0]
    out = torch.empty((num_queries, index_topk), dtype=torch.int32, device=index_q.device)
    if num_queries == 0:
        return out
    chunk = _chunk_rows(num_queries, num_keys, index_topk, cfg)
    scratch = torch.empty((chunk, max(num_keys, 1)), dtype=torch.int32, device=index_q.device)
    # The selection's union buffer: select_cand int32 per row of a chunk (O(T_q K) like the output).
    select_sample, select_cand = cfg.resolved_select(num_keys)
    cand = scratch
    if select_sample > 0 and num_keys > index_topk:
        cand = torch.empty((chunk, select_cand), dtype=torch.int32, device=index_q.device)
    for row0 in range(0, num_queries, chunk):
        row1 = min(num_queries, row0 + chunk)
        if num_keys > index_topk:
            indexer_topk_fwd_scores(
                index_q, index_k, head_weights, k_scale, starts, causal_lengths, scratch, row0, row1, index_topk, cfg
            )
        indexer_topk_fwd_kernel_select[(row1 - row0,)](
            scratch, starts, causal_lengths, out, cand, row0, num_keys, index_topk, scratch.stride(0),
            BLOCK=cfg.select_block, SAMPLE=select_sample, CAND=select_cand, num_warps=cfg.select_warps,
        )  # fmt: skip
    return out


def indexer_topk_triton(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    head_weights: torch.Tensor,
    starts: torch.Tensor,
    causal_lengths: torch.Tensor,
    index_topk: int,
    *,
    config: IndexerConfig | None = None,
    fp8: bool = False,
) -> torch.Tensor:
    """Lightning-indexer top-k in canonical form (Triton), without a ``[T_q, T_k]`` score matrix.

    Scores ``I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])`` (fp32 accumulation) over each row's eligible
    keys ``[starts[t], starts[t] + causal_lengths[t])``; row ``t`` selects the ``min(K, causal_lengths[t])``
    largest (equal scores: the smaller key index first).

    ``fp8=True`` scores E4M3 codes of ``q`` and ``k`` instead (FP8 tensor cores, SM89+; a power-of-two scale per
    query row and head and per key row, :func:`~longtrain.dsa.reference.indexer_fp8_operands`): the exact
    selection of those scores, which differs from the unquantized one where scores are close.

    Args:
        index_q: ``[T_q, H_I, D_I]`` bf16/fp16/fp32.
        index_k: ``[T_k, D_I]`` (or ``[T_k, 1, D_I]``), same dtype.
        head_weights: ``[T_q, H_I]`` float, read in fp32 (scales already folded in).
        starts: ``[T_q]`` int global key row where each row's window starts.
        causal_lengths: ``[T_q]`` int window lengths (0 = padding row).
        index_topk: ``K`` in ``[1, 2048]``.
        config: launch configuration (``None`` = defaults).
        fp8: score FP8 (E4M3) codes of ``index_q`` / ``index_k`` (see above).

    Returns:
        ``[T_q, K] int32``: per row the selected global key rows in strictly ascending order, then ``-1``.
    """
    check_float("index_q", index_q, "[T_q, H_I, D_I]", TRITON_DTYPES)
    check_float("index_k", index_k, "[T_k, D_I]", TRITON_DTYPES)
    if index_q.dim() != 3:
        raise ValueError(f"index_q must be [T_q, H_I, D_I], got shape {tuple(index_q.shape)}")
    if index_k.dim() == 3 and index_k.shape[1] == 1:
        index_k = index_k[:, 0]
    if index_k.dim() != 2 or index_k.shape[1] != index_q.shape[2]:
        raise ValueError(
            f"index_k must be [T_k, D_I={index_q.shape[2]}] (or [T_k, 1, D_I]), got shape {tuple(index_k.shape)}"
        )
    num_queries, num_heads, head_dim = index_q.shape
    unfit = indexer_unfit(index_q.dtype, index_k.dtype, num_heads, head_dim)
    if unfit is not None:
        raise unfit[0](unfit[1])
    if not isinstance(head_weights, torch.Tensor) or not head_weights.dtype.is_floating_point:
        raise TypeError(f"head_weights must be a float tensor [T_q, H_I], got {getattr(head_weights, 'dtype', None)}")
    if head_weights.shape != (num_queries, num_heads):
        raise ValueError(f"head_weights must be [T_q={num_queries}, H_I={num_heads}], got {tuple(head_weights.shape)}")
    for name, tensor in (("starts", starts), ("causal_lengths", causal_lengths)):
        check_int(name, tensor, f"[T_q={num_queries}]")
        if tensor.shape != (num_queries,):
            raise ValueError(f"{name} must be [T_q={num_queries}], got shape {tuple(tensor.shape)}")
    if isinstance(index_topk, bool) or not isinstance(index_topk, int) or not 1 <= index_topk <= MAX_TOPK:
        raise ValueError(f"index_topk must be an int in [1, {MAX_TOPK}], got {index_topk!r}")
    if config is not None and not isinstance(config, IndexerConfig):
        raise TypeError(f"config must be an IndexerConfig or None, got {type(config).__name__}")
    check_same_device(
        index_q.device,
        "index_q",
        index_k=index_k,
        head_weights=head_weights,
        starts=starts,
        causal_lengths=causal_lengths,
    )
    require_available(index_q.device)
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8 must be a bool, got {type(fp8).__name__}")
    if fp8:
        unfit = indexer_fp8_unfit(index_q.device)
        if unfit is not None:
            raise unfit[0](unfit[1])
    return indexer_topk_triton_unchecked(
        index_q, index_k, head_weights, starts, causal_lengths, index_topk, config, fp8=fp8
    )


_DEFAULT_CONFIG = IndexerConfig()
_INTERPRETER_CONFIG = IndexerConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def default_config() -> IndexerConfig:
    """The launch configuration a call without ``config`` gets (the interpreter's on CPU)."""
    return _INTERPRETER_CONFIG if interpreting() else _DEFAULT_CONFIG


def indexer_topk_triton_unchecked(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    head_weights: torch.Tensor,
    starts: torch.Tensor,
    causal_lengths: torch.Tensor,
    index_topk: int,
    config: IndexerConfig | None = None,
    *,
    fp8: bool = False,
) -> torch.Tensor:
    """:func:`indexer_topk_triton` without its checks, for callers that validated the call already (the public op).

    Takes what :func:`indexer_topk_triton` documents, with ``index_k: [T_k, D_I]``. The kernels still clip the windows
    to the key rows that exist: that is what keeps a forged window from reading or emitting past ``T_k``.
    """
    if config is None:
        config = default_config()
    k_scale = None
    if fp8:
        index_q, index_k, head_weights, k_scale = indexer_fp8_operands_triton(
            index_q.contiguous(), index_k.contiguous(), head_weights.to(torch.float32).contiguous()
        )
    # The kernels clip every window to the key rows that exist themselves (no per-call tensor ops here: each is a
    # launch on the host's critical path).
    return indexer_topk_fwd(
        index_q.contiguous(),
        index_k.contiguous(),
        head_weights.to(torch.float32).contiguous(),
        starts.contiguous(),
        causal_lengths.contiguous(),
        index_topk,
        config,
        k_scale,
    )
