"""``cudnn``: cuDNN attention over packed documents, through the cuDNN frontend. CUDA SM90+, fp16/bf16, no dropout.

Two routes, chosen per call by ``ROUTE`` (``"auto"``: the first that can run):

1. ``"cute"``: the frontend's CuTe DSL varlen attention (:mod:`.cudnn_cute`, needs
   ``nvidia-cudnn-frontend[cutedsl]``, SM90/SM100): among the fastest forward and backward in
   ``benchmarks/results/blockdiag_attention_2026-12-01.md``.
2. ``"graph"``: cuDNN SDPA through the frontend's graph API (:mod:`.cudnn_graph`), with the diagonal and the
   backward kernel chosen by the layout.

If the CuTe forward raises for a static shape under ``"auto"``, that shape takes the graph route from then on
(warned once); out-of-memory errors and a forced route re-raise. cuDNN (9.19) refuses dropout together with a
bottom-right causal diagonal, so this provider has none.
"""

from __future__ import annotations

import torch

from ..meta import VarlenMeta
from . import cudnn_cute, cudnn_graph

__all__ = ["ROUTE", "ROUTES", "SUMMARY", "attention", "route_hint", "takes_graph_route", "unavailable_reason"]

SUMMARY = "cuDNN frontend: CuTe DSL varlen attention, else cuDNN SDPA graphs (CUDA SM90+, fp16/bf16, no dropout)"
#: "auto" (the CuTe DSL route when it can run, else the graph API), "cute" or "graph".
ROUTE: str = "auto"
ROUTES = ("auto", "cute", "graph")


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Documented order: dtype (fp16/bf16), then CUDA SM90+, then the cuDNN frontend."""
    return cudnn_graph.cudnn_unavailable_reason(dtype, device)


def route_hint(device: torch.device | str = "cuda") -> str:
    """Which route the provider takes on this machine (for ``longtrain doctor``)."""
    probe = torch.empty(1, 8, 128, device=device, dtype=torch.bfloat16)
    why = cudnn_cute.cute_unavailable_reason(probe, probe)
    return "cudnn route -> CuTe DSL" if why is None else f"cudnn route -> graph API (CuTe DSL: {why})"


def _check_route() -> None:
    if ROUTE not in ROUTES:
        raise ValueError(f"providers.cudnn.ROUTE must be one of {ROUTES}, got {ROUTE!r}")


def takes_graph_route(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether :func:`attention` will run the graph route for these inputs (cheap; no kernel, no sync). The graph
    route keeps a non-finite value inside its document (measured on the H200 with each of its backwards,
    ``tests/gpu/test_isolation_gpu.py``); the CuTe DSL route does not."""
    _check_route()
    if ROUTE == "graph":
        return True
    if ROUTE == "cute":
        return False
    shape = ("cute", q.shape[1], k.shape[1], q.shape[2], q.dtype)
    return (cudnn_graph.FAILED.get(shape) or cudnn_cute.cute_unavailable_reason(q, k)) is not None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    causal: bool = True,
    deterministic: bool = False,
) -> torch.Tensor:
    """``q: [n_real, Hq, D]``, ``k/v: [kv_len, Hkv, D]`` -> ``[n_real, Hq, D]`` (the provider contract)."""
    if dropout_p:
        raise ValueError(
            f"the cuDNN varlen backend has no attention dropout (got dropout_p={dropout_p}): cuDNN supports a "
            "bottom-right causal diagonal only without dropout; use backend='flash' for dropout"
        )
    _check_route()
    hq, d = q.shape[1], q.shape[2]
    scale = scale if scale is not None else d**-0.5
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if ROUTE != "graph":
        shape = ("cute", hq, k.shape[1], d, q.dtype)
        reason = cudnn_graph.FAILED.get(shape) if ROUTE == "auto" else None
        reason = reason or cudnn_cute.cute_unavailable_reason(q, k)
        if reason is None:
            try:
                return cudnn_cute.cute_attention(q, k, v, meta, scale=scale, causal=causal, deterministic=deterministic)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:
                if ROUTE != "auto":
                    raise
                reason = cudnn_graph.note_failure(shape, "CuTe DSL attention", "the graph API", exc)
        if ROUTE == "cute":
            raise RuntimeError(f"providers.cudnn.ROUTE='cute' but that route cannot run: {reason}")
    return cudnn_graph.graph_attention(q, k, v, meta, scale=scale, causal=causal, deterministic=deterministic)
