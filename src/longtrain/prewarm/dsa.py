"""Autotune warmup for longtrain's own DeepSeek Sparse Attention Triton kernels."""

from __future__ import annotations

from typing import Any

import torch

from longtrain.prewarm._common import (
    _collect_shapes,
    _device_and_shapes,
    _pkg,
    _shape_key,
    _skip,
    _warm_each_shape,
)

DSA_SHAPE_KEYS = ("num_heads", "d_qk", "d_v", "topk", "index_heads", "index_dim", "dtype")
DSAShape = tuple[int, int, int, int, int, int, torch.dtype]


def _dsa_shape_key(shape: Any, name: str) -> DSAShape:
    return _shape_key(shape, DSA_SHAPE_KEYS, "dsa_autotune_shape", name)  # type: ignore[return-value]


def _collect_dsa_autotune_shapes(model_parts: list[torch.nn.Module]) -> dict[DSAShape, str]:
    """``(num_heads, d_qk, d_v, topk, index_heads, index_dim, dtype) -> first module name`` for every module
    exposing a callable ``dsa_autotune_shape()`` (the DSA layer does), deduplicated, in discovery order.

    A malformed shape dict raises ``TypeError``/``ValueError`` naming the module (the caller logs it).
    """
    return _collect_shapes(model_parts, "dsa_autotune_shape", DSA_SHAPE_KEYS)  # type: ignore[return-value]


def _prewarm_dsa_autotune(model_parts: list[torch.nn.Module], device: torch.device | int | str | None) -> bool:
    """Warm the autotune caches of longtrain's DSA Triton kernels: ``longtrain.dsa.triton.warmup(**shape,
    device=device)`` once per unique shape. Needs CUDA and triton; skipped (with a logged reason) when
    ``longtrain.dsa.triton.warmup`` is unavailable. One failing shape is logged and the next still runs.

    Returns:
        True if the warmup ran for at least one shape.
    """
    pkg = _pkg()
    dev, shapes = _device_and_shapes(
        device,
        "DSA autotune",
        "_collect_dsa_autotune_shapes",
        model_parts,
        "no module exposes dsa_autotune_shape()",
        "DSA autotune prewarm enabled but no module exposes dsa_autotune_shape().",
    )
    if dev is None:
        return False
    ok_triton, _ = pkg.safe_import("triton")
    if not ok_triton:
        _skip("Skipping DSA autotune prewarm: triton is not importable.")
        return False
    ok, warmup = pkg.safe_import_from("longtrain.dsa.triton", "warmup")
    if not ok or not callable(warmup):
        _skip("Skipping DSA autotune prewarm: longtrain.dsa.triton.warmup is not available.")
        return False
    return _warm_each_shape(dev, shapes, DSA_SHAPE_KEYS, warmup, "DSA autotune", "DSA Triton kernels")
