"""The argument checks the DSA entry points share, one of each: float and integer tensors, one device.

The public ops (:mod:`longtrain.dsa.ops`) run them once, at the boundary; the backend-level public functions
(:func:`~longtrain.dsa.triton.sparse_mla_triton`, :func:`~longtrain.dsa.triton.indexer_topk_triton`) run them when
called directly. Imports nothing but torch.
"""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "INT32_LIMIT", "check_float", "check_int", "check_same_device"]

#: Every float dtype a DSA op accepts (the torch backend takes them all; kernels take a subset).
FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
#: Key rows are addressed by int32 indices: ``T_k`` must stay below this.
INT32_LIMIT = 2**31 - 1

_SHORT = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    names = [_SHORT.get(d, str(d)) for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_float(
    name: str, tensor: object, shape: str = "", dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
) -> torch.Tensor:
    """``tensor`` itself when it is a torch.Tensor of one of ``dtypes``, else ``TypeError`` saying what was expected.

    ``shape``: the documented shape for the message, e.g. ``"[T, H, D_qk]"``.
    """
    where = f" {shape}" if shape else ""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{where}, got {type(tensor).__name__}.")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name} must be a float tensor{where} ({_names(dtypes)}), got {tensor.dtype}.")
    return tensor


def check_int(name: str, tensor: object, shape: str = "") -> torch.Tensor:
    """``tensor`` itself when it is an int32 or int64 torch.Tensor, else ``TypeError``."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (torch.int32, torch.int64):
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        where = f" {shape}" if shape else ""
        raise TypeError(f"{name} must be an int32 or int64 tensor{where}, got {got}.")
    return tensor


def check_same_device(device: torch.device, first: str = "q", **tensors: torch.Tensor | None) -> None:
    """``ValueError`` naming the first of ``tensors`` (``None`` skipped) that is not on ``device`` (``first``'s)."""
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(
                f"{name} is on {tensor.device} but {first} is on {device}; move every input to one device."
            )
