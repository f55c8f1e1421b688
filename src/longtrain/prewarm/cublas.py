"""cuBLAS / cuBLASLt backward warmup."""

from __future__ import annotations

import torch

from longtrain.prewarm._common import _log, _log_failure, _pkg, _rng_neutral

_CUBLAS_DTYPES = (torch.float32, torch.bfloat16)


def _prewarm_cublas_backward(device: torch.device | int | str | None, size: int = 16) -> bool:
    """Initialize cuBLAS/cuBLASLt backward-pass state before real activations exist.

    Runs a tiny fwd+bwd matmul per dtype (float32, then bfloat16) so the library handles and workspaces
    (32 MiB each on Hopper, one per handle and stream; autograd's backward thread has its own) are allocated
    while the allocator pool is small, instead of at step-1 peak.

    Args:
        device: target CUDA device (skipped when None or not CUDA).
        size: side length of the square ``[size, size]`` warmup matmul operands.

    Returns:
        True if the prewarm ran, False if it was skipped or failed (failures are logged).
    """
    dev = _pkg()._resolve_cuda_device(device, "cuBLAS backward")
    if dev is None:
        return False
    try:
        with _rng_neutral(dev), torch.enable_grad():
            for dtype in _CUBLAS_DTYPES:
                a = torch.randn(size, size, device=dev, dtype=dtype, requires_grad=True)
                b = torch.randn(size, size, device=dev, dtype=dtype, requires_grad=True)
                (a @ b).float().sum().backward()
                torch.cuda.synchronize(dev)
                del a, b
        torch.cuda.empty_cache()
    except Exception:
        _log_failure("Skipping cuBLAS backward prewarm after failure.")
        return False
    _log().info("Finished cuBLAS backward prewarm (size=%d).", size)
    return True
