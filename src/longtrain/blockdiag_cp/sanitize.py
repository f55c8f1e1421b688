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

__all__ = ["sanitize", "sanitize_torch"]

_KERNEL = None


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
            for start in range(0, row_len, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                inside = offs < row_len
                x = tl.load(x_ptr + base + offs, mask=inside, other=0.0)
                finite = (x == x) & (tl.abs(x) < float("inf"))  # false for NaN and +-inf
                tl.store(out_ptr + base + offs, tl.where(finite, x, tl.zeros_like(x)), mask=inside)
                any_bad = tl.maximum(any_bad, tl.where(finite | ~inside, 0, 1))
            tl.store(bad_ptr + row, tl.max(any_bad, axis=0).to(tl.int8))

        _KERNEL = sanitize_kernel
    return _KERNEL


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
        block = 1024 if row_len >= 1024 else max(16, 1 << (row_len - 1).bit_length())
        _kernel()[(src.shape[0],)](src, out, bad, row_len, BLOCK=block)
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
    return out, bad.bool()
