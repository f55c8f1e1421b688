"""Compile / autotune warmup for longtrain's block-diagonal varlen attention backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from longtrain.blockdiag_cp.state import ATTN_BACKEND_DENSE, cp_varlen_runtime_config, normalize_attn_backend
from longtrain.blockdiag_cp.warmup import BLOCKDIAG_SHAPE_KEYS
from longtrain.prewarm._common import (
    _collect_shapes,
    _device_and_shapes,
    _pkg,
    _shape_key,
    _skip,
    _warm_each_shape,
)

BlockdiagShape = tuple[int, int, int, torch.dtype]


def _blockdiag_shape_key(shape: Any, name: str) -> BlockdiagShape:
    return _shape_key(shape, BLOCKDIAG_SHAPE_KEYS, "blockdiag_attention_shape", name)  # type: ignore[return-value]


def _collect_blockdiag_attention_shapes(model_parts: list[torch.nn.Module]) -> dict[BlockdiagShape, str]:
    """``(num_heads, num_kv_heads, head_dim, dtype) -> first module name`` for every module exposing a callable
    ``blockdiag_attention_shape()``, deduplicated, in discovery order (a malformed dict raises, naming it)."""
    return _collect_shapes(model_parts, "blockdiag_attention_shape", BLOCKDIAG_SHAPE_KEYS)  # type: ignore[return-value]


def _fail_on_fallback(warmup: Callable[..., Any]) -> Callable[..., Any]:
    """``warmup`` that raises when it fell back: ``warmup()`` catches a backend's exception (or skips a backend that
    cannot run here) and reports ``fell_back``, so nothing was compiled or tuned for that backend and the shape must
    count as a failure, not as warmed."""

    def checked(**kwargs: Any) -> Any:
        result = warmup(**kwargs)
        if isinstance(result, dict) and result.get("fell_back"):
            raise RuntimeError(
                f"the block-diagonal attention backend(s) {result.get('backend')!r} raised or cannot run here, so "
                "nothing was warmed for them and a training step with this shape takes the dense path; run "
                "`longtrain doctor` to see why, or pick a backend that runs here with "
                "configure_cp_varlen(attn_backend=...)"
            )
        return result

    return checked


def _prewarm_blockdiag_autotune(model_parts: list[torch.nn.Module], device: torch.device | int | str | None) -> bool:
    """Warm the varlen attention backend that ``configure_cp_varlen`` selected: ``longtrain.blockdiag_cp.warmup.
    warmup(**shape, device=device)`` once per unique shape (the cuDNN CuTe DSL JIT, cuDNN graphs, the Triton
    varlen backward's autotune, FlexAttention's compile). Needs CUDA. One failing shape is logged and the next
    still runs; a shape whose backend raised or cannot run (``warmup()``'s ``fell_back``) counts as failed. With
    the ``dense`` backend configured there is nothing to warm: skipped.

    Returns:
        True if the warmup ran for at least one shape.
    """
    pkg = _pkg()
    dev, shapes = _device_and_shapes(
        device,
        "block-diagonal attention autotune",
        "_collect_blockdiag_attention_shapes",
        model_parts,
        "no module exposes blockdiag_attention_shape()",
        "blockdiag autotune prewarm enabled but no module exposes blockdiag_attention_shape().",
    )
    if dev is None:
        return False
    if normalize_attn_backend(cp_varlen_runtime_config()["attn_backend"]) == ATTN_BACKEND_DENSE:
        _skip("Skipping blockdiag autotune prewarm: the configured attention backend is 'dense' (nothing to warm).")
        return False
    ok, warmup = pkg.safe_import_from("longtrain.blockdiag_cp.warmup", "warmup")
    if not ok or not callable(warmup):
        _skip("Skipping blockdiag autotune prewarm: longtrain.blockdiag_cp.warmup is not available.")
        return False
    return _warm_each_shape(
        dev, shapes, BLOCKDIAG_SHAPE_KEYS, _fail_on_fallback(warmup), "blockdiag autotune", "Block-diagonal attention"
    )
