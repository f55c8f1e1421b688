"""The varlen attention providers and the one registry that drives dispatch, validation, docs and reports.

Every provider implements one contract over packed (THD) documents, described by a
:class:`~longtrain.blockdiag_cp.meta.VarlenMeta` whose key coordinates start at 0 (``s_first == 0``):

- ``q: [n_real, Hq, D]``, ``k, v: [kv_len, Hkv, D]`` contiguous, ``Hq % Hkv == 0`` (GQA: the fast kernels never
  repeat K/V heads);
- per-segment attention, causal aligned **bottom-right** (query ``j`` of segment ``s`` sees the segment's first
  ``j + 1 + seg_k[s] - seg_q[s]`` keys; every segment has ``1 <= seg_q <= seg_k``) or, with ``causal=False``, all
  of its segment's keys;
- ``scale`` (``None`` -> ``D ** -0.5``), ``dropout_p``, ``deterministic`` (a deterministic backward where the
  kernel has one);
- returns ``[n_real, Hq, D]`` in ``q``'s dtype, differentiable in ``q``, ``k`` and ``v``.

A provider marked ``full_rows`` (FlexAttention, compiled per shape) takes the whole query chunk and key tensor
instead, with the meta in their coordinates, so its shapes do not change from step to step.

Each provider reports, cheaply and without launching a kernel, why it cannot run for a dtype and device
(:attr:`Provider.unavailable_reason`); :func:`resolve_backend` is the one place that turns a user's backend name
(any synonym, or ``"auto"``) into a provider. Nothing here imports an optional package at module import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import state
from ..meta import VarlenMeta
from . import cudnn, dense, fa4, flash, flex, reference, split, te

__all__ = [
    "AUTO_TABLE",
    "auto_choice",
    "PROVIDERS",
    "Provider",
    "backend_status",
    "get",
    "layout_class",
    "resolve_backend",
    "unavailable_reason",
]


@dataclass(frozen=True)
class Provider:
    """One varlen attention backend: its name, what it needs, and its call."""

    name: str
    """Canonical backend name (what ``configure_cp_varlen(attn_backend=...)`` stores)."""
    summary: str
    """One line for ``longtrain doctor`` and the docs."""
    unavailable_reason: Callable[[torch.dtype, torch.device], str | None]
    """``(dtype, device) -> None or why not``; cheap, never launches a kernel or syncs."""
    attention: Callable[..., torch.Tensor]
    """``(q, k, v, meta, *, scale, dropout_p, causal, deterministic) -> [n_real, Hq, D]``."""
    dropout: bool
    """Whether the kernel applies attention dropout (otherwise ``dropout_p > 0`` is refused)."""
    status_hint: Callable[[], str | None] | None = None
    """Extra detail for ``longtrain doctor`` when the provider can run (e.g. which route it takes)."""
    isolates_nonfinite: bool | Callable[[torch.Tensor, torch.Tensor], bool] = False
    """The kernel alone keeps a non-finite query, key or value inside its document: it never changes another
    document's outputs or gradients (measured on the H200 for the CUDA kernels, ``tests/gpu/test_isolation_gpu.py``).
    A callable ``(q, k) -> bool`` decides per call (a provider with several routes). The runtime wraps every other
    provider (``configure_cp_varlen(nonfinite="isolate")``, the default): it runs it on inputs with non-finite
    elements zeroed and makes NaN every row that attends one."""
    full_rows: bool = False
    """Takes the whole query chunk and key tensor with the meta in their coordinates (rows ``>= n_real`` and keys
    outside ``[s_first, real_end)`` belong to no segment) and returns every row: for kernels compiled per shape,
    whose shapes then stay fixed from step to step."""


def _split(forward: str, backward: str) -> Provider:
    return Provider(
        f"{forward}_{backward}",
        f"{forward}'s forward with {backward}'s backward (the fastest pair on some layouts; no dropout)",
        lambda dtype, device: split.split_unavailable_reason(forward, backward, dtype, device),
        lambda *args, **kwargs: split.split_attention(forward, backward, *args, **kwargs),
        False,
    )


_ENTRIES = (
    Provider(
        "cudnn",
        cudnn.SUMMARY,
        cudnn.unavailable_reason,
        cudnn.attention,
        False,
        cudnn.route_hint,
        isolates_nonfinite=cudnn.takes_graph_route,
    ),  # fmt: skip
    Provider("fa4", fa4.SUMMARY, fa4.unavailable_reason, fa4.attention, False),
    _split("cudnn", "fa4"),
    _split("fa4", "cudnn"),
    Provider(
        "flash",
        flash.SUMMARY,
        flash.unavailable_reason,
        flash.attention,
        True,
        isolates_nonfinite=flash.isolates_nonfinite,
    ),  # fmt: skip
    Provider("te", te.SUMMARY, te.unavailable_reason, te.attention, False),
    Provider("flex", flex.SUMMARY, flex.unavailable_reason, flex.attention, False, full_rows=True),
    Provider("reference", reference.SUMMARY, reference.unavailable_reason, reference.attention, True),
    Provider("dense", dense.SUMMARY, dense.unavailable_reason, dense.attention, True),
)
#: Every provider by canonical name, in registry order.
PROVIDERS: dict[str, Provider] = {p.name: p for p in _ENTRIES}

#: What ``"auto"`` tries on CUDA, first available wins, by ``(layout class, dropout)``. The layout class comes from
#: the call's metadata (:func:`layout_class`): ``"short"`` when the mean document is under 2048 tokens, else
#: ``"long"``. The order follows the H200 run of ``benchmarks/results/blockdiag_attention_2026-12-01.md`` (32K
#: tokens, GQA 32:8, head dim 128, bf16): on documents U[512, 8192] cudnn (CuTe DSL), cudnn_fa4 and fa4 are equal
#: within the run's spread, so the single-library route leads; on U[64, 2048] the CuTe forward with
#: FlashAttention-4's backward (cudnn_fa4) is the fastest per step. Without those libraries: flash (torch's FA2),
#: flex, te.
AUTO_TABLE: dict[tuple[str, bool], tuple[str, ...]] = {
    ("long", False): ("cudnn", "cudnn_fa4", "fa4", "flash", "flex", "te"),
    ("short", False): ("cudnn_fa4", "cudnn", "fa4", "flash", "flex", "te"),
    ("long", True): ("flash",),
    ("short", True): ("flash",),
}
_SHORT_DOC = 2048


def layout_class(meta: VarlenMeta | None) -> str:
    """``"short"`` or ``"long"`` documents (host ints of the meta; ``"long"`` without one)."""
    if meta is None or meta.n_docs == 0:
        return "long"
    return "short" if meta.kv_len / meta.n_docs < _SHORT_DOC else "long"


def get(name: str) -> Provider:
    """The provider registered under the canonical ``name`` (``ValueError`` listing the valid ones)."""
    provider = PROVIDERS.get(name)
    if provider is None:
        raise ValueError(f"unknown block-diagonal varlen backend {name!r}; valid: {', '.join(PROVIDERS)}")
    return provider


def unavailable_reason(name: str, dtype: torch.dtype, device: Any, *, dropout_p: float = 0.0) -> str | None:
    """Why the canonical backend ``name`` cannot run for ``(dtype, device, dropout)``, or None. Never raises."""
    try:
        provider = get(name)
        reason = provider.unavailable_reason(dtype, torch.device(device))
        if reason is None and dropout_p > 0 and not provider.dropout:
            reason = f"the {name} kernel has no attention dropout (dropout_p={dropout_p})"
        return reason
    except Exception as exc:
        return f"cannot evaluate backend {name!r}: {type(exc).__name__}: {exc}"


def resolve_backend(
    name: Any,
    dtype: torch.dtype | None = None,
    device: Any = None,
    *,
    dropout_p: float = 0.0,
    meta: VarlenMeta | None = None,
) -> str:
    """The canonical provider name for ``name``; the one normaliser of backend names in the package.

    ``name``: any spelling :func:`~longtrain.blockdiag_cp.state.normalize_attn_backend` accepts (``None`` -> the
    default, ``"auto"``; ``"sdpa"`` -> ``"dense"``); anything else is a ``ValueError`` listing the valid names.
    A concrete name is returned as is (availability is the caller's question: :func:`unavailable_reason`).
    ``"auto"`` needs ``dtype`` and ``device`` and picks the first available of :data:`AUTO_TABLE`'s row for the
    layout and dropout on CUDA, ``reference`` elsewhere (and when nothing on CUDA can run).
    """
    canon = state.normalize_attn_backend(name)
    if canon != state.ATTN_BACKEND_AUTO:
        return get(canon).name
    if dtype is None or device is None:
        raise ValueError("resolving backend 'auto' needs the call's dtype and device")
    return auto_choice(dtype, device, layout_class(meta), dropout_p)


def auto_choice(dtype: torch.dtype, device: Any, layout: str = "long", dropout_p: float = 0.0) -> str:
    """What ``"auto"`` runs for a dtype, device, layout class (``"short"``/``"long"``) and dropout."""
    dev = torch.device(device)
    if dev.type == "cuda":
        for cand in AUTO_TABLE[(layout, dropout_p > 0)]:
            if unavailable_reason(cand, dtype, dev, dropout_p=dropout_p) is None:
                return cand
    return "reference"


def backend_status() -> list[tuple[str, str | None]]:
    """``(backend, None or the reason it cannot run)`` for every provider, for bf16 on the default device."""
    from longtrain import _optional

    cuda_ok, _ = _optional.torch_cuda()
    device = torch.device("cuda") if cuda_ok else torch.device("cpu")
    rows: list[tuple[str, str | None]] = []
    for provider in _ENTRIES:
        reason = provider.unavailable_reason(torch.bfloat16, device)
        if reason is not None and not cuda_ok and "CUDA" in reason:
            try:  # what it would need beyond a GPU, e.g. "flash_attn not installed; torch's FA2 needs SM80+"
                extra = provider.unavailable_reason(torch.bfloat16, torch.device("cuda"))
            except Exception:
                extra = None
            reason = f"needs CUDA ({extra})" if extra else "needs CUDA"
        rows.append((provider.name, reason))
        if reason is None and provider.status_hint is not None:
            hint = provider.status_hint()
            if hint:
                rows.append((hint, None))
    return rows
