"""Compile and autotune the block-diagonal varlen attention backend for a model's static shape before step 1.

The backends' one-time work is keyed on static dims only (heads, head dim, dtype): the cuDNN frontend's CuTe DSL
kernels are JIT-compiled on first use (the compile time on an H200:
``benchmarks/results/blockdiag_cudnn_bwd_probe_2026-11-29.md``), the graph route builds its cuDNN graphs, the
Triton varlen backward times its candidate configurations on its first call (holding extra gradient-sized
buffers while it does), FlexAttention compiles. :func:`warmup` does all of it on a small synthetic step, so a
training run's step 1 finds every cache warm. ``longtrain.prewarm``'s ``blockdiag_autotune`` switch calls it for
every attention module exposing ``blockdiag_attention_shape()``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from . import providers
from .meta import resolve_device, segment_rank
from .runtime import attend
from .state import cp_varlen_runtime_config, normalize_attn_backend

__all__ = ["BLOCKDIAG_SHAPE_KEYS", "warmup"]

#: Keys of a model's attention shape, as ``blockdiag_attention_shape()`` returns them (and ``warmup`` takes them).
BLOCKDIAG_SHAPE_KEYS = ("num_heads", "num_kv_heads", "head_dim", "dtype")


def warmup(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    backend: str | None = None,
    num_tokens: int = 1024,
) -> dict[str, Any]:
    """Run the varlen backend forward + backward on two simulated context-parallel ranks of ``num_tokens`` rows.

    Documents of ``num_tokens // 2``, ``num_tokens`` and ``num_tokens // 2`` tokens over two ranks: rank 0 holds
    whole documents (every document has as many queries as keys), rank 1 starts inside the middle document
    (its first segment has more keys than queries: the bottom-right path). Both go through the provider exactly as
    a layer call of the all-gather path does.

    Args:
        num_heads, num_kv_heads, head_dim: the attention's static shape (``num_heads % num_kv_heads == 0``).
        dtype: the attention inputs' dtype (the fast backends need fp16/bf16).
        device: where training runs.
        backend: a backend name; None = the one ``configure_cp_varlen`` set (``"auto"`` by default).
        num_tokens: rows per simulated rank (>= 8).

    Returns:
        ``{"backend": the provider(s) warmed, "layouts": 2, "fell_back": bool, "finite": bool, "seconds": float}``
        (``"auto"`` warms every provider it may pick for this dtype, whatever the documents' lengths);
        ``fell_back`` is True when the backend is ``dense``, cannot run here or raised (a training step takes the
        dense path then).
    """
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 8:
        raise ValueError(f"num_tokens must be an int >= 8, got {num_tokens!r}")
    dev = resolve_device(device)
    name = backend if backend is not None else cp_varlen_runtime_config()["attn_backend"]
    start = time.perf_counter()
    half = num_tokens // 2
    lengths = [half, num_tokens, 2 * num_tokens - half - num_tokens]
    ids = torch.repeat_interleave(torch.arange(1, 4), torch.tensor(lengths))
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2 * num_tokens, num_kv_heads, head_dim, generator=gen).to(dev, dtype)
    v = torch.randn(2 * num_tokens, num_kv_heads, head_dim, generator=gen).to(dev, dtype)
    metas = [segment_rank(ids, rank * num_tokens, num_tokens, dev) for rank in range(2)]
    if normalize_attn_backend(name) == "auto":  # every provider "auto" may pick for this dtype, any layout
        names = sorted({providers.auto_choice(dtype, dev, cls) for cls in ("long", "short")})
    else:
        names = [providers.resolve_backend(name)]
    finite, fell_back = True, False
    for resolved in names:
        for meta in metas:
            if resolved == "dense" or providers.unavailable_reason(resolved, dtype, dev) is not None:
                fell_back = True
                continue
            q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dev, dtype).requires_grad_()
            kk, vv = k.detach().requires_grad_(), v.detach().requires_grad_()
            with torch.enable_grad():
                try:
                    out = attend(q, kk, vv, meta, resolved)
                except torch.OutOfMemoryError:
                    raise
                except Exception:
                    fell_back = True
                    continue
                grads = torch.autograd.grad(out, (q, kk, vv), torch.ones_like(out))
            finite = finite and bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(g).all()) for g in grads)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {
        "backend": ", ".join(names),
        "layouts": 2,
        "fell_back": fell_back,
        "finite": finite,
        "seconds": time.perf_counter() - start,
    }
