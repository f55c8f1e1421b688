"""The flash-attention tolerance rule of the GPU tests (benchmarks/README.md, "Tolerance rule"), in one place.

A low-precision kernel's max error against the float64 reference may be at most twice the error of the same-dtype
torch reference, plus one rounding step of the reference values in the kernel's dtype at their largest magnitude
(``max|ref| * eps / 2``: what rounding the exact result to that dtype can cost by itself).
"""

from __future__ import annotations

import torch


def assert_flash_rule(what: str, got: torch.Tensor, same_dtype: torch.Tensor, ref64: torch.Tensor) -> None:
    """``got`` (the kernel) against ``ref64`` (float64), with ``same_dtype`` the torch reference in ``got``'s dtype."""
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten or NaN)"
    ref = ref64.double()
    err = (got.double() - ref).abs().max().item()
    base = (same_dtype.double() - ref).abs().max().item()
    step = ref.abs().max().item() * torch.finfo(got.dtype).eps / 2
    assert err <= 2 * base + step, f"{what}: err {err:.3e} > 2 * {base:.3e} + {step:.3e}"


def assert_flash_rule_all(what: str, names, got, same_dtype, ref64) -> None:
    """:func:`assert_flash_rule` over parallel sequences (e.g. out, dq, dk, dv)."""
    for name, a, b, r in zip(names, got, same_dtype, ref64):
        assert_flash_rule(f"{what} {name}", a, b, r)
