"""The CuTe route of the ``cudnn`` provider: the cuDNN frontend's CuTe DSL varlen attention (``cudnn.flex_attention``).

The cuDNN frontend (``nvidia-cudnn-frontend[cutedsl]``) ships an interval-mask attention for packed THD
documents, forward and backward, compiled for Hopper and Blackwell. The visible keys of each query are given
as data: for a document with ``Lq`` queries and ``Lk >= Lq`` keys aligned bottom-right, query ``i`` sees the
document's keys ``[0, i + 1 + Lk - Lq)``. :func:`visible_key_counts` builds that per-query count on the device
(no host sync), :func:`cute_attention` builds the frontend's mask plan from it once per step layout
(cached in the metadata, so every layer of the step reuses it) and runs the attention with GQA native.

On an H200 this route is faster than the graph API with a bottom-right diagonal, forward and backward
(``benchmarks/results/blockdiag_cudnn_bwd_probe_2026-11-29.md``: 32K tokens of documents U[512, 8192], GQA 32:8,
head dim 128, bf16). The kernels are JIT-compiled once per (head dims, head counts, dtype) by the frontend on
first use; a new step layout only builds a new plan (compile and plan-build times: the same report).
"""

from __future__ import annotations

import time

import torch

from longtrain import _optional

from ..meta import VarlenMeta

__all__ = [
    "PLAN_STATS",
    "cute_attention",
    "cute_backward",
    "cute_forward",
    "cute_unavailable_reason",
    "visible_key_counts",
]

#: Mask plans built / reused (one plan per step layout, reused by every layer of the step) and build seconds.
PLAN_STATS = {"built": 0, "reused": 0, "build_s": 0.0}


def visible_key_counts(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, causal: bool = True) -> torch.Tensor:
    """``[1, 1, T_q] int32``: how many leading keys of its document each query sees (bottom-right causal, or all of
    them with ``causal=False``).

    ``cu_q/cu_k: [N+1]`` integer offsets with ``cu_q[-1] == T_q`` and every document holding at least as many
    keys as queries. Device-side torch ops only (``total_q`` is the caller's host value).
    """
    n_docs = cu_q.numel() - 1
    lq = (cu_q[1:] - cu_q[:-1]).long()
    lk = (cu_k[1:] - cu_k[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(n_docs, device=cu_q.device), lq, output_size=total_q)
    if not causal:
        return lk[doc].to(torch.int32).view(1, 1, total_q).contiguous()
    pos = torch.arange(total_q, device=cu_q.device) - cu_q[:-1].long()[doc]
    return (pos + 1 + (lk - lq)[doc]).to(torch.int32).view(1, 1, total_q).contiguous()


def cute_unavailable_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why this route cannot run these tensors (device, SM generation, package, head dim), or None."""
    if q.device.type != "cuda":
        return f"the cuDNN CuTe DSL attention requires CUDA, got device={q.device}"
    major, _ = torch.cuda.get_device_capability(q.device)
    if major not in (9, 10):
        return f"the cuDNN CuTe DSL attention runs on SM90/SM100, this GPU is SM{major}x"
    ok, reason = _optional.cudnn_cute()
    if not ok:
        return reason
    from cudnn.flex_attention.plan.validation import is_supported_head_dims

    if not is_supported_head_dims(q.shape[-1], k.shape[-1]):
        return f"the cuDNN CuTe DSL attention does not support head dim {q.shape[-1]}"
    return None


def _plan(q, k, v, cu_q, cu_k, max_q, max_k, cache: dict | None, causal: bool = True, need_bwd: bool | None = None):
    from cudnn.flex_attention import create_mask_plan

    if need_bwd is None:
        need_bwd = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    key = ("cudnn_cute_plan", id(cu_q), id(cu_k), q.shape[1], k.shape[1], q.shape[2], q.dtype, str(q.device), need_bwd,
           causal)  # fmt: skip
    if cache is not None and key in cache:
        PLAN_STATS["reused"] += 1
        return cache[key]
    t0 = time.perf_counter()
    plan = create_mask_plan(
        visible_key_counts(cu_q, cu_k, q.shape[0], causal), q, k, v,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k),
        build_backward=need_bwd,
    )  # fmt: skip
    PLAN_STATS["built"] += 1
    PLAN_STATS["build_s"] += time.perf_counter() - t0
    if cache is not None:
        cache[key] = plan
    return plan


def cute_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    *,
    scale: float,
    causal: bool = True,
    deterministic: bool = False,
) -> torch.Tensor:
    """Packed-document attention through the cuDNN frontend's CuTe DSL kernels (the provider contract).

    ``q: [n_real, Hq, D]``, ``k/v: [kv_len, Hkv, D]`` contiguous fp16/bf16 CUDA tensors; returns ``[n_real, Hq, D]``,
    differentiable in q, k and v (the frontend's own backward; ``deterministic`` selects its deterministic
    variant). The mask plan is cached in ``meta.cache``: one per step layout and autograd mode.
    """
    from cudnn.flex_attention import flex_attn_func

    plan = _plan(q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, meta.cache, causal)
    return flex_attn_func(q, k, v, mask_plan=plan, softmax_scale=float(scale), deterministic=bool(deterministic))


def cute_forward(q, k, v, meta: VarlenMeta, *, scale: float, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The CuTe DSL forward alone: ``(out [n_real, Hq, D], lse [Hq, n_real] fp32)`` (the natural-log log-sum-exp),
    for a backward of another provider. The plan is built with its backward, so :func:`cute_backward` can follow."""
    from cudnn.flex_attention.execution import _flex_attention_forward

    plan = _plan(q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, meta.cache, causal, need_bwd=True)
    out, lse, _ = _flex_attention_forward(q, k, v, mask_plan=plan, softmax_scale=float(scale), return_lse=True)
    return out, lse


def cute_backward(dout, q, k, v, out, lse, meta: VarlenMeta, *, scale: float, causal: bool = True,
                  deterministic: bool = False) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The CuTe DSL backward from any forward's ``out`` and ``lse [Hq, n_real]``: ``(dq, dk, dv)``."""
    from cudnn.flex_attention.execution import _flex_attention_backward

    plan = _plan(q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, meta.cache, causal, need_bwd=True)
    dq, dk, dv = _flex_attention_backward(q, k, v, out, dout, lse.contiguous(), mask_plan=plan,
                                          softmax_scale=float(scale), deterministic=bool(deterministic))  # fmt: skip
    return dq, dk, dv
