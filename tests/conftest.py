"""Shared test fixtures.

- ``poison``: allocate tensors filled with NaN (or the integer minimum) so unwritten outputs are caught.
- ``triton_interpret``: run Triton kernels on CPU under ``TRITON_INTERPRET=1`` (skips if triton is missing).
- ``gloo``: the multi-rank harness of ``tests/_dist.py`` (``gloo(fn, world_size, *args)``).

Triton decides at kernel-definition time whether to interpret, so on a machine without CUDA the variable is
set here, before any test module imports a kernel.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests import _dist  # noqa: E402


def poison_tensor(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A tensor whose every element is a value no kernel would legitimately write (NaN / int minimum)."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    if dtype == torch.bool:
        raise TypeError("cannot poison a bool tensor")
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


@pytest.fixture
def poison():
    """``poison(shape, dtype=float32, device='cpu')`` -> a NaN-filled (or int-min-filled) tensor."""
    return poison_tensor


@pytest.fixture
def triton_interpret(monkeypatch):
    """Run Triton kernels on CPU tensors through the interpreter."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed (pip install triton)")
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA present: kernels compile for the GPU (interpreter tests run on CPU-only machines)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return True


@pytest.fixture
def gloo():
    """``gloo(fn, world_size, *args, timeout=120, **kwargs)`` -> per-rank results (see tests/_dist.py)."""
    return _dist.run_ranks


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_sessionfinish(session, exitstatus):
    _dist.shutdown_all()
