"""Non-finite isolation for attention kernels that let a masked-out NaN through (``0 · NaN``).

``sanitize(x)`` returns ``(clean, bad)``: ``clean`` is ``x`` with every non-finite element replaced by 0 (bit for bit
``x`` on finite input) and ``bad`` a bool ``[T]`` flagging the tokens (dim 0) that held one. On CUDA with Triton
both come from one fused kernel (one read and one write of ``x``, no host sync); elsewhere from torch ops. The
autograd of ``clean`` is the identity: the runtime NaN-fills every output row that attended a flagged token, and
those rows carry zero gradient, so no gradient reaches a flagged element through the rows that saw it.
"""

from __future__ import annotations

import torch

from longtrain import _optional

__all__ = ["fill_rows", "sanitize", "sanitize_torch"]

_KERNEL = None
_FILL_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def sanitize_kernel(x_ptr, out_ptr, bad_ptr, row_len, BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            base = row * row_len
            any_bad = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, row_len, BLOCK):  # one token's row_len elements, BLOCK at a time
                offs = start + tl.arange(0, BLOCK)
                inside = offs < row_len
                x = tl.load(x_ptr + base + offs, mask=inside, other=0.0)  # [BLOCK]
                finite = (x == x) & (tl.abs(x) < float("inf"))  # [BLOCK]; false for NaN and +-inf
                tl.store(out_ptr + base + offs, tl.where(finite, x, tl.zeros_like(x)), mask=inside)
                any_bad = tl.maximum(any_bad, tl.where(finite | ~inside, 0, 1))
            tl.store(bad_ptr + row, tl.max(any_bad, axis=0).to(tl.int8))

        _KERNEL = sanitize_kernel
    return _KERNEL


def _fill_kernel():
    global _FILL_KERNEL
    if _FILL_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def fill_rows_kernel(x_ptr, out_ptr, flag_ptr, row_len, value, BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            base = row * row_len
            # [BLOCK]: the row's flag (a scalar load) broadcast
            flagged = (tl.zeros([BLOCK], dtype=tl.int32) + tl.load(flag_ptr + row).to(tl.int32)) != 0
            for start in range(0, row_len, BLOCK):  # one token's row_len elements, BLOCK at a time
                offs = start + tl.arange(0, BLOCK)
                inside = offs < row_len
                x = tl.load(x_ptr + base + offs, mask=inside & ~flagged, other=0.0)  # [BLOCK]
                x = tl.where(flagged, x + value, x)  # a flagged row loads as 0: 0 + value
                tl.store(out_ptr + base + offs, x, mask=inside)

        _FILL_KERNEL = fill_rows_kernel
    return _FILL_KERNEL


def _block(row_len: int) -> int:
    return 1024 if row_len >= 1024 else max(16, 1 << (row_len - 1).bit_length())


def _fill(x: torch.Tensor, flags: torch.Tensor, value: float, kernel: bool) -> torch.Tensor:
    if not kernel:
        return x.masked_fill(flags.view((-1,) + (1,) * (x.dim() - 1)), value)
    src = x.contiguous()
    out = torch.empty_like(src)
    row_len = src[0].numel()
    _fill_kernel()[(src.shape[0],)](src, out, flags.view(torch.int8), row_len, value, BLOCK=_block(row_len))
    return out


class _FillRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flags, value, kernel):
        ctx.save_for_backward(flags)
        ctx.kernel = kernel
        return _fill(x, flags, value, kernel)

    @staticmethod
    def backward(ctx, grad):
        (flags,) = ctx.saved_tensors
        # Through the Function again, so that a second-order gradient (create_graph=True) sees the same masking.
        return _FillRows.apply(grad, flags, 0.0, ctx.kernel), None, None, None


def fill_rows(x: torch.Tensor, flags: torch.Tensor, value: float, *, kernel: bool | None = None) -> torch.Tensor:
    """``x`` with every row ``t`` (dim 0) where ``flags[t]`` (bool ``[T]``) set to ``value``; the gradient of those
    rows is 0. One Triton pass on CUDA (``kernel`` as in :func:`sanitize`), ``masked_fill`` elsewhere."""
    use = (_use_kernel(x) and x.shape[0] == flags.numel()) if kernel is None else kernel
    return _FillRows.apply(x, flags.to(torch.bool), float(value), bool(use))


def sanitize_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch-ops form of :func:`sanitize` (any device; differentiable through ``torch.where``)."""
    finite = torch.isfinite(x)
    return torch.where(finite, x, x.new_zeros(())), ~finite.flatten(1).all(-1)


def _use_kernel(x: torch.Tensor) -> bool:
    return x.is_cuda and x.numel() > 0 and x.dim() >= 2 and x.is_floating_point() and _optional.triton()[0]


class _Sanitize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        src = x.contiguous()
        out = torch.empty_like(src)
        bad = torch.empty(src.shape[0], dtype=torch.int8, device=src.device)
        row_len = src[0].numel()
        _kernel()[(src.shape[0],)](src, out, bad, row_len, BLOCK=_block(row_len))
        ctx.mark_non_differentiable(bad)
        return out, bad

    @staticmethod
    def backward(ctx, grad_out, grad_bad):
        return grad_out


def sanitize(x: torch.Tensor, *, kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x with non-finite elements zeroed, bool [T] of the tokens that held one)``; see the module docstring.

    ``kernel``: None picks the Triton kernel for CUDA tensors; True forces it (CPU tensors under
    ``TRITON_INTERPRET=1``: the kernel's own tests); False forces the torch ops.
    """
    if not (_use_kernel(x) if kernel is None else kernel):
        return sanitize_torch(x)
    out, bad = _Sanitize.apply(x)
    return out, bad.view(torch.bool)
