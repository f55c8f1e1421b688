"""Compile / autotune warmup for longtrain's block-diagonal varlen attention backend."""

from __future__ import annotations

from typing import Any

import torch

from longtrain.blockdiag_cp.warmup import BLOCKDIAG_SHAPE_KEYS
from longtrain.prewarm._common import (
    _log,
    _log_failure,
    _note_shapes,
    _note_skip,
    _pkg,
    _release,
    _rng_neutral,
    _shape_key,
    _skip,
)

BlockdiagShape = tuple[int, int, int, torch.dtype]


def _blockdiag_shape_key(shape: Any, name: str) -> BlockdiagShape:
    return _shape_key(shape, BLOCKDIAG_SHAPE_KEYS, "blockdiag_attention_shape", name)  # type: ignore[return-value]


def _collect_blockdiag_attention_shapes(model_parts: list[torch.nn.Module]) -> dict[BlockdiagShape, str]:
    """``(num_heads, num_kv_heads, head_dim, dtype) -> first module name`` for every module exposing a callable
    ``blockdiag_attention_shape()``, deduplicated, in discovery order (a malformed dict raises, naming it)."""
    shapes: dict[BlockdiagShape, str] = {}
    for part in model_parts:
        for name, module in part.named_modules():
            fn = getattr(module, "blockdiag_attention_shape", None)
            if callable(fn):
                shapes.setdefault(_blockdiag_shape_key(fn(), name or "<root>"), name)
    return shapes


def _prewarm_blockdiag_autotune(model_parts: list[torch.nn.Module], device: torch.device | int | str | None) -> bool:
    """Warm the varlen attention backend that ``configure_cp_varlen`` selected: ``longtrain.blockdiag_cp.warmup.
    warmup(**shape, device=device)`` once per unique shape (the cuDNN CuTe DSL JIT, cuDNN graphs, the Triton
    varlen backward's autotune, FlexAttention's compile). Needs CUDA. One failing shape is logged and the next
    still runs.

    Returns:
        True if the warmup ran for at least one shape.
    """
    pkg = _pkg()
    dev = pkg._resolve_cuda_device(device, "block-diagonal attention autotune")
    if dev is None:
        return False
    shapes = pkg._collect_blockdiag_attention_shapes(model_parts)
    if not shapes:
        _log().warning("blockdiag autotune prewarm enabled but no module exposes blockdiag_attention_shape().")
        _note_skip("no module exposes blockdiag_attention_shape()")
        return False
    ok, warmup = pkg.safe_import_from("longtrain.blockdiag_cp.warmup", "warmup")
    if not ok or not callable(warmup):
        _skip("Skipping blockdiag autotune prewarm: longtrain.blockdiag_cp.warmup is not available.")
        return False
    described = [" ".join(f"{k}={v}" for k, v in zip(BLOCKDIAG_SHAPE_KEYS, key)) for key in shapes]
    _note_shapes([f"{text} ({n or '<root>'})" for text, n in zip(described, shapes.values())])
    ran = False
    with _rng_neutral(dev):
        for key, name in shapes.items():
            kwargs = dict(zip(BLOCKDIAG_SHAPE_KEYS, key))
            _log().info("Prewarming block-diagonal varlen attention | module=%s %s", name, kwargs)
            try:
                result = warmup(**kwargs, device=dev)
                _log().info("Block-diagonal attention warmed: %s", result)
                ran = True
            except Exception:
                _log_failure("blockdiag autotune prewarm failed for %s; continuing.", name)
            finally:
                _release(dev)
    _log().info("Finished blockdiag autotune prewarm.")
    return ran
