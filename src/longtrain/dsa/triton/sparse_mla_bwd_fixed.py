"""The deterministic sparse MLA backward's fixed-point dkv (``sparse_mla_bwd.DET_DKV = "fixed"``).

Every dkv contribution ``c`` (one slot's sum over a block of heads, one column) is rounded to the nearest integer
multiple of ``2^-s`` and added with int64 atomics. Integer addition gives the same bits in any order, so dkv is the
same bit for bit on every run, schedule and row chunking, at the cost of the default's atomics, with no per-slot
scratch and no reduction pass.

The exponent ``s`` comes from a bound ``B`` on the sum of ``|c|`` over every contribution to any one dkv element,
from maxima of the inputs (one pass over ``q``, ``kv``, ``out`` and ``dout`` before the kernels):

* ``|P| <= 1`` and each (row, head)'s probabilities sum to at most 1 (the sink only lowers them), so all the
  (row, head, slot) probabilities that reach one key sum to at most ``T * H``;
* ``|dP| = |dO . v| <= ||dO||_1 max|v|`` and ``|delta| = |dO . O| <= ||dO||_1 max|O|``, so
  ``|dS| <= sm_scale * P * ||dO||_1 (max|v| + max|O|)``;
* hence ``B = 2 T H ((1 + 2^-7)^2 sm_scale max_row ||dO||_1 (max|kv| + max|O|) max|q| + (1 + 2^-7) max|dO|)``:
  the factors ``1 + 2^-7`` cover the bf16 rounding of ``P`` and ``dS`` before their matmuls, the 2 the probabilities
  recomputed from the saved log-sum-exp summing to a little over 1.

With ``B < 2^e``, ``s = 61 - e``: every partial sum stays below ``2^61 + n / 2`` in magnitude, far inside int64. The
maxima are over finite entries (and rows of ``dO`` without a non-finite entry): a finite contribution involves only
finite inputs. A contribution that is not finite, or whose scaled value is not below ``2^62`` (which the bound rules
out), is not added: its key row is flagged and comes out NaN. So a NaN or inf in one document's inputs reaches only
the dkv rows of the keys that document's queries selected, as with the atomics. ``s`` is clamped to at most 127 (tiny
inputs: a coarser grid than possible, still far finer than the values); a bound of ``2^187`` or more (inputs near
``1e15`` and beyond, whose gradients overflow fp32 anyway) leaves no representable ``2^-s``: dkv is then NaN.

Rounding error: at most ``2^-(s+1)`` per contribution, so ``n 2^-(s+1) <= n B 2^-62`` for an element with ``n``
contributions, far below the fp32 atomics' own rounding at the shapes this library runs (the bound is loose by many
powers of two, each one a bit of headroom). The scale depends on the whole batch's maxima: the same inputs give the
same bits, but a change elsewhere in the batch (another document's values) can move the last bits of an fp32 dkv
element, as a change of chunking can in the default mode.

The buffer ``fix`` (int32, ``1 + T_k``) holds the scale's fp32 bits, then each key row's flag; the kernels read
``fix[0]`` and set ``fix[1 + key]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longtrain.dsa.triton._common import next_pow2

__all__ = ["FIX_BITS", "fixed_point_dkv", "fixed_point_setup", "fixed_point_maxima_kernel"]

#: ``B`` maps below ``2^FIX_BITS``: partial sums stay below ``2^62`` (int64 holds ``2^63``).
FIX_BITS = 61


@triton.jit(do_not_specialize=["n_rows"])
def fixed_point_maxima_kernel(
    x_ptr, n_rows, out_ptr, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROW_L1: tl.constexpr
):
    """Rows ``[pid * BLOCK_R, ...)`` of ``x [n_rows, D]``: ``out[0] = max(out[0], max |x|)`` over finite entries and,
    ``ROW_L1``, ``out[1] = max(out[1], ||x_r||_1)`` over rows without a non-finite entry (fp32 atomic max of
    non-negative values: the same in any order)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    finite = a < float("inf")  # false for NaN and inf
    tl.atomic_max(out_ptr, tl.max(tl.max(tl.where(finite, a, 0.0), 1), 0), sem="relaxed")
    if ROW_L1:
        row_ok = tl.min(finite.to(tl.int32), 1) > 0
        l1 = tl.where(row_ok, tl.sum(tl.where(finite, a, 0.0), 1), 0.0)
        tl.atomic_max(out_ptr + 1, tl.max(l1, 0), sem="relaxed")


def _maxima(x: torch.Tensor, out: torch.Tensor, row_l1: bool = False) -> None:
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.shape[0] == 0:
        return
    block_d = next_pow2(d)
    block_r = max(1, min(64, 8192 // block_d))
    fixed_point_maxima_kernel[(triton.cdiv(x2.shape[0], block_r),)](
        x2, x2.shape[0], out, D=d, BLOCK_R=block_r, BLOCK_D=block_d, ROW_L1=row_l1, num_warps=4
    )


def fixed_point_setup(
    q: torch.Tensor, kv2d: torch.Tensor, out: torch.Tensor, dout: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """``fix`` (int32 ``[1 + T_k]``): the fp32 bits of ``2^s`` for these inputs (module docstring), then zeroed
    flags. On the device, without a host sync."""
    num_tokens, num_heads = q.shape[:2]
    m = torch.zeros(6, dtype=torch.float32, device=q.device)  # max|q|, -, max|dO|, max ||dO||_1, max|O|, max|kv|
    _maxima(q.contiguous(), m[0:])
    _maxima(dout.contiguous(), m[2:], row_l1=True)
    _maxima(out.contiguous(), m[4:])
    _maxima(kv2d.contiguous(), m[5:])
    m = m.double()
    r = 1 + 2.0**-7
    bound = 2 * num_tokens * num_heads * (r * r * softmax_scale * m[3] * (m[5] + m[4]) * m[0] + r * m[2])
    _, e = torch.frexp(bound)  # bound < 2^e (e = 0 for a zero bound)
    shift = (FIX_BITS - e).clamp(max=127)
    scale = torch.where(shift >= -126, torch.ldexp(torch.ones_like(bound), shift.double()), torch.zeros_like(bound))
    fix = torch.zeros(1 + kv2d.shape[0], dtype=torch.int32, device=q.device)
    fix[:1] = scale.float().reshape(1).view(torch.int32)
    return fix


def fixed_point_dkv(acc: torch.Tensor, fix: torch.Tensor) -> torch.Tensor:
    """dkv in fp32 from the int64 sums ``acc [T_k, D_qk]`` and ``fix``: ``acc * 2^-s``, NaN on flagged key rows (and
    everywhere when no scale was representable: ``2^-s`` is then inf and every sum 0)."""
    scale = fix[:1].view(torch.float32).double()
    dkv = (acc.double() / scale).float()
    return dkv.masked_fill_((fix[1:] != 0)[:, None], float("nan"))
